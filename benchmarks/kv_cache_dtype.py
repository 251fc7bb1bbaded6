"""What --kv-cache-dtype float16 / bfloat16 / int8 / fp8_e4m3 / fp8_e5m2 cost and buy against a
float32 pool, on SmolLM2 (the embedded Q4_1 model).

Accuracy: the model over held-out text (ShareGPT, HumanEval; activation_quant.py's texts and
chunks of 8 tokens), each pool dtype against float32: max / mean |logit diff|, top-1 agreement,
perplexity. Activations stay fp32 here (exact), so the differences are the pool's rounding alone:
under int8 activations a K/V value rounded differently moves some activations across an int8
rounding step, and the comparison would measure int8's noise instead.

Speed (int8 activations, as served): batch-8 decode at contexts of 512 / 2,048 / 8,192 tokens (a
prompt of random ids, so no two share a prefix, then 32 new tokens per request), output tokens/s of
the engine decoding them, an int8 pool against float16 (the GGUF default). The prompts' K/V are not
computed: random rows (quantized for the int8 pool) are written into the pool as a PD decode server
receives a prompt's (`Scheduler.add_prebuilt`), since attention costs the same whatever the values
and 8 prefills of 8,160 tokens would take most of the run; the time is the 32 decode steps alone.
Both engines live in one worker process and take turns within each round and context (the order
alternating between rounds), so the two times of a pair are seconds apart: on a machine whose load
swings by 2-3x within minutes (7 agents on 2 cores) engines in separate processes minutes apart
measured the load, not the pool. Medians of the times and of the pairs' ratios.

Beside it, in the same rounds and turns, the same workload in llama.cpp on the same GGUF:
`llama-batched-bench -npl 8 -npp CONTEXT-32 -ntg 32 -pps -no-kvu` with `-ctk/-ctv q8_0` (its q8_0
cache: blocks of 32 with a float16 scale, sparkserve's int8 layout) against `f16`, flash attention on
(a quantized V cache needs it): one prompt prefilled and copied into each of 8 sequences' own cache
streams (-no-kvu: 8 copies, as 8 distinct prompts would be), then 32 decode steps of all 8 (its
T_TG: the time compared, the prefill left out as sparkserve's is). One thread by default
(--llama-threads): on the shared 2-core machine llama.cpp's 2-thread pool collapses (families.py).
The binary: peers/llamacpp.py `tool` (LLAMA_BATCHED_BENCH, LLAMA_CPP_LIB_PATH, else found or
built); --no-peer leaves it out, --peer-contexts runs it at some contexts only (its prefill of the
prompt, untimed, costs minutes at 8,192 tokens on one loaded core). --skip-accuracy keeps the last
results' accuracy table.

    PYTHONPATH=. python benchmarks/kv_cache_dtype.py [--tokens 2048] [--reps 5] [--skip-accuracy] [--no-peer]
        [--peer-contexts 512,2048,8192]
writes benchmarks/results/kv_cache_dtype.{json,md}."""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

import sparkserve  # noqa: F401  (before torch: its OpenMP threads must be told to wait passively)

# isort: split
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from activation_quant import CHUNK, Runner, texts  # noqa: E402
from fresh_process import in_turns, run_json  # noqa: E402
from results_io import machine_line, sparkserve_kernels, write_results  # noqa: E402

from sparkserve import Engine  # noqa: E402
from sparkserve.core.req import Req  # noqa: E402
from sparkserve.core.sampling_state import RequestSamplingState  # noqa: E402
from sparkserve.embedded import default_model_path  # noqa: E402
from sparkserve.frontend.prepare import params_list  # noqa: E402
from sparkserve.frontend.tokenizer import load_tokenizer  # noqa: E402
from sparkserve.mem.kv_quant import is_quantized, kv_dtype, quantize, scale_component  # noqa: E402
from sparkserve.models.registry import load_config, load_model  # noqa: E402

DTYPES = ("float32", "float16", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2")     # accuracy, against float32
SPEED_DTYPES = ("float16", "int8")
LLAMA_TYPES = {"llama.cpp f16": "f16", "llama.cpp q8_0": "q8_0"}       # -ctk / -ctv
CONTEXTS = (512, 2048, 8192)
BATCH, NEW = 8, 32


def accuracy(max_tokens: int) -> dict:
    path = default_model_path()
    cfg = load_config(path)
    model = load_model(path, cfg, activation_quant="none")
    tok = load_tokenizer(path)
    runs = {d: Runner(model, cfg, max_tokens + CHUNK, kv_dtype(d)) for d in DTYPES}
    res = {}
    for name, docs in texts(8, 8).items():
        nll = dict.fromkeys(DTYPES, 0.0)
        stats = {d: {"max": 0.0, "sum": 0.0, "top1": 0} for d in DTYPES[1:]}
        count = rows = 0
        for doc in docs:
            ids = tok.encode(doc, add_special_tokens=True)[:max_tokens // len(docs) + 1]
            if len(ids) < 2:
                continue
            lg = {d: r.logits(ids) for d, r in runs.items()}
            for d in DTYPES:
                lp = torch.log_softmax(lg[d][:-1].double(), -1)
                nll[d] -= lp.gather(1, torch.tensor(ids[1:])[:, None]).sum().item()
            for d in DTYPES[1:]:
                diff = (lg[d] - lg["float32"]).abs()
                stats[d]["max"] = max(stats[d]["max"], diff.max().item())
                stats[d]["sum"] += diff.mean(-1).sum().item()
                stats[d]["top1"] += (lg[d].argmax(-1) == lg["float32"].argmax(-1)).sum().item()
            rows += len(ids)
            count += len(ids) - 1
        res[name] = {"docs": len(docs), "tokens": count,
                     "ppl": {d: math.exp(nll[d] / count) for d in DTYPES},
                     **{d: {"max_abs_logit_diff": s["max"], "mean_abs_logit_diff": s["sum"] / rows,
                            "top1_agree": s["top1"] / rows} for d, s in stats.items()}}
        print(name, res[name], flush=True)
    return res


def decode_time(eng: Engine, ctx: int, seed: int) -> float:
    """Seconds of NEW decode steps of BATCH requests whose (random) prompts fill a context of `ctx`
    tokens; the requests are freed after (their prefixes stay cached, never hit again)."""
    # the first new token comes with the prompt's rows (as from a prefill server): NEW decode steps
    params = params_list({"temperature": 0, "max_new_tokens": NEW + 1, "ignore_eos": True}, 1)[0]
    gen = torch.Generator().manual_seed(seed)
    reqs = []
    for b in range(BATCH):
        ids = torch.randint(1000, 40000, (ctx - NEW,), generator=gen).tolist()
        req = Req(f"r{seed}-{b}", ids, params, RequestSamplingState(params, ids, eng.scheduler.eos_ids),
                  output_ids=[ids[-1]])
        assert eng.scheduler.add_prebuilt(req, prompt_rows(eng, len(ids), gen))
        reqs.append(req)
    t = time.perf_counter()
    eng._run_to_completion([reqs])
    took = time.perf_counter() - t
    assert all(len(r.output_ids) == NEW + 1 for r in reqs)
    return took


def llama_batched_time(bench: str, ctx: int, cache_type: str, threads: int) -> float:
    """Seconds of llama-batched-bench's NEW decode steps of BATCH sequences, each with its own copy
    of one (ctx - NEW)-token prompt's cache, K and V of `cache_type`."""
    from results_io import peer_env
    cmd = [bench, "-m", default_model_path(), "-t", str(threads), "-c", str(BATCH * ctx), "-b", "2048",
           "-ub", "512", "-npp", str(ctx - NEW), "-ntg", str(NEW), "-npl", str(BATCH), "-pps", "-no-kvu",
           "-fa", "on", "-ctk", cache_type, "-ctv", cache_type, "--output-format", "jsonl"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=peer_env(), timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    rows = [line for line in r.stdout.splitlines() if line.startswith("{")]
    if not rows:
        raise RuntimeError(f"{' '.join(cmd)} printed no result:\n{r.stdout[-1000:]}\n{r.stderr[-3000:]}")
    row = json.loads(rows[-1])
    assert (row["pl"], row["tg"], row["is_pp_shared"]) == (BATCH, NEW, 1), row
    return float(row["t_tg"])


def speed_worker(reps: int, bench: str | None, llama_threads: int, peer_contexts: list[int]) -> dict:
    """Both pool dtypes' engines in this process and llama-batched-bench's two cache types, taking
    turns per context: {kind: {ctx: [seconds of the NEW batch-8 decode steps per round]}}. The
    prompts depend on (round, context) only, so both engines of sparkserve decode the same ones."""
    engines = {d: Engine(max_total_tokens=BATCH * (max(CONTEXTS) + NEW) + 64, max_running_requests=BATCH,
                         kv_cache_dtype=d) for d in SPEED_DTYPES}
    kinds = list(SPEED_DTYPES) + (list(LLAMA_TYPES) if bench else [])
    out: dict = {d: {str(c): [] for c in CONTEXTS} for d in kinds}
    for rep in range(reps):
        for ctx in CONTEXTS:
            here = [d for d in kinds if d in engines or ctx in peer_contexts]
            for d in in_turns(here, rep):
                out[d][str(ctx)].append(decode_time(engines[d], ctx, 1000 * rep + ctx) if d in engines else
                                        llama_batched_time(bench, ctx, LLAMA_TYPES[d], llama_threads))
            took = ", ".join(f"{d} {out[d][str(ctx)][-1]:.2f} s" for d in here)
            print(f"round {rep} context {ctx}: {took}", file=sys.stderr, flush=True)
    for eng in engines.values():
        eng.shutdown()
    return out


def prompt_rows(eng: Engine, n: int, gen: torch.Generator) -> dict:
    """Random K/V rows of an n-token prompt for every layer of the engine's pool, in its format
    (mem/transfer.py's keys: the quantized pool's elements and block scales)."""
    pool = eng.scheduler.runner.kv_pool
    rows = {}
    for layer in pool.owned:
        for name, buf in (("k", pool.k[layer]), ("v", pool.v[layer])):
            x = torch.randn(n, *buf.shape[1:], generator=gen)
            if is_quantized(pool.dtype):
                elems, scales = quantize(x, pool.dtype)
                rows[(0, name, layer)], rows[(0, scale_component(name, pool.dtype), layer)] = elems, scales
            else:
                rows[(0, name, layer)] = x.to(pool.dtype)
    return rows


def speed(reps: int, bench: str | None, llama_threads: int, peer_contexts: list[int]) -> dict:
    """Output tokens/s per context and kind (medians over `reps` rounds) and the int8 / float16
    speed ratio (median of the pairs' ratios; llama.cpp's q8_0 / f16 the same way), every engine
    in one fresh process (fresh_process.py)."""
    args = ["--worker", "--reps", str(reps), "--llama-threads", str(llama_threads),
            "--peer-contexts", ",".join(map(str, peer_contexts))]
    times = run_json(__file__, args + (["--llama-batched-bench", bench] if bench else []))
    out = {}
    for ctx in CONTEXTS:
        c = str(ctx)
        out[ctx] = {d: BATCH * NEW / statistics.median(times[d][c]) for d in SPEED_DTYPES}
        out[ctx]["ratios"] = [f / i for f, i in zip(times["float16"][c], times["int8"][c])]
        out[ctx]["ratio"] = statistics.median(out[ctx]["ratios"])
        line = ", ".join(f"{d} {out[ctx][d]:.0f} tok/s" for d in SPEED_DTYPES) + \
            f", int8 / float16 {out[ctx]['ratio']:.2f}x"
        if bench and ctx in peer_contexts:
            f16, q8 = (times[k][c] for k in LLAMA_TYPES)
            out[ctx].update({k: BATCH * NEW / statistics.median(times[k][c]) for k in LLAMA_TYPES})
            out[ctx]["llama_ratios"] = [f / q for f, q in zip(f16, q8)]
            out[ctx]["llama_ratio"] = statistics.median(out[ctx]["llama_ratios"])
            line += ", " + ", ".join(f"{k} {out[ctx][k]:.1f} tok/s" for k in LLAMA_TYPES) + \
                f", q8_0 / f16 {out[ctx]['llama_ratio']:.2f}x"
        print(f"context {ctx}: {line}", flush=True)
    return out


def last_accuracy() -> dict:
    """The accuracy table of the last results (--skip-accuracy keeps it)."""
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        with open(os.path.join(here, "results", "kv_cache_dtype.json")) as f:
            return json.load(f).get("accuracy", {})
    except (OSError, ValueError):
        return {}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of held-out text per corpus")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--skip-accuracy", action="store_true", help="keep the last results' accuracy table")
    ap.add_argument("--no-peer", action="store_true", help="leave llama.cpp out")
    ap.add_argument("--llama-threads", type=int, default=1)
    ap.add_argument("--peer-contexts", default=",".join(map(str, CONTEXTS)),
                    help="contexts llama.cpp runs at (comma-separated)")
    ap.add_argument("--llama-batched-bench", help=argparse.SUPPRESS)     # the worker's: the binary found
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    peer_contexts = [int(c) for c in args.peer_contexts.split(",") if c]
    if args.worker:
        times = speed_worker(args.reps, args.llama_batched_bench, args.llama_threads, peer_contexts)
        print(json.dumps(times))
        return
    bench = None
    if not args.no_peer:
        from peers.llamacpp import describe, tool
        bench = tool("llama-batched-bench")
    data = {"speed": speed(args.reps, bench and str(bench), args.llama_threads, peer_contexts),
            "accuracy": last_accuracy() if args.skip_accuracy else accuracy(args.tokens),
            "llama_batched_bench": bench and describe(bench)}
    lines = ["# KV pool dtype (SmolLM2-135M Q4_1)", "",
             f"{machine_line()}; sparkserve kernels: {sparkserve_kernels()}; "
             f"{torch.get_num_threads()} threads", "",
             f"Batch-{BATCH} decoding (int8 activations) at each context (the prompt's K/V written into the "
             f"pool, then {NEW} new tokens each), output tokens/s, medians of {args.reps} rounds, the two "
             f"engines in one process taking turns; the ratio: the median of the pairs' int8 / float16 "
             f"speed ratios (each pair seconds apart):",
             "", "| context | " + " | ".join(SPEED_DTYPES) + " | int8 / float16 | rounds |",
             "|---|" + "---|" * (len(SPEED_DTYPES) + 2)]
    for ctx, r in data["speed"].items():
        lines.append(f"| {ctx} | " + " | ".join(f"{r[d]:.0f}" for d in SPEED_DTYPES)
                     + f" | {r['ratio']:.2f}x | {', '.join(f'{x:.2f}' for x in r['ratios'])} |")
    if bench:
        lines += ["", f"llama.cpp in the same rounds, taking turns with the engines: "
                  f"{data['llama_batched_bench']}, `-t {args.llama_threads} -fa on -npl {BATCH} "
                  f"-npp CONTEXT-{NEW} -ntg {NEW} -pps -no-kvu` with `-ctk/-ctv f16` and `q8_0`: the same "
                  f"batch-{BATCH} decode (one prompt's cache copied into each sequence's own stream), output "
                  "tokens/s of the decode steps, medians; the ratio: the median of the pairs' q8_0 / f16 "
                  "speed ratios:", "",
                  "| context | f16 | q8_0 | q8_0 / f16 | rounds |", "|---|---|---|---|---|"]
        for ctx, r in data["speed"].items():
            if ctx not in peer_contexts:
                lines.append(f"| {ctx} | not run (--peer-contexts) | | | |")
                continue
            lines.append(f"| {ctx} | " + " | ".join(f"{r[k]:.1f}" for k in LLAMA_TYPES)
                         + f" | {r['llama_ratio']:.2f}x | "
                         + f"{', '.join(f'{x:.2f}' for x in r['llama_ratios'])} |")
    lines += ["", f"Accuracy: held-out text in chunks of {CHUNK} tokens, fp32 activations, each pool dtype "
              "against the float32 pool"
              + (" (from the last run with accuracy)." if args.skip_accuracy else "."),
              "",
              "| text | tokens | pool | max abs logit diff | mean abs logit diff | top-1 agree | "
              "ppl (float32 pool) |",
              "|---|---|---|---|---|---|---|"]
    for name, r in data["accuracy"].items():
        for d in DTYPES[1:]:
            lines.append(f"| {name} ({r['docs']} docs) | {r['tokens']} | {d} | "
                         f"{r[d]['max_abs_logit_diff']:.3f} | {r[d]['mean_abs_logit_diff']:.4f} | "
                         f"{r[d]['top1_agree']:.4f} | {r['ppl'][d]:.4f} ({r['ppl']['float32']:.4f}) |")
    write_results("kv_cache_dtype", data, lines)


if __name__ == "__main__":
    main()
