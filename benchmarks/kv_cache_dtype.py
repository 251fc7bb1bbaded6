"""What --kv-cache-dtype float16 / bfloat16 cost and buy against a float32 pool, on SmolLM2 (the
embedded Q4_1 model).

Accuracy: the model over held-out text (ShareGPT, HumanEval; activation_quant.py's texts and
chunks of 8 tokens), each pool dtype against float32: max / mean |logit diff|, top-1 agreement,
perplexity. Activations stay fp32 here (exact), so the differences are the pool's rounding alone:
under int8 activations a K/V value rounded differently moves some activations across an int8
rounding step, and the comparison would measure int8's noise instead.

Speed (int8 activations, as served): batch-8 decode after prompts of 64 / 256 / 512 / 1024 tokens
(random ids, so no two share a prefix), output tokens/s of `Engine.generate` with 32 new tokens
per request, the prompts already in the prefix cache (so the time is decoding), the pool dtypes
alternating so machine noise hits them alike; medians.

    PYTHONPATH=. python benchmarks/kv_cache_dtype.py [--tokens 2048] [--reps 3]
writes benchmarks/results/kv_cache_dtype.{json,md}."""
from __future__ import annotations

import argparse
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


def speed(reps: int) -> dict:
    engines = {d: Engine(max_total_tokens=BATCH * (max(CONTEXTS) + NEW) + 64, max_running_requests=BATCH,
                         kv_cache_dtype=d) for d in DTYPES}
    gen = torch.Generator().manual_seed(0)
    sp = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
    out = {}
    for ctx in CONTEXTS:
        times: dict[str, list[float]] = {d: [] for d in DTYPES}
        for _ in range(reps):
            prompts = [torch.randint(1000, 40000, (ctx,), generator=gen).tolist() for _ in range(BATCH)]
            for d, eng in engines.items():
                # the prompts' KV first: the timed call then finds them in the prefix cache and decodes
                eng.generate(input_ids=prompts, sampling_params=dict(sp, max_new_tokens=1))
                t = time.perf_counter()
                eng.generate(input_ids=prompts, sampling_params=sp)
                times[d].append(time.perf_counter() - t)
        out[ctx] = {d: BATCH * NEW / statistics.median(v) for d, v in times.items()}
        print(f"context {ctx}: " + ", ".join(f"{d} {v:.0f} tok/s" for d, v in out[ctx].items()), flush=True)
    for eng in engines.values():
        eng.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of held-out text per corpus")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    data = {"speed": speed(args.reps), "accuracy": accuracy(args.tokens)}
    lines = ["# KV pool dtype (SmolLM2-135M Q4_1)", "",
             f"{machine_line()}; sparkserve kernels: {sparkserve_kernels()}; "
             f"{torch.get_num_threads()} threads", "",
             f"Batch-{BATCH} decoding (int8 activations) after prompts of each length (in the prefix "
             f"cache), {NEW} new tokens each, output tokens/s, medians of {args.reps}:", "",
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
