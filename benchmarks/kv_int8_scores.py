"""The int8 pool's decode attention with VNNI integer scores (avx512vnni) against its float path
(avx512: keys dequantized in registers, fp32 products) and a float16 pool, at batch-8 decode:
one `decode_attention` call per layer of a SmolLM2-135M-shaped model (9 query heads, 3 KV heads of
64), each layer its own pool (LAYERS of them, so the K/V of a step do not sit in the caches), the
8 requests' slots scattered over the pool as after recycling. The three run in one process,
alternating call by call within each round, so the machine's drift hits them alike; medians of
the rounds and of the per-round ratios. Kernel time only: benchmarks/kv_cache_dtype.py has the
whole decode step.

    PYTHONPATH=. python benchmarks/kv_int8_scores.py [--threads 2] [--rounds 9]
writes benchmarks/results/kv_int8_scores.{json,md}."""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import sparkserve  # noqa: F401  (before torch: its OpenMP threads must be told to wait passively)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results_io import machine_line, write_results  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, LAYERS, BATCH = 9, 3, 64, 4, 8
CONTEXTS = (512, 2048, 8192)
CASES = {"float16": ("float16", ""), "int8 float scores": ("int8", "avx512"),
         "int8 VNNI scores": ("int8", "avx512vnni")}


def measure(threads: int, rounds: int) -> dict:
    import torch

    from sparkserve.kernels.build import load_extension
    from sparkserve.mem.kv_quant import quantize
    torch.set_num_threads(threads)
    ext = load_extension()
    assert "avx512vnni" in ext.decode_attention_variants(), "this CPU does not run the avx512vnni variant"
    g = torch.Generator().manual_seed(0)
    out: dict = {"us": {}, "ratio": {}}
    for ctx in CONTEXTS:
        slots = BATCH * ctx + 1
        pools = {"float16": [], "int8": []}
        for _ in range(LAYERS):
            k, v = (torch.randn(slots, KV_HEADS, HEAD_DIM, generator=g) for _ in range(2))
            pools["float16"].append((k.half(), v.half(), {}))
            (kq, ks), (vq, vs) = quantize(k, torch.int8), quantize(v, torch.int8)
            pools["int8"].append((kq, vq, {"k_scale": ks, "v_scale": vs}))
            del k, v
        kv_indices = (1 + torch.randperm(slots - 1, generator=g)).view(BATCH, ctx)
        q = torch.randn(BATCH, HEADS, HEAD_DIM, generator=g)
        times: dict[str, list[float]] = {name: [] for name in CASES}
        for r in range(rounds):
            order = list(CASES) if r % 2 == 0 else list(reversed(CASES))
            for name in order:
                dtype, variant = CASES[name]
                t0 = time.perf_counter()
                for kb, vb, sc in pools[dtype]:
                    ext.decode_attention(q, kb, vb, kv_indices, [ctx] * BATCH, 0, 0, HEAD_DIM ** -0.5, [],
                                         variant, **sc)
                times[name].append((time.perf_counter() - t0) / LAYERS * 1e6)
        out["us"][ctx] = {name: statistics.median(t) for name, t in times.items()}
        def ratio(a: str, b: str) -> float:
            return statistics.median(x / y for x, y in zip(times[a], times[b]))
        out["ratio"][ctx] = {"float scores / VNNI": ratio("int8 float scores", "int8 VNNI scores"),
                             "float16 / VNNI": ratio("float16", "int8 VNNI scores"),
                             "float16 / float scores": ratio("float16", "int8 float scores")}
        print(ctx, out["us"][ctx], out["ratio"][ctx], flush=True)
        del pools
    return out


def markdown(res: dict, threads: int, rounds: int) -> list[str]:
    lines = ["# int8 KV: VNNI integer scores vs float scores vs float16 (decode attention kernel)", "",
             machine_line(), "",
             f"Batch-{BATCH} decode, one call per layer (SmolLM2-135M shapes: {HEADS} heads, {KV_HEADS} KV "
             f"heads of {HEAD_DIM}), {threads} threads, median of {rounds} alternating rounds; "
             "microseconds per layer and per-round ratios (> 1: the VNNI path is faster).", "",
             "| context | float16 | int8 float scores | int8 VNNI scores | float scores / VNNI "
             "| float16 / VNNI |", "|---|---|---|---|---|---|"]
    for ctx, us in res["us"].items():
        r = res["ratio"][ctx]
        lines.append(f"| {ctx} | {us['float16']:.0f} | {us['int8 float scores']:.0f} "
                     f"| {us['int8 VNNI scores']:.0f} | {r['float scores / VNNI']:.2f}x "
                     f"| {r['float16 / VNNI']:.2f}x |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    res = measure(args.threads, args.rounds)
    write_results("kv_int8_scores", {"threads": args.threads, "rounds": args.rounds, **res},
                  markdown(res, args.threads, args.rounds))


if __name__ == "__main__":
    main()
