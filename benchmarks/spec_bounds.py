"""How far DSpark at batch 1 is from paying, and whether the draft or the verify plan holds it back.

Runs the embedded SmolLM2-135M-Instruct with the shipped (or a given) draft over chat prompts, one
request at a time, greedy, each engine in a fresh process (fresh_process.py), the kinds taking turns:
- plain decoding, and DSpark with the `full` and `adaptive` verify modes;
- DSpark with an **oracle verify length**: each step verifies exactly the drafts the target would
  accept (known from plain decoding's tokens), so no row is verified in vain and a step with no
  acceptable draft is a plain step after its draft pass (the scheduler's back-off is off for it).
  No confidence head can plan better, so its speedup bounds every verify mode of this draft on
  this machine: below the goal, only a better draft (or cheaper verify rows) helps; above it, the
  confidence head and the planner are what to improve;
- "oracle with foresight": the oracle's time less its draft passes that found nothing, an estimate
  of a plan that also knew when not to draft (what the back-off aims at);
- the confidence head's calibration from the `full` runs: per slot, the mean predicted survival
  (product of confidences up to the slot) against how often the slot was really accepted.

    python benchmarks/spec_bounds.py [--draft DIR] [--new-tokens 128] [--reps 8]

Writes benchmarks/results/spec_bounds.{md,json}."""
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
from spec import QUESTIONS

MODES = ("full", "adaptive", "oracle")


def accepted_prefix(drafts: list[int], truth: list[int]) -> int:
    """How many leading drafts equal the target's own next tokens."""
    n = 0
    while n < len(drafts) and n < len(truth) and drafts[n] == truth[n]:
        n += 1
    return n


class CycleLog:
    """Wraps a DSpark worker's proposals: records each cycle's confidences and the drafts the target
    accepts (from its plain tokens), and in oracle mode sets the verify length to exactly those."""

    def __init__(self, worker, oracle: bool):
        self.truth: list[int] = []           # the running request's plain tokens
        self.oracle, self.cycles = oracle, []
        self.propose = worker._propose
        worker._propose = self

    def __call__(self, reqs, *args):
        t = time.perf_counter()
        proposals = self.propose(reqs, *args)
        seconds = (time.perf_counter() - t) / len(reqs)
        for req, p in zip(reqs, proposals):
            accepted = accepted_prefix(p.tokens, self.truth[len(req.output_ids):])
            if self.oracle:
                p.verify_len = min(accepted, p.verify_len)
            conf = [] if p.confidence is None else p.confidence.float().tolist()
            self.cycles.append({"accepted": accepted, "confidence": conf, "verify_len": p.verify_len,
                                "seconds": seconds})
        return proposals


def generate(engine, question: str, new: int) -> tuple[list[int], float, dict]:
    """(output ids, seconds, meta_info) of one greedy request."""
    t = time.perf_counter()
    out = engine.generate(messages=[[{"role": "user", "content": question}]],
                          sampling_params={"temperature": 0, "max_new_tokens": new, "ignore_eos": True})[0]
    return out["output_ids"], time.perf_counter() - t, out["meta_info"]


def calibration(cycles: list[dict], slots: int) -> list[dict]:
    """Per slot: the mean predicted survival and the share of cycles that accepted the slot."""
    rows = []
    for k in range(slots):
        pred = [math.prod(c["confidence"][:k + 1]) for c in cycles if len(c["confidence"]) > k]
        seen = [c["accepted"] > k for c in cycles]
        rows.append({"slot": k + 1, "predicted": statistics.fmean(pred) if pred else float("nan"),
                     "observed": statistics.fmean(seen) if seen else float("nan")})
    return rows


def make_engine(kind: str, draft: str | None):
    from sparkserve import Engine
    if kind in ("plain", "truth"):
        return Engine(max_total_tokens=16384, activation_quant="int8")
    return Engine(max_total_tokens=16384, speculative_algorithm="DSPARK", activation_quant="int8",
                  speculative_draft_model_path=draft,
                  speculative_dspark_verify_mode="full" if kind == "oracle" else kind)


def worker(kind: str, truth_path: str, draft: str | None, new: int) -> dict:
    """One engine in its own process, as a server has it: the target's tokens (kind "truth"), or
    one round over every prompt after a short warm-up."""
    engine = make_engine(kind, draft)
    if kind == "truth":     # with room for a last block of drafts past the end
        return {q: generate(engine, q, new + 16)[0] for q in QUESTIONS}
    with open(truth_path) as f:
        truth = json.load(f)
    log = None if kind == "plain" else CycleLog(engine.scheduler.spec, kind == "oracle")
    if kind == "oracle":    # it drafts at every step: one without an acceptable draft does not back it off
        engine.scheduler._note_verify_budget = lambda req, verify_len: None
    if log:
        log.truth = truth[QUESTIONS[0]]
    generate(engine, QUESTIONS[0], 16)
    r = {"seconds": 0.0, "verify_cycles": 0, "accepted": 0}
    if log:
        log.cycles.clear()
    for q in QUESTIONS:
        if log:
            log.truth = truth[q]
        out, dt, meta = generate(engine, q, new)
        if out != truth[q][:new]:
            raise SystemExit(f"{kind}: output differs from plain decoding for {q!r}")
        r["seconds"] += dt
        r["verify_cycles"] += meta.get("spec_verify_ct", 0)
        r["accepted"] += meta.get("spec_accept_token_num", 0)
    if log:
        r["draft_passes"] = len(log.cycles)
        r["draft_seconds"] = sum(c["seconds"] for c in log.cycles)
        r["fruitless_draft_seconds"] = sum(c["seconds"] for c in log.cycles if c["accepted"] == 0)
        r["cycles"] = log.cycles if kind == "full" else []
    return r


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default=None)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--worker", choices=("truth", "plain", *MODES), help=argparse.SUPPRESS)
    ap.add_argument("--truth", help=argparse.SUPPRESS)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.worker:
        print(json.dumps(worker(a.worker, a.truth, a.draft, a.new_tokens)))
        return 0
    kinds = ["plain", *MODES]
    common = ["--new-tokens", str(a.new_tokens), "--threads", str(a.threads),
              *(["--draft", a.draft] if a.draft else [])]
    rounds = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory() as tmp:
        truth_path = os.path.join(tmp, "truth.json")
        with open(truth_path, "w") as f:
            json.dump(run_json(__file__, ["--worker", "truth", *common]), f)
        for rep in range(a.reps):
            for kind in in_turns(kinds, rep):
                rounds[kind].append(run_json(__file__, ["--worker", kind, "--truth", truth_path, *common]))
    tokens = len(QUESTIONS) * a.new_tokens

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in rounds[name])

    tok_s = {name: tokens / median(name, "seconds") for name in kinds}
    # the oracle's rounds without the draft passes that found nothing: an oracle that also knew when
    # not to draft (the adaptive planner's back-off aims at that)
    tok_s["foresight"] = tokens / statistics.median(r["seconds"] - r["fruitless_draft_seconds"]
                                                    for r in rounds["oracle"])
    full_cycles = [c for r in rounds["full"] for c in r.pop("cycles")]
    for m in MODES[1:]:
        for r in rounds[m]:
            r.pop("cycles")
    slots = max(len(c["confidence"]) for c in full_cycles)
    res = {"draft": a.draft or "shipped", "threads": a.threads, "new_tokens": a.new_tokens,
           "prompts": len(QUESTIONS), "reps": a.reps, "tok_s": tok_s, "rounds": rounds,
           "accepted_histogram": [sum(c["accepted"] == k for c in full_cycles) for k in range(slots + 1)],
           "calibration": calibration(full_cycles, slots),
           "date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine_info(),
           "sparkserve_kernels": sparkserve_kernels()}
    lines = [f"# DSpark at batch 1: verify modes against an oracle verify length, SmolLM2-135M-Instruct, "
             f"{a.threads} threads ({res['date']})", "",
             f"{machine_line(res['machine'])}; sparkserve kernels: {res['sparkserve_kernels']}", "",
             f"draft: {res['draft']}; {len(QUESTIONS)} chat prompts one at a time, {a.new_tokens} new tokens "
             f"each, greedy, EOS ignored; medians of {a.reps} rounds, each engine in a "
             f"fresh process (as a server runs one), kinds taking turns. Every DSpark output was checked "
             f"equal to plain decoding's.", "",
             "| engine | tok/s | vs plain | steps with a draft pass | steps verifying drafts "
             "| tokens per verifying step | draft pass ms |", "|---|---|---|---|---|---|---|",
             f"| plain | {tok_s['plain']:.1f} | 1.00x | - | - | - | - |"]
    for m in MODES:
        steps = tokens - median(m, "accepted")
        cycles = median(m, "verify_cycles")
        lines.append(f"| DSpark {m} | {tok_s[m]:.1f} | {tok_s[m] / tok_s['plain']:.2f}x | "
                     f"{100 * median(m, 'draft_passes') / steps:.0f}% | {100 * cycles / steps:.0f}% | "
                     f"{1 + median(m, 'accepted') / cycles if cycles else float('nan'):.2f} | "
                     f"{1e3 * median(m, 'draft_seconds') / median(m, 'draft_passes'):.2f} |")
    lines.append(f"| oracle with foresight (estimate) | {tok_s['foresight']:.1f} | "
                 f"{tok_s['foresight'] / tok_s['plain']:.2f}x | - | - | - | - |")
    hist = res["accepted_histogram"]
    lines += ["", "oracle: each step verifies exactly the drafts the target accepts (none: a plain step "
              "after its draft pass); no confidence head plans better. Oracle with foresight: the "
              "oracle's time less its draft passes that found nothing, as if it had not drafted there: "
              "about the best any plan of this draft does on this machine, back-off included.", "",
              "Drafts accepted per step in `full` mode (share of steps): "
              + ", ".join(f"{k}: {100 * n / sum(hist):.0f}%" for k, n in enumerate(hist)), "",
              "Confidence calibration (`full` mode): predicted survival to a slot (product of the "
              "confidences up to it) against the share of steps that accepted that slot.", "",
              "| slot | predicted | observed |", "|---|---|---|"]
    lines += [f"| {r['slot']} | {r['predicted']:.3f} | {r['observed']:.3f} |" for r in res["calibration"]]
    write_results("spec_bounds", res, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
