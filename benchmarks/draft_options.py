"""Serving cost of the DSpark draft's architecture options: one cycle's draft work (inject the
cycle's committed rows as context, then the greedy draft pass: block, LM head, Markov loop,
confidences) of a SmolLM2-135M-shaped draft (the shipped draft's config: hidden 576, 9 query / 3 KV
heads of 64, a 4,096-id draft vocab, gamma 7), per option, as a ratio to the base draft.

Random fp16 weights (what the native step runs; the time does not depend on the values), int8
activations as `serve` runs them by default, the native step on, requests with `--context`
tokens of context each; the options are timed in alternating short rounds, by this process's CPU
time (one thread: the work done, which a shared, loaded machine inflates far less than the wall
clock); the best round of each is compared (the medians' ratio beside it).

    PYTHONPATH=. python benchmarks/draft_options.py [--threads 1] [--context 256] [--rounds 5]
writes benchmarks/results/draft_options.{json,md} (SPARKSERVE_BENCH_RESULTS=DIR sends them elsewhere)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import sparkserve  # noqa: F401  (before torch: its OpenMP threads must be told to wait passively)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results_io import machine_line, write_results  # noqa: E402

SHIPPED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sparkserve", "drafts",
                       "smollm2-135m-instruct", "config.json")
OPTIONS = {
    "base": {},
    "tap_norm": {"tap_norm": True},
    "fusion": {"prev_context_fusion": True},
    "wide_kv (9 KV heads)": {"num_key_value_heads": 9},
    "2 layers": {"num_hidden_layers": 2, "layer_types": ["full_attention"] * 2},
    "all four": {"tap_norm": True, "prev_context_fusion": True, "num_key_value_heads": 9,
                 "num_hidden_layers": 2, "layer_types": ["full_attention"] * 2},
}
BATCHES = (1, 8)
COMMITTED = 3          # rows injected per request per cycle (the anchor's and ~2 accepted drafts)


def make_draft(over: dict, root: str):
    """The option's draft: random weights saved as fp16, loaded as `serve` loads a draft."""
    import torch

    from sparkserve.models.dspark_draft import init_dspark_draft, load_dspark_draft, save_dspark_draft
    with open(SHIPPED) as f:
        cfg = {**json.load(f), **over}
    g = torch.Generator().manual_seed(0)
    vocab = torch.randperm(cfg["vocab_size"], generator=g)[:cfg["draft_vocab_size"]]
    draft = init_dspark_draft(cfg, seed=0, std=0.05, vocab=vocab)
    with torch.no_grad():
        draft.norm.weight.fill_(1.0)
        if draft.fuse_proj is not None:
            draft.fuse_proj.weight.normal_(0, 0.05)
    path = os.path.join(root, str(abs(hash(json.dumps(over, sort_keys=True)))))
    save_dspark_draft(draft, path, include_shared=True, dtype=torch.float16)
    return load_dspark_draft(path, activation_quant="int8")


class Cycle:
    """B requests with `context` tokens of draft context each; run() is one cycle's draft work."""

    def __init__(self, draft, B: int, context: int):
        import torch

        from sparkserve.core.req import Req
        from sparkserve.core.sampling_state import RequestSamplingState
        from sparkserve.sampling_params import SamplingParams
        from sparkserve.speculative.dspark_worker import DSparkWorker
        from sparkserve.speculative.planner import VerifyPlanner
        G, d = draft.block_size, draft.config.hidden_size
        draft.enable_native_step(True)
        width = context + 2 * COMMITTED + 1
        slots = B * width
        pool = draft.new_kv_pool(slots, block_rows=B * G)
        table = torch.arange(1, slots + 1).view(B, width)
        g = torch.Generator().manual_seed(1)
        self.taps = [torch.randn(B * COMMITTED, d, generator=g) * s for s in (3.0, 10.0, 30.0)]
        params = SamplingParams(temperature=0.0, max_new_tokens=10_000)
        self.reqs = []
        for b in range(B):
            draft.inject([torch.randn(context, d, generator=g) for _ in range(3)], torch.arange(context),
                         table[b, :context], pool)
            req = Req(f"r{b}", [1], params, RequestSamplingState(params))
            req.row, req.kv_len, req.output_ids = b, context + COMMITTED, [100 + b]
            self.reqs.append(req)
        self.positions = torch.arange(context, context + COMMITTED).repeat(B)
        self.slots = table[:, context:context + COMMITTED].reshape(-1)
        self.worker = DSparkWorker(draft, pool, VerifyPlanner("full"), table,
                                   torch.arange(slots + 1, slots + 1 + B * G))

    def run(self) -> None:
        self.worker.inject(self.taps, self.positions, self.slots)
        self.worker.propose(self.reqs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--reps", type=int, default=10, help="cycles timed per option per round")
    args = ap.parse_args()
    import torch
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    with tempfile.TemporaryDirectory() as root:
        drafts = {name: make_draft(over, root) for name, over in OPTIONS.items()}
        cycles = {(name, B): Cycle(d, B, args.context) for name, d in drafts.items() for B in BATCHES}
        times: dict = {key: [] for key in cycles}
        for cycle in cycles.values():
            for _ in range(5):
                cycle.run()                       # warm: native steps built, pages touched
        for _ in range(args.rounds):
            for key, cycle in cycles.items():
                t0 = time.process_time()
                for _ in range(args.reps):
                    cycle.run()
                times[key].append((time.process_time() - t0) / args.reps * 1e3)
    med = {key: statistics.median(v) for key, v in times.items()}
    best = {key: min(v) for key, v in times.items()}
    rows = [{"option": name, "batch": B, "best_ms": round(best[(name, B)], 3),
             "ratio": round(best[(name, B)] / best[("base", B)], 3), "median_ms": round(med[(name, B)], 3),
             "median_ratio": round(med[(name, B)] / med[("base", B)], 3),
             "rounds_ms": [round(t, 3) for t in times[(name, B)]]} for name in OPTIONS for B in BATCHES]
    lines = ["# DSpark draft options: serving cost of one cycle's draft work", "",
             machine_line(), "",
             f"SmolLM2-135M-shaped draft (the shipped draft's config), fp16 weights, int8 activations, "
             f"native step on; {args.context} tokens of context per request, {COMMITTED} rows injected per "
             f"request, then the greedy draft pass (gamma 7); {args.threads} thread(s); CPU time, best of "
             f"{args.rounds} alternating rounds of {args.reps} cycles (ratio of the medians in brackets). "
             f"`benchmarks/draft_options.py`.", "",
             "| option | " + " | ".join(f"batch {B}: best CPU ms, ratio (medians)" for B in BATCHES) + " |",
             "|---|" + "---:|" * len(BATCHES)]
    for name in OPTIONS:
        cells = [f"{best[(name, B)]:.2f}, {best[(name, B)] / best[('base', B)]:.2f}x "
                 f"({med[(name, B)] / med[('base', B)]:.2f}x)" for B in BATCHES]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "fusion: one request runs the one-call native pass (its fused row on its anchor's and "
              "the mask row); several run the block pass natively, the LM head, Markov loop and confidence "
              "head from Python (the one-call pass has one mask row for all requests)."]
    write_results("draft_options", {"args": vars(args), "rows": rows}, lines)


if __name__ == "__main__":
    main()
