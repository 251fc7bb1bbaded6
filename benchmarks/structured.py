"""Structured output's cost on the embedded SmolLM2 (in-process Engine, default int8 activations):
output tokens per second of json_schema-constrained against free generation at concurrency 1 and 8
(same prompts, seeds and sampling; the goal: constrained >= 0.9x free), and the grammar compile time
of a few real schemas (the first one also builds the llguidance tokenizer, once per server).

    python benchmarks/structured.py [--rounds 5] [--max-new-tokens 96]

Writes benchmarks/results/structured.{md,json}. llama-server's json_schema is not run beside it
(no llama.cpp build on this machine)."""
from __future__ import annotations

import argparse
import json
import time

import sparkserve  # noqa: F401  (before torch: its OpenMP threads must wait passively)

# isort: split
from results_io import machine_line, sparkserve_kernels, write_results

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
    a = ap.parse_args()
    eng = Engine(max_total_tokens=8192, max_running_requests=8)
    compiles = compile_ms(eng)         # first: a fresh backend (the llguidance tokenizer is built here)
    rows = {}
    for conc in (1, 8):
        free, constrained = throughput(eng, conc, a.rounds, a.max_new_tokens)
        rows[conc] = {"free_tok_s": free, "json_schema_tok_s": constrained, "ratio": constrained / free}
    lines = ["# Structured output: json_schema vs free generation (SmolLM2-135M, int8)", "",
             machine_line(), "", sparkserve_kernels(), "",
             "| concurrency | free tok/s | json_schema tok/s | ratio |", "|---|---|---|---|"]
    lines += [f"| {c} | {r['free_tok_s']:.1f} | {r['json_schema_tok_s']:.1f} | {r['ratio']:.2f} |"
              for c, r in rows.items()]
    lines += ["", "| schema | compile ms |", "|---|---|"]
    lines += [f"| {n} | {ms:.1f} |" for n, ms in compiles.items()]
    lines += ["", f"Sampling at temperature 0.8, max_new_tokens {a.max_new_tokens}, {a.rounds} rounds; the "
              "first compile includes building the llguidance tokenizer (once per server). "
              "llama-server was not run (no llama.cpp build here)."]
    write_results("structured", {"throughput": rows, "compile_ms": compiles}, lines)


if __name__ == "__main__":
    main()
