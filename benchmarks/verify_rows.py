"""What one more verified row costs, per int8 kernel variant: the native forward step of a
SmolLM2-135M-shaped model (30 layers, random Q4_1 blocks, so nothing needs the embedded model)
over n = 1..16 query rows of one request after a context, with int8 activations.

DSpark's verify forward scores the anchor and its drafts in one step; it pays at batch 1 when
n rows cost little more than one. Each variant this CPU runs is timed in its own process (the
dispatcher reads SPARKSERVE_KERNEL_VARIANTS_OFF once), the variants alternating over rounds.

    PYTHONPATH=. python benchmarks/verify_rows.py [--threads 2] [--context 256] [--rounds 3]
writes benchmarks/results/verify_rows.{json,md} (SPARKSERVE_BENCH_RESULTS=DIR sends them elsewhere)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import sparkserve  # noqa: F401  (before torch: its OpenMP threads must be told to wait passively)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fresh_process import run_json  # noqa: E402
from int8_vs_onednn import _median_ms, _random_q4_1  # noqa: E402
from results_io import machine_line, write_results  # noqa: E402

ROWS = (1, 2, 3, 4, 6, 8, 12, 16)
# SmolLM2-135M: hidden 576, 9 query and 3 KV heads of 64, MLP 1536, 30 layers
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS = 576, 9, 3, 64, 1536, 30


def measure(threads: int, context: int, reps: int) -> dict:
    """In this process (whatever variant the dispatcher picks): median ms of a step per row count."""
    import torch

    from sparkserve import kernels
    from sparkserve.kernels.build import load_extension
    from sparkserve.layers.rotary import RotaryEmbedding
    torch.set_num_threads(threads)
    torch.set_grad_enabled(False)
    g = torch.Generator().manual_seed(0)
    rotary = RotaryEmbedding(HEAD_DIM, context + max(ROWS) + 1, 100000.0)
    ones = torch.ones(HIDDEN)
    step = load_extension().NativeLlama(HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, 1e-5, rotary.cos,
                                        rotary.sin, ones)
    for _ in range(LAYERS):
        qkv, o = _random_q4_1((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN, g), _random_q4_1(HIDDEN, HIDDEN, g)
        gate_up, down = _random_q4_1(2 * INTER, HIDDEN, g), _random_q4_1(HIDDEN, INTER, g)
        step.add_layer(qkv.blocks, qkv.qtype, None, o.blocks, o.qtype, gate_up.blocks, gate_up.qtype,
                       down.blocks, down.qtype, ones, ones, None, None, 0)
    slots = context + max(ROWS) + 1                    # slot 0 is the pad slot
    k = [torch.randn(slots, KV_HEADS, HEAD_DIM, generator=g) for _ in range(LAYERS)]
    v = [torch.randn(slots, KV_HEADS, HEAD_DIM, generator=g) for _ in range(LAYERS)]
    step.set_pool(k, v, [])
    out = {"variant": kernels.variant()}
    for n in ROWS:
        x = torch.randn(n, HIDDEN, generator=g)
        positions = torch.arange(context, context + n)
        loc = positions + 1
        table = torch.arange(1, context + n + 1)[None, :]

        out[n] = _median_ms(lambda: step.forward(x, positions, loc, table, 0, None, None, 0, [context + n],
                                                 [n], [], True, True), reps)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=256, help="context tokens before the rows")
    ap.add_argument("--reps", type=int, default=15, help="timed steps per row count and round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over the variants (median of rounds)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(measure(a.threads, a.context, a.reps)))
        return 0
    from sparkserve import kernels
    variants = kernels.runnable_variants()
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for _ in range(a.rounds):
        for v in variants:
            env = dict(os.environ, SPARKSERVE_KERNEL_VARIANTS_OFF=",".join(variants[:variants.index(v)]))
            res = run_json(__file__, ["--child", "--threads", str(a.threads), "--context", str(a.context),
                                      "--reps", str(a.reps)], env)
            assert res["variant"] == v, (v, res["variant"])
            runs[v].append(res)
    ms = {v: {n: statistics.median(r[str(n)] for r in rs) for n in ROWS} for v, rs in runs.items()}
    best_one = min(ms[v][1] for v in variants)
    lines = ["# Native forward step per number of query rows, per int8 variant", "", machine_line(),
             f"SmolLM2-135M shape (30 layers, random Q4_1 blocks), one request after {a.context} context "
             f"tokens, int8 activations, {a.threads} threads; no LM head. Cells: ms of one step (median "
             f"of {a.rounds} rounds of {a.reps} steps, variants alternating) and, in brackets, the step "
             "over the fastest one-row step of any variant: a DSpark verify of n rows costs that many "
             "decode steps' forwards.", "",
             "| variant | " + " | ".join(f"{n} rows" for n in ROWS) + " |", "|---|" + "---|" * len(ROWS)]
    for v in variants:
        cells = [f"{ms[v][n]:.2f} ({ms[v][n] / best_one:.2f}x)" for n in ROWS]
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    write_results("verify_rows", {"threads": a.threads, "context": a.context, "ms": ms, "runs": runs}, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
