"""Which int8 kernel variants beat oneDNN's fp32 GEMM at prefill sizes (`kernels.int8_beats_gemm`).

Each int8 variant this CPU runs (quant_linear_int8 on SmolLM2's Q4_1 projections, x quantized per
call) against oneDNN's packed fp32 GEMM (what Linear runs past the block kernel's row limit), for
M = 16, 64, 128, 512, median of repeated calls. oneDNN runs once at the CPU's own width and once
capped to AVX2 (ONEDNN_MAX_CPU_ISA=AVX2, a fresh process: it reads the cap at start-up), which
stands in for a CPU without AVX-512: the ymm variants must beat that one to take prefill sizes.

    PYTHONPATH=. python benchmarks/int8_vs_onednn.py [--threads 2]
writes benchmarks/results/int8_vs_onednn.{json,md}."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results_io import machine_line, write_results  # noqa: E402

MS = (16, 64, 128, 512)
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _median_ms(f, reps: int = 20) -> float:
    for _ in range(3):
        f()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return sorted(times)[reps // 2] * 1e3


def measure(threads: int) -> dict:
    """In this process (oneDNN at whatever ISA its environment allows): ms per call."""
    import torch

    from sparkserve import kernels
    from sparkserve.embedded import default_model_path
    from sparkserve.models.llama_native import _projections
    from sparkserve.models.registry import load_model
    torch.set_num_threads(threads)
    torch.set_grad_enabled(False)
    layer = load_model(default_model_path()).model.layers[0]
    out = {}
    for name, lin in zip(PROJECTIONS, _projections(layer)):
        blocks = lin.inference_blocks()
        for m in MS:
            x = torch.randn(m, lin.in_features)
            gemm = torch.ops.mkldnn._linear_pointwise
            row = {"onednn": _median_ms(lambda: gemm(x, lin._packed, None, "none", [], ""))}
            for v in kernels.runnable_variants():
                row[v] = _median_ms(lambda: kernels.quant_linear_int8(x, blocks, variant=v))
            out[f"{name}/{m}"] = row
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(measure(a.threads)))
        return 0
    runs = {}
    for cap in ("native", "AVX2"):
        env = dict(os.environ)
        if cap != "native":
            env["ONEDNN_MAX_CPU_ISA"] = cap
        proc = subprocess.run([sys.executable, __file__, "--child", "--threads", str(a.threads)], env=env,
                              capture_output=True, text=True, check=True)
        runs[cap] = json.loads(proc.stdout.strip().splitlines()[-1])
    variants = [v for v in next(iter(runs["native"].values())) if v != "onednn"]
    lines = ["# Int8 kernel variants vs oneDNN's fp32 GEMM at prefill sizes", "", machine_line(),
             f"Threads: {a.threads}. Cells: int8 time / oneDNN time (below 1: int8 faster); oneDNN ms in "
             "brackets. A variant should take prefill sizes where it wins against the oneDNN of a CPU "
             "that has it: the AVX-512 ones against native oneDNN, the ymm ones against AVX2 oneDNN.", ""]
    for cap, res in runs.items():
        lines += [f"## oneDNN {'at the CPU width' if cap == 'native' else 'capped to ' + cap}", "",
                  "| projection / M | " + " | ".join(variants) + " |", "|---|" + "---|" * len(variants)]
        for key, row in res.items():
            cells = [f"{row[v] / row['onednn']:.2f}" for v in variants]
            lines.append(f"| {key} ({row['onednn']:.3f} ms) | " + " | ".join(cells) + " |")
        lines.append("")
    write_results("int8_vs_onednn", {"threads": a.threads, "runs": runs}, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
