"""Structured output's cost on the embedded SmolLM2 (in-process Engine, default int8 activations):
output tokens per second of json_schema-constrained against free generation at concurrency 1 and 8
(same prompts, seeds and sampling; the goal: constrained >= 0.9x free), and the grammar compile time
of a few real schemas (the first one also builds the llguidance tokenizer, once per server).

    python benchmarks/structured.py [--rounds 5] [--max-new-tokens 96] [--llama-server PATH | --no-peer]

Beside it in the same run, llama.cpp's llama-server (--llama-server PATH, else found or built by
peers/llamacpp.py's `tool` rule, as every benchmark finds llama.cpp) on the same GGUF: free and
`response_format` json_schema chat completions over HTTP, alternating, at the same concurrencies
(`-np 8`); what compares across the two is each engine's constrained / free ratio (sparkserve here is
the in-process Engine). Writes benchmarks/results/structured.{md,json}."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import tempfile
import time

import sparkserve  # noqa: F401  (before torch: its OpenMP threads must wait passively)

# isort: split
import httpx
from results_io import machine_line, peer_env, sparkserve_kernels, write_results
from servers import free_port, wait_ready

from sparkserve import Engine

PERSON = {"type": "object", "required": ["name", "age", "hobbies", "bio"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "hobbies": {"type": "array", "items": {"type": "string"}},
                         "bio": {"type": "string"}}}
SCHEMAS = {
    "person (4 fields, array)": PERSON,
    "order (nested, enum, pattern)": {
        "type": "object", "additionalProperties": False, "required": ["id", "items", "status"],
        "properties": {"id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"},
                       "status": {"enum": ["new", "paid", "shipped", "cancelled"]},
                       "items": {"type": "array", "minItems": 1, "items": {
                           "type": "object", "required": ["sku", "qty"],
                           "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
                                          "price": {"type": "number"}}}}}},
    "tool call (anyOf of 3 functions)": {"anyOf": [
        {"type": "object", "required": ["name", "arguments"], "properties": {
            "name": {"const": fn}, "arguments": {"type": "object", "properties": {
                p: {"type": t} for p, t in args.items()}, "required": list(args)}}}
        for fn, args in {"get_weather": {"city": "string", "unit": "string"},
                         "search": {"query": "string", "limit": "integer"},
                         "book": {"hotel": "string", "nights": "integer", "breakfast": "boolean"}}.items()]},
}
MSGS = [{"role": "user",
         "content": "Describe a fictional person in detail as JSON: name, age, hobbies, a long bio."}]


def throughput(eng: Engine, conc: int, rounds: int, max_new: int) -> tuple[float, float]:
    """(free, constrained) output tokens per second; their rounds alternate, so that a machine whose
    speed drifts (shared cores) weighs on both alike."""
    free = {"temperature": 0.8, "max_new_tokens": max_new}
    kinds = (free, dict(free, json_schema=json.dumps(PERSON)))
    tokens, seconds = [0, 0], [0.0, 0.0]
    for r in range(rounds + 1):                 # round 0 warms up
        for k, sp in enumerate(kinds):
            t0 = time.perf_counter()
            out = eng.generate(messages=[MSGS] * conc,
                               sampling_params=[dict(sp, seed=1000 * r + i) for i in range(conc)])
            if r:
                seconds[k] += time.perf_counter() - t0
                tokens[k] += sum(o["meta_info"]["completion_tokens"] for o in out)
    return tokens[0] / seconds[0], tokens[1] / seconds[1]


def start_llama_server(binary: str, threads: int) -> tuple[subprocess.Popen, str]:
    from sparkserve.embedded import default_model_path
    port = free_port()
    cmd = [binary, "-m", default_model_path(), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
           "-np", "8", "-c", "8192"]
    log = open(os.path.join(tempfile.gettempdir(), f"structured-llama-server-{port}.log"), "w")
    env = peer_env(OMP_NUM_THREADS=str(threads))
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    proc.log_path = log.name
    base = f"http://127.0.0.1:{port}"
    wait_ready(base, proc)
    return proc, base


async def _http_round(base: str, conc: int, constrained: bool, seed: int, max_new: int) -> int:
    body = {"messages": MSGS, "temperature": 0.8, "max_tokens": max_new}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    async with httpx.AsyncClient(timeout=600) as client:
        rs = await asyncio.gather(*(client.post(base + "/v1/chat/completions", json=dict(body, seed=seed + i))
                                    for i in range(conc)))
    for r in rs:
        r.raise_for_status()
    return sum(r.json()["usage"]["completion_tokens"] for r in rs)


def http_throughput(base: str, conc: int, rounds: int, max_new: int) -> tuple[float, float]:
    """throughput()'s measure for a server: (free, json_schema) output tokens per second."""
    tokens, seconds = [0, 0], [0.0, 0.0]
    for r in range(rounds + 1):
        for k in (0, 1):
            t0 = time.perf_counter()
            n = asyncio.run(_http_round(base, conc, bool(k), 1000 * r, max_new))
            if r:
                seconds[k] += time.perf_counter() - t0
                tokens[k] += n
    return tokens[0] / seconds[0], tokens[1] / seconds[1]


def compile_ms(eng: Engine) -> dict[str, float]:
    backend = eng.scheduler.grammar
    out = {}
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        backend.compiled("json_schema", json.dumps(schema)).result()
        out[name] = 1e3 * (time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--llama-server", help="a llama-server binary (default: peers/llamacpp.py's `tool` rule: "
                                           "LLAMA_SERVER / LLAMA_CPP_LIB_PATH, else a found or built copy)")
    ap.add_argument("--no-peer", action="store_true", help="sparkserve only")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    peer, base = None, None
    if not a.no_peer:
        from peers.llamacpp import tool
        peer, base = start_llama_server(str(tool("llama-server", override=a.llama_server)), a.threads)
    eng = Engine(max_total_tokens=8192, max_running_requests=8, num_threads=a.threads)
    compiles = compile_ms(eng)         # first: a fresh backend (the llguidance tokenizer is built here)
    rows = {}
    try:
        for conc in (1, 8):
            engines = {"sparkserve": lambda: throughput(eng, conc, a.rounds, a.max_new_tokens)}
            if base:
                engines["llama-server"] = lambda: http_throughput(base, conc, a.rounds, a.max_new_tokens)
            for name, run in engines.items():       # an idle server does not compute: each measured alone
                free, constrained = run()
                rows[f"{name} {conc}"] = {"engine": name, "concurrency": conc, "free_tok_s": free,
                                          "json_schema_tok_s": constrained, "ratio": constrained / free}
    finally:
        if peer is not None:
            peer.terminate()
            peer.wait(30)
    lines = ["# Structured output: json_schema vs free generation (SmolLM2-135M)", "",
             machine_line(), "", sparkserve_kernels(), "",
             "| engine | concurrency | free tok/s | json_schema tok/s | ratio |", "|---|---|---|---|---|"]
    lines += [f"| {r['engine']} | {r['concurrency']} | {r['free_tok_s']:.1f} | "
              f"{r['json_schema_tok_s']:.1f} | {r['ratio']:.2f} |" for r in rows.values()]
    lines += ["", "| schema | compile ms (sparkserve) |", "|---|---|"]
    lines += [f"| {n} | {ms:.1f} |" for n, ms in compiles.items()]
    lines += ["", f"Sampling at temperature 0.8, max_new_tokens {a.max_new_tokens}, {a.rounds} rounds, "
              f"{a.threads} threads each; the first compile includes building the llguidance tokenizer "
              "(once per server). sparkserve: the in-process Engine (int8 activations); llama-server: the "
              "same GGUF over HTTP (`response_format` json_schema, -np 8). Compare each engine's ratio, "
              "not tok/s across them."]
    write_results("structured", {"throughput": rows, "compile_ms": compiles}, lines)


if __name__ == "__main__":
    main()
