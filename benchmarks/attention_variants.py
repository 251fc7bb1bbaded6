"""The decode attention's variants side by side: one call of `decode_attention` per layer of a
SmolLM2-135M-shaped model (9 query heads, 3 KV heads of 64; a float16 pool per layer, as a GGUF
model's default cache, at consecutive slots), for one request's 1 / 3 / 8 query rows (decode and
DSpark VERIFY blocks) and 8 requests' decode, at several contexts.

The variants (decode_attention_variants(): zmm where the CPU has AVX-512, ymm everywhere) run in
one process, alternating call by call within each round, so the machine's drift hits them alike;
medians of the rounds. Each call goes through the Python binding, as the layer path makes it (the
native step calls the same kernel without it).

    PYTHONPATH=. python benchmarks/attention_variants.py [--threads 2] [--rounds 15]
writes benchmarks/results/attention_variants.{json,md} (SPARKSERVE_BENCH_RESULTS=DIR sends them elsewhere)."""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import sparkserve  # noqa: F401  (before torch: its OpenMP threads must be told to wait passively)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results_io import machine_line, write_results  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30
CONTEXTS = (128, 512, 2048)
SHAPES = ((1, 1), (1, 3), (1, 8), (8, 1))      # (requests, query rows each)


def measure(threads: int, rounds: int) -> dict:
    import torch

    from sparkserve.kernels.build import load_extension
    torch.set_num_threads(threads)
    ext = load_extension()
    variants = ext.decode_attention_variants()
    g = torch.Generator().manual_seed(0)
    out: dict = {"variants": variants, "us": {}}
    for ctx in CONTEXTS:
        for B, n in SHAPES:
            slots = B * (ctx + n) + 1                     # slot 0 is the pad slot
            k = [torch.randn(slots, KV_HEADS, HEAD_DIM, generator=g).half() for _ in range(LAYERS)]
            v = [torch.randn(slots, KV_HEADS, HEAD_DIM, generator=g).half() for _ in range(LAYERS)]
            table = 1 + torch.arange(B * (ctx + n)).view(B, ctx + n)
            q = torch.randn(B * n, HEADS, HEAD_DIM, generator=g)
            args = ([ctx + n] * B, 0, 0, HEAD_DIM ** -0.5, [n] * B)
            times: dict[str, list[float]] = {name: [] for name in variants}
            for r in range(rounds + 1):
                for name in variants:
                    t = time.perf_counter()
                    for layer in range(LAYERS):
                        ext.decode_attention(q, k[layer], v[layer], table, *args, name)
                    if r:                                   # the first round warms up
                        times[name].append((time.perf_counter() - t) / LAYERS * 1e6)
            out["us"][f"{ctx}/{B}x{n}"] = {name: statistics.median(t) for name, t in times.items()}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    a = ap.parse_args()
    res = measure(a.threads, a.rounds)
    variants = res["variants"]
    base = variants[-1]
    lines = ["# Decode attention per variant, SmolLM2-135M shape", "", machine_line(),
             f"9 query / 3 KV heads of 64, float16 pool, {a.threads} threads; us per layer call (median of "
             f"{a.rounds} rounds of {LAYERS} layers, variants alternating); in brackets, against {base}.",
             "", "| context | requests x query rows | " + " | ".join(variants) + " |",
             "|---|---|" + "---|" * len(variants)]
    for key, us in res["us"].items():
        ctx, shape = key.split("/")
        cells = [f"{us[v]:.1f} ({us[v] / us[base]:.2f}x)" for v in variants]
        lines.append(f"| {ctx} | {shape} | " + " | ".join(cells) + " |")
    write_results("attention_variants", {"threads": a.threads, "rounds": a.rounds, **res}, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
