"""Which int8 kernel variants beat oneDNN's fp32 GEMM at prefill sizes (`kernels.int8_beats_gemm`).

Each int8 variant this CPU runs (quant_linear_int8 on Q4_1 projections of SmolLM2-135M's shapes,
random blocks so that nothing needs the embedded model, x quantized per call) against oneDNN's
packed fp32 GEMM (what Linear runs past the block kernel's row limit), for
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


def _median_ms(f, reps: int = 20) -> float:
    for _ in range(3):
        f()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return sorted(times)[reps // 2] * 1e3


def _random_q4_1(n: int, k: int, g):
    """Random Q4_1 blocks with fp16 scales and minimums of a trained model's size."""
    import torch

    from sparkserve.kernels import BLOCK_BYTES, Q4_1, BlockWeight
    b = torch.randint(0, 256, (n, k // 32, BLOCK_BYTES[Q4_1]), dtype=torch.uint8, generator=g)
    for lo, std in ((0, 0.02), (2, 0.1)):
        b[..., lo:lo + 2] = (torch.randn(n, k // 32, generator=g) * std).to(torch.float16).view(torch.uint8)\
            .view(n, k // 32, 2)
    return BlockWeight(Q4_1, b.view(n, -1), k)


def measure(threads: int) -> dict:
    """In this process (oneDNN at whatever ISA its environment allows): ms per call."""
    import torch

    from sparkserve import kernels
    torch.set_num_threads(threads)
    torch.set_grad_enabled(False)
    g = torch.Generator().manual_seed(0)
    hidden, kv, inter = 576, 192, 1536           # SmolLM2-135M: 9 query and 3 KV heads of 64
    shapes = {"qkv_proj": (hidden + 2 * kv, hidden), "o_proj": (hidden, hidden),
              "gate_up_proj": (2 * inter, hidden), "down_proj": (hidden, inter)}
    out = {}
    for name, (n, k) in shapes.items():
        blocks = _random_q4_1(n, k, g)
        packed = torch.ops.mkldnn._reorder_linear_weight(blocks.dequantize())
        for m in MS:
            x = torch.randn(m, k)
            gemm = torch.ops.mkldnn._linear_pointwise
            row = {"onednn": _median_ms(lambda: gemm(x, packed, None, "none", [], ""))}
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
