"""Online serving: TTFT, inter-token latency and output tokens/s at concurrency 1, 8 and 32,
sparkserve next to the real llama.cpp server (`llama-server` found or built from source by
peers/llamacpp.py's `tool` rule: `-np 32 -c 16384 -kvu`, continuous batching, same GGUF, same threads), same
prompts, one run, same machine: only same-run ratios mean something on the project's machines.

    python benchmarks/serving.py [--requests 32] [--max-tokens 64] [--reps 1]
                                 [--engines sparkserve,llamacpp] [--threads 2] [--isa native|avx2|avx512]
                                 [--sampling greedy|top-p] [--prompt-words N]

Load: streaming chat completions, greedy (or `--sampling top-p`: temperature 0.7, top_p 0.9),
`ignore_eos` (both servers honour it, so every request gets --max-tokens tokens), a fresh
connection per request (llama-server closes idle keep-alive connections). Both servers are started
up front and the levels alternate between them (order flipped every round); an idle server does
not compute, so each is measured alone. Per level the median over --reps rounds is reported.
`--engines llama-cpp-python` is the old Python peer (`pip install 'llama-cpp-python[server]'`, one
request at a time). The first run builds llama.cpp (~5 min on 2 cores). Writes
benchmarks/results/serving.{md,json} and serving.png (matplotlib); --isa avx2 / avx512 holds both
servers to that (as decode.py) and writes serving_avx2.* / serving_avx512.*; --sampling top-p
writes serving_top_p.*. --prompt-words N makes every prompt a request to summarize N words of
notes (drawn anew for every request, level and round, so no prefix cache holds them), the load
of long-document chat, and writes serving_long.*."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
from results_io import (
    ISA_ENV,
    RESULTS,
    cap_isa,
    isa_build,
    machine_info,
    machine_line,
    peer_env,
    results_name,
    sparkserve_kernels,
    write_results,
)
from servers import free_port, wait_ready

TOPICS = ["the ocean", "a city at night", "learning to code", "the moon", "autumn leaves", "trains",
          "friendship", "coffee", "mountains", "a thunderstorm", "libraries", "gardening", "robots",
          "the desert", "music", "winter mornings"]
# What each request asks for. top_k 0 and min_p 0 switch off llama.cpp's default chain (top_k 40,
# min_p 0.05), so both engines sample from the same distribution.
SAMPLING = {"greedy": {"temperature": 0},
            "top-p": {"temperature": 0.7, "top_p": 0.9, "top_k": 0, "min_p": 0}}
SAMPLING_TEXT = {"greedy": "temperature 0", "top-p": "temperature 0.7, top_p 0.9 (top_k and min_p off)"}
# the words of --prompt-words' notes
WORDS = ("the a of and to in is was for on with as by at from that this it be are were have has "
         "time year people way day man woman child world life hand part place case week company "
         "system program question work government number night point home water room mother area "
         "money story fact month lot right study book eye job word business issue side kind head "
         "house service friend father power hour game line end member law car city community name "
         "president team minute idea kid body information back parent face others level office door "
         "health person art war history party result change morning reason research girl guy moment "
         "air teacher force education small large new old good great high long little own other").split()


def prompts_for(n_req: int, words: int, first: int = 0) -> list[str]:
    """The chat prompts of a level: a short request per topic, or with `words`, notes to summarize,
    drawn from seeds first, first + 1, ..."""
    if not words:
        return [f"Write a short paragraph about {TOPICS[i % len(TOPICS)]}." for i in range(n_req)]
    out = []
    for i in range(first, first + n_req):
        rng = random.Random(i)
        notes = " ".join(rng.choice(WORDS) for _ in range(words))
        topic = TOPICS[i % len(TOPICS)]
        out.append(f"Request {i}: summarize these notes on {topic} in one paragraph. {notes}")
    return out


def _start(engine: str, port: int, threads: int, isa: str) -> subprocess.Popen:
    from sparkserve.embedded import default_model_path
    model = default_model_path()
    if engine == "sparkserve":
        cmd = [sys.executable, "-m", "sparkserve.cli", "serve", "--port", str(port),
               "--max-running-requests", "32", "--num-threads", str(threads), "--log-level", "warning",
               "--activation-quant", "int8"]
    elif engine == "llamacpp":
        from peers.llamacpp import tool
        cmd = [str(tool("llama-server", isa)), "-m", model, "--host", "127.0.0.1", "--port", str(port),
               "-t", str(threads), "-np", "32", "-c", "16384", "-kvu"]
    elif engine == "llama-cpp-python":
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", model, "--host", "127.0.0.1",
               "--port", str(port), "--n_threads", str(threads), "--chat_format", "chatml", "--n_ctx", "4096",
               # by default a new request interrupts the running stream: queue instead
               "--interrupt_requests", "False"]
    else:
        raise ValueError(f"unknown engine {engine!r}")
    env = (dict(os.environ, OMP_NUM_THREADS=str(threads)) if engine == "sparkserve"
           else peer_env(OMP_NUM_THREADS=str(threads)))
    log = open(os.path.join(tempfile.gettempdir(), f"serving-{engine}-{port}.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    proc.log_path = log.name
    return proc


async def _one(client: httpx.AsyncClient, base: str, prompt: str, max_tokens: int, ignore_eos: bool,
               sampling: dict) -> dict:
    body = {"model": "default", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            **sampling, "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    t0 = time.perf_counter()
    stamps, usage = [], None
    # a fresh connection per request: llama-server drops idle keep-alive connections
    async with client.stream("POST", base + "/v1/chat/completions", json=body,
                             headers={"Connection": "close"}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{base}: HTTP {r.status_code}: {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices") or []:
                if (c.get("delta") or {}).get("content"):
                    stamps.append(time.perf_counter())
    t1 = time.perf_counter()
    n = (usage or {}).get("completion_tokens") or len(stamps)
    return {"ttft": stamps[0] - t0 if stamps else t1 - t0, "e2e": t1 - t0, "tokens": n,
            "itl": [b - a for a, b in zip(stamps, stamps[1:])]}


async def _level(base: str, conc: int, n_req: int, max_tokens: int, ignore_eos: bool = True,
                 sampling: dict = SAMPLING["greedy"], words: int = 0, first: int = 0) -> dict:
    prompts = prompts_for(n_req, words, first)
    sem = asyncio.Semaphore(conc)
    limits = httpx.Limits(max_connections=conc + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def run(p):
            async with sem:
                return await _one(client, base, p, max_tokens, ignore_eos, sampling)
        t = time.perf_counter()
        res = await asyncio.gather(*(run(p) for p in prompts))
        wall = time.perf_counter() - t
    itl = [x for r in res for x in r["itl"]]
    return {"concurrency": conc, "requests": n_req,
            "ttft_median_s": statistics.median(r["ttft"] for r in res),
            "itl_median_ms": 1000 * statistics.median(itl) if itl else float("nan"),
            "output_tok_s": sum(r["tokens"] for r in res) / wall, "wall_s": wall,
            "tokens_per_request": statistics.median(r["tokens"] for r in res)}


def plot(results: dict[str, list[dict]], name: str = "serving") -> None:
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
    fig.savefig(os.path.join(RESULTS, f"{name}.png"), dpi=100)


METRICS = ("ttft_median_s", "itl_median_ms", "output_tok_s", "wall_s", "tokens_per_request")
IGNORE_EOS = {"sparkserve": True, "llamacpp": True, "llama-cpp-python": False}


def _prompt_tokens(words: int) -> int:
    """Median prompt tokens of a --prompt-words level (the chat template included)."""
    from sparkserve.embedded import default_model_path
    from sparkserve.frontend.tokenizer import load_tokenizer
    tok = load_tokenizer(default_model_path())
    return int(statistics.median(
        len(tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=True))
        for p in prompts_for(8, words)))


def _median_rows(rounds: list[dict]) -> dict:
    """One level's rows from --reps rounds -> one row of per-metric medians (plus the raw rounds)."""
    row = {"concurrency": rounds[0]["concurrency"], "requests": rounds[0]["requests"]}
    row.update({k: statistics.median(r[k] for r in rounds) for k in METRICS})
    row["rounds"] = rounds
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", default="sparkserve,llamacpp",
                    help="sparkserve, llamacpp (llama-server built from source), llama-cpp-python")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=1, help="rounds over all levels; medians reported")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--sampling", default="greedy", choices=sorted(SAMPLING),
                    help="top-p: temperature 0.7, top_p 0.9 (results in serving_top_p.*)")
    ap.add_argument("--replot", action="store_true", help="only redraw serving.png from serving.json")
    ap.add_argument("--isa", default="native", choices=sorted(ISA_ENV),
                    help="what both servers may use of the CPU (avx2: an AVX2-only machine; avx512: no VNNI)")
    ap.add_argument("--prompt-words", type=int, default=0,
                    help="prompts of this many words of notes to summarize (results in serving_long.*)")
    a = ap.parse_args()
    base_name = "serving" if a.sampling == "greedy" else f"serving_{a.sampling.replace('-', '_')}"
    name = results_name(base_name + ("_long" if a.prompt_words else ""), a.isa)
    sampling = SAMPLING[a.sampling]
    if a.replot:
        with open(os.path.join(RESULTS, f"{name}.json")) as f:
            data = json.load(f)
        plot(data.get("engines", data), name)       # older files hold the engines at the top level
        return 0
    cap_isa(a.isa)
    levels = [int(x) for x in a.concurrency.split(",")]
    engines = a.engines.split(",")
    servers: dict[str, tuple[str, subprocess.Popen]] = {}
    raw: dict[str, dict[int, list[dict]]] = {e: {c: [] for c in levels} for e in engines}
    try:
        for engine in engines:            # one at a time: a starting server (or a build) needs the cores
            port = free_port()
            base = f"http://127.0.0.1:{port}"
            proc = _start(engine, port, a.threads, a.isa)
            servers[engine] = (base, proc)
            wait_ready(base, proc)
            asyncio.run(_level(base, 1, 2, 8, IGNORE_EOS[engine]))          # warm-up
        for rep in range(a.reps):
            for c in levels:
                for engine in (engines if (rep + levels.index(c)) % 2 == 0 else engines[::-1]):
                    base, proc = servers[engine]
                    # long prompts are new at every level and round (the same ones for each server)
                    first = 1000 * (1 + rep * len(levels) + levels.index(c))
                    r = asyncio.run(_level(base, c, max(a.requests, c) if c > 1 else 8, a.max_tokens,
                                           IGNORE_EOS[engine], sampling, a.prompt_words, first))
                    raw[engine][c].append(r)
                    print(f"round {rep + 1}/{a.reps} {engine} c={c}: TTFT {r['ttft_median_s']:.3f} s, "
                          f"ITL {r['itl_median_ms']:.1f} ms, {r['output_tok_s']:.1f} tok/s",
                          file=sys.stderr, flush=True)
    finally:
        for base, proc in servers.values():
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    results = {e: [_median_rows(raw[e][c]) for c in levels] for e in engines}
    machine, kernels = machine_info(a.isa), sparkserve_kernels()
    lines = [f"# Online serving, SmolLM2-135M-Instruct GGUF, {a.threads} threads "
             f"({time.strftime('%Y-%m-%d %H:%M')})", "",
             f"{machine_line(machine)}; sparkserve kernels: {kernels}", "",
             f"chat completions, streaming, {SAMPLING_TEXT[a.sampling]}, max_tokens {a.max_tokens}, "
             + (f"prompts of {a.prompt_words} words of notes to summarize (~{_prompt_tokens(a.prompt_words)} "
                "tokens), " if a.prompt_words else "") +
             "ignore_eos, a fresh "
             f"connection per request; llamacpp = llama-server built from source with {isa_build(a.isa)} "
             f"(-np 32 -c 16384 -kvu -t {a.threads}); servers alternate, medians of {a.reps} round(s)", "",
             "| engine | concurrency | TTFT median (s) | ITL median (ms) | output tok/s |",
             "|---|---|---|---|---|"]
    for engine, rows in results.items():
        for r in rows:
            lines.append(f"| {engine} | {r['concurrency']} | {r['ttft_median_s']:.3f} | "
                         f"{r['itl_median_ms']:.1f} | {r['output_tok_s']:.1f} |")
    ratios = []
    if "sparkserve" in results and "llamacpp" in results:
        lines += ["", "sparkserve / llama.cpp (output tok/s: > 1 means sparkserve is faster; "
                  "TTFT and ITL: < 1 means sparkserve is faster)", "",
                  "| concurrency | output tok/s | TTFT | ITL |", "|---|---|---|---|"]
        for s_row, l_row in zip(results["sparkserve"], results["llamacpp"]):
            q = {k: s_row[k] / l_row[k] if l_row[k] else float("nan")
                 for k in ("output_tok_s", "ttft_median_s", "itl_median_ms")}
            ratios.append({"concurrency": s_row["concurrency"], **q})
            lines.append(f"| {s_row['concurrency']} | **{q['output_tok_s']:.2f}x** | "
                         f"{q['ttft_median_s']:.2f}x | {q['itl_median_ms']:.2f}x |")
    data = {"engines": results, "ratio_sparkserve_vs_llamacpp": ratios, "machine": machine,
            "sparkserve_kernels": kernels, "threads": a.threads, "max_tokens": a.max_tokens,
            "sampling": sampling, "prompt_words": a.prompt_words,
            "reps": a.reps, "date": time.strftime("%Y-%m-%d %H:%M")}
    write_results(name, data, lines)
    plot(results, name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
