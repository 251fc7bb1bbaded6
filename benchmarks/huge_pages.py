"""What holding the weights in 2 MiB transparent huge pages (the default; mem/huge_pages.py) buys
against ordinary 4 KiB pages (--disable-huge-pages), on the embedded SmolLM2 (Q4_1).

Per engine, in a fresh process of its own (fresh_process.py), the kinds taking turns:
- plain: batch-1 decode of 4 chat prompts x 128 tokens (greedy, EOS ignored), the TTFT of a
  512-token random prompt (1 new token), and batch-8 decode (8 chat prompts x 64 tokens);
- DSpark adaptive (the shipped draft): batch-1 decode of the same 4 prompts.
Every kind's tokens must equal plain decoding's with 4 KiB pages. Also reported: how much of the
process's anonymous memory the kernel really backs with huge pages (smaps).

    PYTHONPATH=. python benchmarks/huge_pages.py [--reps 5]
writes benchmarks/results/huge_pages.{json,md}."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import sparkserve  # noqa: F401  (before torch: its OpenMP threads must be told to wait passively)

# isort: split
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fresh_process import in_turns, run_json  # noqa: E402
from results_io import machine_info, machine_line, sparkserve_kernels, write_results  # noqa: E402
from spec import QUESTIONS  # noqa: E402

from sparkserve import Engine  # noqa: E402

KINDS = ("plain 4k", "plain huge", "dspark 4k", "dspark huge")
NEW, BATCH, BATCH_NEW, PROMPT = 128, 8, 64, 512


def anon_huge_mib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return int(next(line for line in f if line.startswith("AnonHugePages")).split()[1]) // 1024


def chat(q: str) -> list[dict]:
    return [{"role": "user", "content": q}]


def worker(kind: str) -> dict:
    engine_kind, pages = kind.split()
    spec = {"speculative_algorithm": "DSPARK", "speculative_dspark_verify_mode": "adaptive"}
    eng = Engine(max_total_tokens=16384, max_running_requests=BATCH, disable_huge_pages=pages == "4k",
                 **(spec if engine_kind == "dspark" else {}))
    sp = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
    eng.generate(messages=[chat(QUESTIONS[-1])], sampling_params=dict(sp, max_new_tokens=16))   # warm-up
    out: dict = {"tokens": []}
    t = time.perf_counter()
    for q in QUESTIONS[:4]:
        out["tokens"].append(eng.generate(messages=[chat(q)], sampling_params=sp)[0]["output_ids"])
    out["b1_tok_s"] = 4 * NEW / (time.perf_counter() - t)
    if engine_kind == "plain":
        prompt = torch.randint(1000, 40000, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
        eng.generate(input_ids=[prompt], sampling_params={"max_new_tokens": 1})      # untimed first
        eng.flush_cache()
        t = time.perf_counter()
        eng.generate(input_ids=[prompt], sampling_params={"max_new_tokens": 1})
        out["ttft_ms"] = 1e3 * (time.perf_counter() - t)
        t = time.perf_counter()
        eng.generate(messages=[chat(q) for q in QUESTIONS[:BATCH]],
                     sampling_params=dict(sp, max_new_tokens=BATCH_NEW))
        out["b8_tok_s"] = BATCH * BATCH_NEW / (time.perf_counter() - t)
    out["anon_huge_mib"] = anon_huge_mib()
    eng.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker)))
        return
    rounds: dict[str, list[dict]] = {k: [] for k in KINDS}
    for rep in range(a.reps):
        for kind in in_turns(list(KINDS), rep):
            rounds[kind].append(run_json(__file__, ["--worker", kind]))
            print(kind, {k: v for k, v in rounds[kind][-1].items() if k != "tokens"}, flush=True)
    want = rounds["plain 4k"][0]["tokens"]
    for kind, rs in rounds.items():
        if any(r["tokens"] != want for r in rs):
            raise SystemExit(f"{kind}: tokens differ from plain decoding with 4 KiB pages")
        for r in rs:
            r.pop("tokens")

    def med(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in rounds[kind])

    res = {"reps": a.reps, "rounds": rounds, "machine": machine_info(),
           "sparkserve_kernels": sparkserve_kernels(), "date": time.strftime("%Y-%m-%d %H:%M")}
    rows = [("batch-1 decode tok/s", "plain", "b1_tok_s", True),
            ("prefill-512 TTFT ms", "plain", "ttft_ms", False),
            (f"batch-{BATCH} decode tok/s", "plain", "b8_tok_s", True),
            ("DSpark adaptive batch-1 tok/s", "dspark", "b1_tok_s", True)]
    lines = [f"# Weights in 2 MiB huge pages vs 4 KiB pages, SmolLM2-135M-Instruct Q4_1, "
             f"{torch.get_num_threads()} threads ({res['date']})", "",
             f"{machine_line(res['machine'])}; sparkserve kernels: {res['sparkserve_kernels']}", "",
             f"Each engine in a fresh process, the kinds taking turns; medians of {a.reps} rounds. Batch 1: "
             f"4 chat prompts one at a time, {NEW} new tokens each; batch {BATCH}: {BATCH} chat prompts, "
             f"{BATCH_NEW} new tokens each; greedy, EOS ignored. Every kind's tokens equal plain decoding's "
             "with 4 KiB pages.", "",
             "| work | 4 KiB pages | huge pages | speedup (> 1: huge pages faster) | rounds (4 KiB; huge) |",
             "|---|---|---|---|---|"]
    res["speedups"] = {}
    for name, engine_kind, key, higher in rows:
        small, huge = med(f"{engine_kind} 4k", key), med(f"{engine_kind} huge", key)
        speedup = res["speedups"][name] = huge / small if higher else small / huge
        each = "; ".join(" ".join(f"{r[key]:.0f}" for r in rounds[f"{engine_kind} {p}"])
                         for p in ("4k", "huge"))
        lines.append(f"| {name} | {small:.1f} | {huge:.1f} | **{speedup:.2f}x** | {each} |")
    lines += ["", "Anonymous memory in huge pages per process (MiB, median): "
              + ", ".join(f"{k} {med(k, 'anon_huge_mib'):.0f}" for k in KINDS)]
    write_results("huge_pages", res, lines)


if __name__ == "__main__":
    main()
