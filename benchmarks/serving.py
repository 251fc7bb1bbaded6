"""Online serving: TTFT, inter-token latency and output tokens/s at concurrency 1, 8 and 32,
sparkserve next to the llama.cpp server (`python -m llama_cpp.server`, same GGUF), same prompts,
one run; each server runs alone while it is measured.

    python benchmarks/serving.py [--requests 32] [--max-tokens 64] [--engines sparkserve,llamacpp]

Needs `pip install 'llama-cpp-python[server]'` for the peer (compiles llama.cpp, ~7 min).
Writes benchmarks/results/serving.{md,json} and serving.png (when matplotlib is installed)."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx
from results_io import RESULTS, write_results

TOPICS = ["the ocean", "a city at night", "learning to code", "the moon", "autumn leaves", "trains",
          "friendship", "coffee", "mountains", "a thunderstorm", "libraries", "gardening", "robots",
          "the desert", "music", "winter mornings"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(engine: str, port: int, threads: int) -> subprocess.Popen:
    from sparkserve.embedded import default_model_path
    model = default_model_path()
    if engine == "sparkserve":
        cmd = [sys.executable, "-m", "sparkserve.cli", "serve", "--port", str(port),
               "--max-running-requests", "32", "--log-level", "warning"]
    else:
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", model, "--host", "127.0.0.1",
               "--port", str(port), "--n_threads", str(threads), "--chat_format", "chatml", "--n_ctx", "4096",
               # by default a new request interrupts the running stream: queue instead
               "--interrupt_requests", "False"]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)


def _wait_ready(base: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(base + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError("server did not come up")


async def _one(client: httpx.AsyncClient, base: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": "default", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps, usage = [], None
    async with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices", []):
                if c.get("delta", {}).get("content"):
                    stamps.append(time.perf_counter())
    t1 = time.perf_counter()
    n = (usage or {}).get("completion_tokens") or len(stamps)
    return {"ttft": stamps[0] - t0 if stamps else t1 - t0, "e2e": t1 - t0, "tokens": n,
            "itl": [b - a for a, b in zip(stamps, stamps[1:])]}


async def _level(base: str, conc: int, n_req: int, max_tokens: int) -> dict:
    prompts = [f"Write a short paragraph about {TOPICS[i % len(TOPICS)]}." for i in range(n_req)]
    sem = asyncio.Semaphore(conc)
    async with httpx.AsyncClient(timeout=600) as client:
        async def run(p):
            async with sem:
                return await _one(client, base, p, max_tokens)
        t = time.perf_counter()
        res = await asyncio.gather(*(run(p) for p in prompts))
        wall = time.perf_counter() - t
    itl = [x for r in res for x in r["itl"]]
    return {"concurrency": conc, "requests": n_req,
            "ttft_median_s": statistics.median(r["ttft"] for r in res),
            "itl_median_ms": 1000 * statistics.median(itl) if itl else float("nan"),
            "output_tok_s": sum(r["tokens"] for r in res) / wall, "wall_s": wall}


def plot(results: dict[str, list[dict]]) -> None:
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for engine, rows in results.items():
        xs = [r["concurrency"] for r in rows]
        for ax, key, label in zip(axes, ("ttft_median_s", "itl_median_ms", "output_tok_s"),
                                  ("TTFT median (s)", "ITL median (ms)", "output tok/s")):
            ax.plot(xs, [r[key] for r in rows], marker="o", label=engine)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency")
            ax.set_title(label)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, "serving.png"), dpi=100)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", default="sparkserve,llamacpp")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--replot", action="store_true", help="only redraw serving.png from serving.json")
    a = ap.parse_args()
    if a.replot:
        with open(os.path.join(RESULTS, "serving.json")) as f:
            plot(json.load(f))
        return 0
    levels = [int(x) for x in a.concurrency.split(",")]
    results: dict[str, list[dict]] = {}
    for engine in a.engines.split(","):
        port = _free_port()
        base = f"http://127.0.0.1:{port}"
        proc = _start(engine, port, a.threads)
        try:
            _wait_ready(base, proc)
            asyncio.run(_level(base, 1, 2, 8))                          # warm-up
            results[engine] = [asyncio.run(_level(base, c, max(a.requests, c) if c > 1 else 8, a.max_tokens))
                               for c in levels]
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    lines = [f"# Online serving, SmolLM2-135M-Instruct GGUF, {a.threads} threads "
             f"({time.strftime('%Y-%m-%d %H:%M')})",
             "", f"chat completions, streaming, temperature 0, max_tokens {a.max_tokens}; "
             "each server alone on the machine while measured", "",
             "| engine | concurrency | TTFT median (s) | ITL median (ms) | output tok/s |",
             "|---|---|---|---|---|"]
    for engine, rows in results.items():
        for r in rows:
            lines.append(f"| {engine} | {r['concurrency']} | {r['ttft_median_s']:.3f} | "
                         f"{r['itl_median_ms']:.1f} "
                         f"| {r['output_tok_s']:.1f} |")
    write_results("serving", results, lines)
    plot(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
