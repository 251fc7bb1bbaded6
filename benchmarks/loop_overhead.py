"""Where a serving step's time goes besides the model forward, on the embedded SmolLM2: the part of
each Engine decode step outside `ModelRunner.forward` (scheduling, sampling, commits: what
overlapping step N+1's scheduling with step N could hide), and the CPU the HTTP process
(OpenAI layer, streaming, incremental detokenization) spends beside the scheduler process while a
streaming chat load runs.

    python benchmarks/loop_overhead.py [--threads 2] [--new-tokens 64] [--reps 3]

Writes benchmarks/results/loop_overhead.{md,json}."""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

import sparkserve  # noqa: F401  (before torch: its OpenMP threads must be told to wait passively)

# isort: split
import torch
from results_io import machine_line, sparkserve_kernels, write_results

QUESTIONS = ["Explain how a refrigerator works.", "Write a haiku about autumn.", "Describe the water cycle.",
             "How do vaccines work?", "Give three tips for learning a new language.",
             "What is the capital of Japan?", "Write a Python function that reverses a string.",
             "What are the benefits of regular exercise?"]
BATCHES = (1, 8)


def engine_steps(threads: int, new_tokens: int, reps: int) -> dict:
    """Per batch size: medians over reps of the step time, the forward time within it, and steps."""
    from sparkserve import Engine
    torch.set_num_threads(threads)
    eng = Engine(max_total_tokens=8192, activation_quant="int8", num_threads=threads)
    sched, spent = eng.scheduler, {"step": 0.0, "forward": 0.0, "steps": 0}
    forward, step = sched.runner.forward, sched.step

    def timed_forward(fb):
        t = time.perf_counter()
        out = forward(fb)
        spent["forward"] += time.perf_counter() - t
        return out

    def timed_step():
        t = time.perf_counter()
        out = step()
        spent["step"] += time.perf_counter() - t
        spent["steps"] += 1
        return out
    sched.runner.forward, sched.step = timed_forward, timed_step
    rows = {}
    for bs in BATCHES:
        msgs = [[{"role": "user", "content": q}] for q in QUESTIONS[:bs]]
        eng.generate(messages=msgs, sampling_params={"temperature": 0, "max_new_tokens": 8})   # warm-up
        runs = []
        for _ in range(reps):
            spent.update(step=0.0, forward=0.0, steps=0)
            eng.generate(messages=msgs, sampling_params={"temperature": 0, "max_new_tokens": new_tokens,
                                                         "ignore_eos": True})
            runs.append(dict(spent))
        rows[bs] = {k: statistics.median(r[k] for r in runs) for k in ("step", "forward", "steps")}
    eng.shutdown()
    return rows


def process_cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_cpu(threads: int, new_tokens: int, reps: int) -> dict:
    """Per concurrency: medians over reps of wall time and CPU seconds of the two processes."""
    import httpx
    import openai
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from server_harness import ServerProcess
    # the harness's own --num-threads comes first: this later one wins
    server = ServerProcess("--max-total-tokens", "8192", "--activation-quant", "int8",
                           "--num-threads", str(threads))
    try:
        info = httpx.get(server.url + "/server_info", timeout=30).json()
        http_pid, sched_pid = server.proc.pid, info["scheduler_pid"]
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused")
        model = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]

        async def chat(q: str) -> int:
            stream = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": q}], max_tokens=new_tokens, temperature=0,
                stream=True, extra_body={"ignore_eos": True})
            return sum([1 async for _ in stream])

        async def run() -> dict:
            await chat(QUESTIONS[0])
            rows = {}
            for conc in BATCHES:
                runs = []
                for _ in range(reps):
                    h0, s0 = process_cpu_seconds(http_pid), process_cpu_seconds(sched_pid)
                    t0 = time.perf_counter()
                    await asyncio.gather(*[chat(q) for q in QUESTIONS[:conc]])
                    runs.append({"wall": time.perf_counter() - t0,
                                 "http_cpu": process_cpu_seconds(http_pid) - h0,
                                 "scheduler_cpu": process_cpu_seconds(sched_pid) - s0})
                rows[conc] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            return rows
        return asyncio.run(run())
    finally:
        server.stop()
        server.remove_log()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    steps = engine_steps(a.threads, a.new_tokens, a.reps)
    cpu = server_cpu(a.threads, a.new_tokens, a.reps)
    res = {"threads": a.threads, "new_tokens": a.new_tokens, "reps": a.reps, "engine": steps,
           "server": cpu, "kernels": sparkserve_kernels(), "date": time.strftime("%Y-%m-%d %H:%M")}
    lines = [f"# Serving-loop overhead, SmolLM2-135M-Instruct Q4_1, {a.threads} threads ({res['date']})", "",
             machine_line(),
             f"kernels: {res['kernels']}; {a.new_tokens} new tokens, greedy, medians of {a.reps}",
             "", "Engine decode steps: time outside the model forward (scheduling, sampling, commits)", "",
             "| batch | ms per step | forward ms | outside the forward |", "|---|---|---|---|"]
    for bs, r in steps.items():
        lines.append(f"| {bs} | {r['step'] / r['steps'] * 1e3:.2f} | {r['forward'] / r['steps'] * 1e3:.2f} | "
                     f"{(r['step'] - r['forward']) / r['step'] * 100:.1f}% |")
    lines += ["", "HTTP server, streaming chat: CPU of the HTTP process (OpenAI layer, streaming, "
              "detokenization) beside the scheduler process", "",
              "| concurrency | wall s | HTTP process CPU s | scheduler process CPU s | HTTP share of CPU |",
              "|---|---|---|---|---|"]
    for conc, r in cpu.items():
        lines.append(f"| {conc} | {r['wall']:.2f} | {r['http_cpu']:.2f} | {r['scheduler_cpu']:.2f} | "
                     f"{r['http_cpu'] / (r['http_cpu'] + r['scheduler_cpu']) * 100:.1f}% |")
    write_results("loop_overhead", res, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
