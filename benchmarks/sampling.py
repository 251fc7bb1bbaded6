"""The sampler's time per decode step against transformers' sampling (its logits warpers, softmax and
torch.multinomial, as `generate` runs them), on SmolLM2's own logits, in one run: batch 1 / 8 / 32,
greedy and the usual sampled settings. sparkserve's Sampler runs twice: with its CPU kernels
(kernels/argmax.cpp, sample.cpp) and with its torch definition alone (what other devices run),
in this process (OpenMP threads waiting passively, as sparkserve runs them); transformers' side in a
process of its own (`--peer`) with OpenMP's default waiting, as a program of its own runs it.

    python benchmarks/sampling.py [--threads 2] [--calls 50]

Writes benchmarks/results/sampling.{md,json}."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

if "--peer" in sys.argv:     # transformers' side, in a process of its own: its torch loads before
    import torch  # noqa: F401  (sparkserve's import could ask for passive OpenMP waiting)
    warnings.filterwarnings("ignore", "torch was imported before sparkserve", RuntimeWarning)

# isort: split
import sparkserve  # noqa: F401  (before torch: its OpenMP threads must be told to wait passively)

# isort: split
import torch
from results_io import machine_line, peer_env, sparkserve_kernels, write_results
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from sparkserve.core.sampling_state import RequestSamplingState
from sparkserve.executor import sampler as sampler_mod
from sparkserve.sampling_params import SamplingParams

SETTINGS = {"greedy": dict(temperature=0), "temperature 1.0": dict(temperature=1.0),
            "temperature 0.7, top_p 0.9": dict(temperature=0.7, top_p=0.9),
            "temperature 0.8, top_k 40": dict(temperature=0.8, top_k=40),
            "temperature 1.0, min_p 0.05": dict(temperature=1.0, min_p=0.05),
            "temperature 0.7, repetition_penalty 1.1": dict(temperature=0.7, repetition_penalty=1.1)}
PROMPT = list(range(1000, 1100))     # the ids a repetition penalty sees (a 100-token prompt)
BATCHES = (1, 8, 32)
QUESTIONS = ["Explain how a refrigerator works.", "Write a haiku about autumn.", "Describe the water cycle.",
             "How do vaccines work?", "Give three tips for learning a new language.",
             "What is the capital of Japan?", "Write a Python function that reverses a string.",
             "What are the benefits of regular exercise?"]


def model_logits(threads: int) -> torch.Tensor:
    """Rows of logits SmolLM2 gave while answering chat questions (sampled at temperature 1, so the
    contexts vary)."""
    from sparkserve import Engine
    eng = Engine(num_threads=threads)
    rows: list[torch.Tensor] = []
    sample = eng.scheduler.sampler.sample

    def keep(logits, states):
        rows.append(logits.clone())
        return sample(logits, states)
    eng.scheduler.sampler.sample = keep
    eng.generate(messages=[[{"role": "user", "content": q}] for q in QUESTIONS],
                 sampling_params={"temperature": 1.0, "max_new_tokens": 64, "seed": 0})
    eng.shutdown()
    return torch.cat(rows)


def hf_sample(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    if p.is_greedy:
        return logits.argmax(-1)
    warpers = LogitsProcessorList([TemperatureLogitsWarper(p.temperature)])
    if p.repetition_penalty != 1.0:
        warpers.insert(0, RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    if p.top_k > 0:
        warpers.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1:
        warpers.append(TopPLogitsWarper(p.top_p))
    if p.min_p > 0:
        warpers.append(MinPLogitsWarper(p.min_p))
    probs = warpers(torch.tensor([PROMPT] * len(logits)), logits).softmax(-1)
    return torch.multinomial(probs, 1)[:, 0]


def timed(fn, pool: torch.Tensor, batch: int, calls: int) -> float:
    """Median ms per call over `calls` batches cut from the pool of rows."""
    times = []
    for i in range(calls + 3):
        start = (i * batch) % (len(pool) - batch)
        x = pool[start:start + batch].contiguous()
        t = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t)
    return statistics.median(times[3:]) * 1e3


def peer_times(pool_path: str, calls: int) -> dict[str, dict[int, float]]:
    """transformers' ms per call for every setting and batch (the --peer process)."""
    pool = torch.load(pool_path)
    out = {}
    for name, kw in SETTINGS.items():
        params = SamplingParams(**kw).validate(pool.shape[1])
        out[name] = {b: timed(lambda x: hf_sample(x, params), pool, b, calls) for b in BATCHES}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--peer", help=argparse.SUPPRESS)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.peer:
        print(json.dumps(peer_times(a.peer, a.calls)))
        return
    pool = model_logits(a.threads)
    with tempfile.TemporaryDirectory() as tmp:     # transformers runs as a program of its own would
        torch.save(pool, os.path.join(tmp, "pool.pt"))
        done = subprocess.run([sys.executable, __file__, "--peer", os.path.join(tmp, "pool.pt"), "--threads",
                               str(a.threads), "--calls", str(a.calls)], capture_output=True, text=True,
                              env=peer_env(), check=True)
    hf = json.loads(done.stdout.strip().splitlines()[-1])
    kernel_sample_rows = sampler_mod.sample_rows
    res: dict[str, dict[int, dict[str, float]]] = {}
    for name, kw in SETTINGS.items():
        params = SamplingParams(**kw).validate(pool.shape[1])
        res[name] = {}
        for b in BATCHES:
            states = [RequestSamplingState(params, PROMPT) for _ in range(b)]
            row = {"kernels": timed(lambda x: sampler_mod.Sampler().sample(x, states), pool, b, a.calls)}
            sampler_mod.sample_rows = lambda *args: None
            argmax = sampler_mod.argmax_rows
            sampler_mod.argmax_rows = lambda x: x.argmax(-1)
            row["torch"] = timed(lambda x: sampler_mod.Sampler().sample(x, states), pool, b, a.calls)
            sampler_mod.sample_rows, sampler_mod.argmax_rows = kernel_sample_rows, argmax
            row["transformers"] = hf[name][str(b)]
            res[name][b] = row
            print(name, b, {k: round(v, 3) for k, v in row.items()}, flush=True)
    lines = ["# Sampling time per decode step (SmolLM2-135M logits, 49,152 ids)", "",
             f"{machine_line()}; sparkserve kernels: {sparkserve_kernels()}; {a.threads} threads", "",
             f"{len(pool)} rows of the model's logits; median ms per call over {a.calls} calls. sparkserve "
             "with its CPU kernels and with its torch definition alone; transformers: its logits "
             "warpers, softmax and torch.multinomial, in a process of its own with OpenMP's default "
             "waiting (sparkserve's process waits passively).", "",
             "| setting | batch | sparkserve (ms) | sparkserve torch path (ms) | transformers (ms) | "
             "transformers / sparkserve |", "|---|---|---|---|---|---|"]
    for name, by_batch in res.items():
        for b, r in by_batch.items():
            lines.append(f"| {name} | {b} | {r['kernels']:.3f} | {r['torch']:.3f} | "
                         f"{r['transformers']:.3f} | **{r['transformers'] / r['kernels']:.1f}x** |")
    write_results("sampling", {"rows": len(pool), "threads": a.threads, "calls": a.calls, "results": res},
                  lines)


if __name__ == "__main__":
    main()
