"""DSpark speculative decoding vs plain decoding on the embedded SmolLM2-135M-Instruct, in one
run: batch-1 and batch-8 output tokens/s and the mean accepted length (tokens per verify cycle,
bonus included).

    python benchmarks/spec.py [--draft DIR] [--new-tokens 128] [--reps 3] [--modes full,adaptive]

--draft defaults to the draft shipped for the embedded model. Writes benchmarks/results/spec.{md,json}."""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import sparkserve  # noqa: F401  (before torch: its OpenMP threads must be told to wait passively)

# isort: split
import torch
from results_io import machine_info, machine_line, sparkserve_kernels, write_results

QUESTIONS = ["Explain how a refrigerator works.", "Write a Python function that reverses a string.",
             "What are the benefits of regular exercise?", "Describe the water cycle.",
             "Give three tips for learning a new language.",
             "What is the capital of Japan and why is it important?",
             "Write a haiku about autumn.", "How do vaccines work?"]


def run(engine, prompts, new) -> tuple[float, float]:
    t = time.perf_counter()
    outs = engine.generate(messages=[[{"role": "user", "content": q}] for q in prompts],
                           sampling_params={"temperature": 0, "max_new_tokens": new, "ignore_eos": True})
    dt = time.perf_counter() - t
    cycles = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
    acc = cycles + sum(o["meta_info"].get("spec_accept_token_num", 0) for o in outs)   # bonus included
    return sum(len(o["output_ids"]) for o in outs) / dt, (acc / cycles if cycles else float("nan"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default=None)
    ap.add_argument("--modes", default="full,adaptive",
                    help="verify modes to compare (full, threshold, adaptive)")
    ap.add_argument("--threshold", type=float, default=None)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from sparkserve import Engine
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    plain = Engine(max_total_tokens=16384, activation_quant="int8")
    specs = {m: Engine(max_total_tokens=16384, speculative_algorithm="DSPARK", activation_quant="int8",
                       speculative_draft_model_path=a.draft,
                       speculative_dspark_verify_mode=m,
                       speculative_dspark_confidence_threshold=a.threshold if m == "threshold" else None)
             for m in modes}
    rows = {}
    for bs in (1, 8):
        prompts = QUESTIONS[:bs]
        run(plain, prompts, 8)                                  # warm-up
        for e in specs.values():
            run(e, prompts, 8)
        tp, ts, taus = [], {m: [] for m in modes}, {m: [] for m in modes}
        for _ in range(a.reps):                                 # interleaved: noise hits all alike
            tp.append(run(plain, prompts, a.new_tokens)[0])
            for m, e in specs.items():
                s, tau = run(e, prompts, a.new_tokens)
                ts[m].append(s)
                taus[m].append(tau)
        rows[bs] = {"plain_tok_s": tp, **{m: {"dspark_tok_s": ts[m], "tau": taus[m],
                                             "speedup": statistics.median(ts[m]) / statistics.median(tp)}
                                         for m in modes}}
    res = {"draft": a.draft or "shipped", "modes": modes, "threads": a.threads, "new_tokens": a.new_tokens,
           "rows": rows, "date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine_info(),
           "sparkserve_kernels": sparkserve_kernels()}
    lines = [f"# DSpark vs plain decoding, SmolLM2-135M-Instruct, {a.threads} threads ({res['date']})", "",
             f"{machine_line(res['machine'])}; sparkserve kernels: {res['sparkserve_kernels']}", "",
             f"draft: {res['draft']}, {a.new_tokens} new tokens, greedy, chat prompts, medians of {a.reps}",
             "",
             "| batch | verify mode | plain tok/s | DSpark tok/s | speedup | tokens per cycle (tau) |",
             "|---|---|---|---|---|---|"]
    for bs, r in rows.items():
        for m in modes:
            lines.append(f"| {bs} | {m} | {statistics.median(r['plain_tok_s']):.1f} | "
                         f"{statistics.median(r[m]['dspark_tok_s']):.1f} | {r[m]['speedup']:.2f}x | "
                         f"{statistics.median(r[m]['tau']):.2f} |")
    write_results("spec", res, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
