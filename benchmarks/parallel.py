"""Parallel layouts on this machine: TP=2 and PP=2 with 1 torch thread per rank against one
process with 1 and 2 threads, batch-1 decode and batch-32 throughput, on a random Llama of 0.2B
parameters made for the run (SmolLM2's 9 heads do not split over 2 ranks), with the bytes a rank
sends per token (TP: two all-reduces of the hidden state per layer; PP: one hidden row per stage
boundary and the final row back to the driver). Honest about 2 cores: the layouts split the same
arithmetic over processes and add communication, so at best they match threads here; they pay
where a rank has cores or a device of its own. The step overhead over half the 1-thread step is
what docs/parallel-scaling.md builds its model from.

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

HIDDEN_BYTES = CONFIG["hidden_size"] * 4
SENT = {"TP=2, 1 thread per rank": 2 * CONFIG["num_hidden_layers"] * HIDDEN_BYTES,
        "PP=2, 1 thread per rank": HIDDEN_BYTES}   # each stage sends one row: onward, or back to the driver


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
    layouts = {"1 process, 1 thread": dict(num_threads=1), "1 process, 2 threads": dict(num_threads=2),
               "TP=2, 1 thread per rank": dict(tp_size=2, num_threads=1),
               "PP=2, 1 thread per rank": dict(pp_size=2, num_threads=1)}
    res: dict = {k: {"decode": [], "batch32": []} for k in layouts}
    for _ in range(a.reps):              # layouts alternate; one parallel engine per process at a time
        for name, kw in layouts.items():
            with Engine(path, max_total_tokens=32 * 128, **kw) as eng:
                timed(eng, 1, 4)                                   # warm-up
                one, full = timed(eng, 1, 1), timed(eng, 1, a.new_tokens)
                res[name]["decode"].append((a.new_tokens - 1) / (full - one))
                res[name]["batch32"].append(32 * a.new_tokens / timed(eng, 32, a.new_tokens))
    write_results("parallel", {"config": CONFIG, "new_tokens": a.new_tokens, "results": res,
                               "bytes_per_token": SENT}, table(res, a))
    return 0


def table(res: dict, a) -> list[str]:
    med = {k: {m: statistics.median(v) for m, v in r.items()} for k, r in res.items()}
    base, single = med["1 process, 2 threads"], med["1 process, 1 thread"]
    lines = ["# Parallel layouts on 2 cores, random Llama (hidden 1024, 12 layers, 16 heads, fp32)", "",
             f"{a.new_tokens} new tokens, greedy, prompts of 32 tokens, medians of {a.reps}; ratios against "
             f"one "
             "process with 2 threads; step overhead = decode step - its ideal (TP=2: half the 1-thread "
             "step; PP=2 without micro-batches: the 1-thread step, as the stages run in turn)", "",
             "| layout | batch-1 decode tok/s | vs 2 threads | batch-32 tok/s | vs 2 threads | sent per "
             "token "
             "per rank | step overhead (ms) |", "|---|---|---|---|---|---|---|"]
    for name, m in med.items():
        ideal = {"TP=2, 1 thread per rank": 0.5, "PP=2, 1 thread per rank": 1.0}.get(name)
        over = f"{(1 / m['decode'] - ideal / single['decode']) * 1e3:.1f}" if ideal else ""
        sent = f"{SENT[name] / 1024:.0f} KiB" if name in SENT else ""
        lines.append(f"| {name} | {m['decode']:.1f} | {m['decode'] / base['decode']:.2f}x | "
                     f"{m['batch32']:.1f} | "
                     f"{m['batch32'] / base['batch32']:.2f}x | {sent} | {over} |")
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
