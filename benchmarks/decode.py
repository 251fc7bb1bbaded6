"""Batch-1 decode tokens/s and batch-32 throughput on the embedded SmolLM2-135M-Instruct:
sparkserve next to HF transformers (fp32, same GGUF weights), in one run, same threads.

    python benchmarks/decode.py [--threads 2] [--reps 3] [--new-tokens 128]

Decode tokens/s = (N - 1) / (t(N tokens) - t(1 token)): prefill cancels out. Medians of
--reps runs; both engines alternate so machine noise hits them alike. Writes
benchmarks/results/decode.{md,json}."""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from results_io import write_results

PROMPT = "Write a short story about a robot who learns to paint."


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


class Sparkserve:
    name = "sparkserve"

    def __init__(self):
        from sparkserve import Engine
        self.engine = Engine(max_total_tokens=32 * 512)
        self.tok = self.engine.tokenizer

    def prompts(self, n: int) -> list[list[int]]:
        return [self.tok.encode(self.tok.apply_chat_template(
            [{"role": "user", "content": f"{PROMPT} Story number {i}."}]), add_special_tokens=True)
            for i in range(n)]

    def run(self, prompts: list[list[int]], new: int) -> None:
        self.engine.generate(input_ids=prompts, sampling_params={
            "temperature": 0, "max_new_tokens": new, "ignore_eos": True})


class Transformers:
    name = "transformers"

    def __init__(self):
        from transformers import AutoModelForCausalLM

        from sparkserve.embedded import default_model_path
        path = default_model_path()
        self.model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()

    def run(self, prompts: list[list[int]], new: int) -> None:
        width = max(map(len, prompts))
        ids = torch.tensor([[2] * (width - len(p)) + p for p in prompts])   # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                                min_new_tokens=new, do_sample=False, pad_token_id=2)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    ours = Sparkserve()
    engines = [ours, Transformers()]
    p1, pb = ours.prompts(1), ours.prompts(a.batch)
    for e in engines:                      # warm-up
        e.run(p1, 4)
    b1 = {e.name: [] for e in engines}
    bb = {e.name: [] for e in engines}
    for _ in range(a.reps):
        for e in engines:
            t1 = _timed(lambda: e.run(p1, 1))
            tn = _timed(lambda: e.run(p1, a.new_tokens))
            b1[e.name].append((a.new_tokens - 1) / (tn - t1))
            bb[e.name].append(a.batch * a.new_tokens / _timed(lambda: e.run(pb, a.new_tokens)))
    med1 = {k: statistics.median(v) for k, v in b1.items()}
    medb = {k: statistics.median(v) for k, v in bb.items()}
    res = {"threads": a.threads, "new_tokens": a.new_tokens, "batch": a.batch, "reps": a.reps,
           "batch1_decode_tok_s": b1, f"batch{a.batch}_tok_s": bb,
           "ratio_batch1": med1["sparkserve"] / med1["transformers"],
           f"ratio_batch{a.batch}": medb["sparkserve"] / medb["transformers"],
           "date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__}
    lines = [f"# Decode speed, SmolLM2-135M-Instruct, {a.threads} threads ({res['date']})", "",
             f"| engine | batch-1 decode tok/s (median of {a.reps}) | batch-{a.batch} output tok/s |",
             "|---|---|---|"]
    for e in engines:
        lines.append(f"| {e.name} | {med1[e.name]:.1f} | {medb[e.name]:.1f} |")
    lines += ["", f"sparkserve / transformers: **{res['ratio_batch1']:.2f}x** at batch 1, "
              f"**{res[f'ratio_batch{a.batch}']:.2f}x** at batch {a.batch}.",
              "", f"{a.new_tokens} new tokens per request, greedy, EOS ignored; fp32 weights "
              "dequantized from the same Q4_1 GGUF for both."]
    write_results("decode", res, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
