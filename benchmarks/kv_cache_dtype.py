"""What --kv-cache-dtype float16 / bfloat16 cost and buy against a float32 pool, on SmolLM2 (the
embedded Q4_1 model).

Accuracy: the model over held-out text (ShareGPT, HumanEval; activation_quant.py's texts and
chunks of 8 tokens), each pool dtype against float32: max / mean |logit diff|, top-1 agreement,
perplexity. Activations stay fp32 here (exact), so the differences are the pool's rounding alone:
under int8 activations a K/V value rounded differently moves some activations across an int8
rounding step, and the comparison would measure int8's noise instead.

Speed (int8 activations, as served): batch-8 decode after prompts of 64 / 256 / 512 / 1024 tokens
(random ids, so no two share a prefix), output tokens/s of `Engine.generate` with 32 new tokens
per request, the prompts already in the prefix cache (so the time is decoding); each engine in a
fresh process, the pool dtypes taking turns so machine noise hits them alike; medians.

    PYTHONPATH=. python benchmarks/kv_cache_dtype.py [--tokens 2048] [--reps 3]
writes benchmarks/results/kv_cache_dtype.{json,md}."""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import sparkserve  # noqa: F401  (before torch: its OpenMP threads must be told to wait passively)

# isort: split
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from activation_quant import CHUNK, Runner, texts  # noqa: E402
from fresh_process import in_turns, run_json  # noqa: E402
from results_io import machine_line, sparkserve_kernels, write_results  # noqa: E402

from sparkserve import Engine  # noqa: E402
from sparkserve.embedded import default_model_path  # noqa: E402
from sparkserve.frontend.tokenizer import load_tokenizer  # noqa: E402
from sparkserve.models.registry import load_config, load_model  # noqa: E402

DTYPES = ("float32", "float16", "bfloat16")
CONTEXTS = (64, 256, 512, 1024)
BATCH, NEW = 8, 32


def accuracy(max_tokens: int) -> dict:
    path = default_model_path()
    cfg = load_config(path)
    model = load_model(path, cfg, activation_quant="none")
    tok = load_tokenizer(path)
    runs = {d: Runner(model, cfg, max_tokens + CHUNK, getattr(torch, d)) for d in DTYPES}
    res = {}
    for name, docs in texts(8, 8).items():
        nll = dict.fromkeys(DTYPES, 0.0)
        stats = {d: {"max": 0.0, "sum": 0.0, "top1": 0} for d in DTYPES[1:]}
        count = rows = 0
        for doc in docs:
            ids = tok.encode(doc, add_special_tokens=True)[:max_tokens // len(docs) + 1]
            if len(ids) < 2:
                continue
            lg = {d: r.logits(ids) for d, r in runs.items()}
            for d in DTYPES:
                lp = torch.log_softmax(lg[d][:-1].double(), -1)
                nll[d] -= lp.gather(1, torch.tensor(ids[1:])[:, None]).sum().item()
            for d in DTYPES[1:]:
                diff = (lg[d] - lg["float32"]).abs()
                stats[d]["max"] = max(stats[d]["max"], diff.max().item())
                stats[d]["sum"] += diff.mean(-1).sum().item()
                stats[d]["top1"] += (lg[d].argmax(-1) == lg["float32"].argmax(-1)).sum().item()
            rows += len(ids)
            count += len(ids) - 1
        res[name] = {"docs": len(docs), "tokens": count,
                     "ppl": {d: math.exp(nll[d] / count) for d in DTYPES},
                     **{d: {"max_abs_logit_diff": s["max"], "mean_abs_logit_diff": s["sum"] / rows,
                            "top1_agree": s["top1"] / rows} for d, s in stats.items()}}
        print(name, res[name], flush=True)
    return res


def speed_worker(dtype: str, rep: int) -> dict:
    """One engine with a `dtype` pool in its own process: seconds of the timed decode per context.
    The prompts depend on (rep, context) only, so every dtype decodes the same ones."""
    eng = Engine(max_total_tokens=BATCH * (max(CONTEXTS) + NEW) + 64, max_running_requests=BATCH,
                 kv_cache_dtype=dtype)
    sp = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
    out = {}
    for ctx in CONTEXTS:
        gen = torch.Generator().manual_seed(1000 * rep + ctx)
        prompts = [torch.randint(1000, 40000, (ctx,), generator=gen).tolist() for _ in range(BATCH)]
        # the prompts' KV first: the timed call then finds them in the prefix cache and decodes
        eng.generate(input_ids=prompts, sampling_params=dict(sp, max_new_tokens=1))
        t = time.perf_counter()
        eng.generate(input_ids=prompts, sampling_params=sp)
        out[ctx] = time.perf_counter() - t
    eng.shutdown()
    return out


def speed(reps: int) -> dict:
    """Output tokens/s per context and dtype: medians over `reps` rounds, each engine in a fresh
    process (fresh_process.py), the dtypes taking turns."""
    times: dict[str, list[dict]] = {d: [] for d in DTYPES}
    for rep in range(reps):
        for d in in_turns(list(DTYPES), rep):
            times[d].append(run_json(__file__, ["--worker", d, "--rep", str(rep)]))
    out = {ctx: {d: BATCH * NEW / statistics.median(r[str(ctx)] for r in times[d]) for d in DTYPES}
           for ctx in CONTEXTS}
    for ctx, r in out.items():
        print(f"context {ctx}: " + ", ".join(f"{d} {v:.0f} tok/s" for d, v in r.items()), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of held-out text per corpus")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--worker", choices=DTYPES, help=argparse.SUPPRESS)
    ap.add_argument("--rep", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(speed_worker(args.worker, args.rep)))
        return
    data = {"speed": speed(args.reps), "accuracy": accuracy(args.tokens)}
    lines = ["# KV pool dtype (SmolLM2-135M Q4_1)", "",
             f"{machine_line()}; sparkserve kernels: {sparkserve_kernels()}; "
             f"{torch.get_num_threads()} threads", "",
             f"Batch-{BATCH} decoding (int8 activations) after prompts of each length (in the prefix "
             f"cache), {NEW} new tokens each, output tokens/s, medians of {args.reps} rounds, each engine "
             f"in a fresh process:", "",
             "| prompt tokens | " + " | ".join(DTYPES) + " | float16 / float32 |",
             "|---|" + "---|" * (len(DTYPES) + 1)]
    for ctx, r in data["speed"].items():
        lines.append(f"| {ctx} | " + " | ".join(f"{r[d]:.0f}" for d in DTYPES)
                     + f" | {r['float16'] / r['float32']:.2f}x |")
    lines += ["", f"Accuracy: held-out text in chunks of {CHUNK} tokens, fp32 activations, each half pool "
              "against the float32 pool.", "",
              "| text | tokens | pool | max abs logit diff | mean abs logit diff | top-1 agree | "
              "ppl (float32 pool) |",
              "|---|---|---|---|---|---|---|"]
    for name, r in data["accuracy"].items():
        for d in DTYPES[1:]:
            lines.append(f"| {name} ({r['docs']} docs) | {r['tokens']} | {d} | "
                         f"{r[d]['max_abs_logit_diff']:.3f} | {r[d]['mean_abs_logit_diff']:.4f} | "
                         f"{r[d]['top1_agree']:.4f} | {r['ppl'][d]:.4f} ({r['ppl']['float32']:.4f}) |")
    write_results("kv_cache_dtype", data, lines)


if __name__ == "__main__":
    main()
