"""Tensor parallelism on this machine: TP=2 with 1 torch thread per rank against TP=1 with 2
threads, batch-1 decode and batch-32 throughput, on a random Llama of 0.2B parameters made for
the run (SmolLM2's 9 heads do not split over 2 ranks), with the bytes the ranks exchange per
token (two all-reduces of the hidden state per layer). Honest about 2 cores: TP splits the same
arithmetic over processes and adds the all-reduces, so at best it matches threads here; the
layout pays on machines with more cores or devices per rank.

    python benchmarks/parallel.py [--reps 3] [--new-tokens 64]

Decode tokens/s = (N - 1) / (t(N tokens) - t(1 token)); medians of --reps, layouts alternating.
Writes benchmarks/results/parallel.{md,json}."""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from results_io import write_results

CONFIG = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
              num_key_value_heads=8, vocab_size=8192, max_position_embeddings=2048, tie_word_embeddings=True,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)


def make_model(path: str) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **CONFIG),
                                     dtype=torch.float32).save_pretrained(path)
    return path


def timed(engine, batch: int, new: int) -> float:
    prompts = [[(7 * i + j) % 8000 + 5 for j in range(32)] for i in range(batch)]
    t = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": new,
                                                        "ignore_eos": True})
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    a = ap.parse_args()
    from sparkserve import Engine
    path = make_model(tempfile.mkdtemp(prefix="parallel-bench-"))
    layouts = {"TP=1, 2 threads": dict(num_threads=2), "TP=2, 1 thread per rank": dict(tp_size=2,
                                                                                       num_threads=1)}
    engines = {k: Engine(path, max_total_tokens=32 * 128, **kw) for k, kw in layouts.items()}
    res: dict = {k: {"decode": [], "batch32": []} for k in layouts}
    for _ in range(a.reps):
        for name, eng in engines.items():
            one, full = timed(eng, 1, 1), timed(eng, 1, a.new_tokens)
            res[name]["decode"].append((a.new_tokens - 1) / (full - one))
            res[name]["batch32"].append(32 * a.new_tokens / timed(eng, 32, a.new_tokens))
    for eng in engines.values():
        eng.shutdown()
    per_token = 2 * CONFIG["num_hidden_layers"] * CONFIG["hidden_size"] * 4
    base = statistics.median(res["TP=1, 2 threads"]["decode"])
    base32 = statistics.median(res["TP=1, 2 threads"]["batch32"])
    lines = ["# Tensor parallelism on 2 cores, random Llama (hidden 1024, 12 layers, 16 heads, fp32)", "",
             f"{a.new_tokens} new tokens, greedy, prompts of 32 tokens, medians of {a.reps}; "
             f"all-reduce volume per token per rank: {per_token / 1024:.0f} KiB "
             "(2 per layer x hidden x 4 bytes)", "",
             "| layout | batch-1 decode tok/s | vs TP=1 | batch-32 tok/s | vs TP=1 |",
             "|---|---|---|---|---|"]
    for name, r in res.items():
        d, b = statistics.median(r["decode"]), statistics.median(r["batch32"])
        lines.append(f"| {name} | {d:.1f} | {d / base:.2f}x | {b:.1f} | {b / base32:.2f}x |")
    write_results("parallel", {"config": CONFIG, "new_tokens": a.new_tokens, "results": res,
                               "allreduce_bytes_per_token": per_token}, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
