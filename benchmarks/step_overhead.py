"""Per-step CPU of a decode loop outside the native step, before and after a change: the same
loop under two source trees (BASE: a git commit, unpacked to a temporary folder; the working tree)
in alternating processes, one thread, thread CPU time (the machine may be loaded: ratios only).

Two models: the embedded SmolLM2 (full attention, 49k-token LM head) and a gemma3-shaped
random Q8_0 GGUF (families.py's SHAPE, 6 layers, window 128: a split pool whose windowed slots
slide every step) with a 600-token prompt. Per step: total, outside the native step (which
includes the LM head), and outside the native step and the LM head (scheduling, allocation,
window slides, batch building, sampling, commits).

    PYTHONPATH=. python benchmarks/step_overhead.py --base COMMIT [--new TREE] [--rounds 4] [--new-tokens 128]

writes benchmarks/results/step_overhead.{md,json}."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
QUESTIONS = ["Explain how a refrigerator works.", "Write a haiku about autumn.", "Describe the water cycle.",
             "How do vaccines work?", "Give three tips for learning a new language.",
             "What is the capital of Japan?", "Write a Python function that reverses a string.",
             "What are the benefits of regular exercise?"]
BATCHES = (1, 8)


def gemma3_gguf(folder: str) -> str:
    """The gemma3-shaped random checkpoint as a Q8_0 GGUF (made once per folder)."""
    out = os.path.join(folder, "gemma3.gguf")
    if not os.path.exists(out):
        import torch
        sys.path[:0] = [HERE, os.path.join(ROOT, "tests")]
        from families import SHAPE
        from family_fixtures import FAMILIES, write_gguf
        from transformers import AutoConfig, AutoModelForCausalLM
        model_type, kw = FAMILIES["gemma3"]
        cfg = {**kw, **SHAPE, "sliding_window": 128, "query_pre_attn_scalar": 64, "num_hidden_layers": 6}
        torch.manual_seed(0)
        hf = os.path.join(folder, "gemma3")
        AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg),
                                         dtype=torch.float32).save_pretrained(hf)
        write_gguf(hf, out, "q8_0")
    return out


def measure(model: str, new_tokens: int) -> dict:
    """In this process (run by `main` under one tree): per batch, ms per decode-loop step."""
    import torch

    from sparkserve import Engine
    from sparkserve.models import llama_native
    torch.set_num_threads(1)
    kw = dict(max_total_tokens=16384, activation_quant="int8", num_threads=1)
    eng = Engine(model, skip_tokenizer_init=True, **kw) if model else Engine(**kw)
    sched, spent = eng.scheduler, {"step": 0.0, "native": 0.0, "head": 0.0}

    def timed(fn, key):
        def run(*a):
            t = time.thread_time()
            out = fn(*a)
            spent[key] += time.thread_time() - t
            return out
        return run
    native = llama_native.NativeStep.forward
    llama_native.NativeStep.forward = lambda self, *a: timed(native, "native")(self, *a)
    sched.step = timed(sched.step, "step")
    sched.runner.compute_logits = timed(sched.runner.compute_logits, "head")
    rows = {}
    for bs in BATCHES:
        if model:
            prompts = dict(input_ids=[[(7 * i + 13 * j) % 8000 + 5 for i in range(600)] for j in range(bs)])
        else:
            prompts = dict(messages=[[{"role": "user", "content": q}] for q in QUESTIONS[:bs]])
        eng.generate(**prompts, sampling_params={"temperature": 0, "max_new_tokens": 8})
        spent.update(step=0.0, native=0.0, head=0.0)
        forwards = sched.num_forwards
        eng.generate(**prompts, sampling_params={"temperature": 0, "max_new_tokens": new_tokens,
                                                 "ignore_eos": True})
        ms = 1e3 / (sched.num_forwards - forwards)
        rows[bs] = {"step": spent["step"] * ms, "outside_native": (spent["step"] - spent["native"]) * ms,
                    "outside_native_and_head": (spent["step"] - spent["native"] - spent["head"]) * ms}
    eng.shutdown()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="HEAD", help="the commit to compare against")
    ap.add_argument("--new", default=ROOT, help="the source tree to measure (default: this working tree)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--measure", help=argparse.SUPPRESS)      # child: MODEL ('' = embedded SmolLM2)
    a = ap.parse_args()
    if a.measure is not None:
        print(json.dumps(measure(a.measure, a.new_tokens)))
        return 0
    from results_io import machine_line, write_results
    tmp = tempfile.mkdtemp(prefix="step_overhead_")
    base = os.path.join(tmp, "base")
    os.makedirs(base)
    subprocess.run(f"git -C {ROOT} archive {a.base} | tar -x -C {base}", shell=True, check=True)
    trees = {"base": base, "new": a.new}
    models = {"SmolLM2-135M (embedded)": "", "gemma3-shaped Q8_0, split pool": gemma3_gguf(tmp)}
    got: dict = {m: {t: [] for t in trees} for m in models}
    for r in range(a.rounds):
        for tree in (("base", "new") if r % 2 == 0 else ("new", "base")):
            for label, model in models.items():
                env = dict(os.environ, PYTHONPATH=trees[tree])
                out = subprocess.run([sys.executable, os.path.abspath(__file__), "--measure", model,
                                      "--new-tokens", str(a.new_tokens)], env=env, cwd=trees[tree],
                                     capture_output=True, text=True, check=True).stdout
                got[label][tree].append(json.loads(out.strip().splitlines()[-1]))
                print(r, tree, label, got[label][tree][-1], flush=True)
    res = {"base": a.base, "rounds": a.rounds, "new_tokens": a.new_tokens, "runs": got,
           "date": time.strftime("%Y-%m-%d %H:%M")}
    lines = [f"# Decode-step CPU outside the native step: {a.base} vs {a.new} ({res['date']})", "",
             machine_line(), "",
             f"One thread, thread CPU time per step, {a.new_tokens} new tokens (greedy), medians of "
             f"{a.rounds} alternating rounds (one process each). 'Python' = outside the native step and the "
             "LM head.", "",
             "| model | batch | step ms base / new | outside native ms base / new | Python ms base / new "
             "| Python ratio | Python share of step base / new |", "|---|---|---|---|---|---|---|"]
    for label in models:
        for bs in BATCHES:
            med = {t: {k: statistics.median(run[str(bs)][k] for run in got[label][t])
                       for k in ("step", "outside_native", "outside_native_and_head")} for t in trees}
            b, n = med["base"], med["new"]
            py = "outside_native_and_head"
            lines.append(f"| {label} | {bs} | {b['step']:.2f} / {n['step']:.2f} | "
                         f"{b['outside_native']:.2f} / {n['outside_native']:.2f} | "
                         f"{b[py]:.3f} / {n[py]:.3f} | {n[py] / b[py]:.2f}x | "
                         f"{b[py] / b['step'] * 100:.1f}% / {n[py] / n['step'] * 100:.1f}% |")
    write_results("step_overhead", res, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
