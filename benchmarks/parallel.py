"""Parallel layouts on this machine: TP=2, and PP=2 one batch at a time or with every step split
into 2 or 4 micro-batches however few its tokens, with 1 torch thread per rank, against one process
with 1 and 2 threads: batch-1 decode, batch-32 throughput and a prefill of 16 prompts of 128
tokens, on a random Llama of 0.2B parameters made for the run (SmolLM2's 9 heads do not split over
2 ranks). Also the payload the driver rank puts into collectives and sends per generated token,
counted (TP: two all-reduces of the hidden state per layer, the embedding's all-reduce, the batch
broadcast, the logits' hidden rows and vocab slices; PP: the broadcast and one hidden row per
micro-batch to the next stage). Honest about 2 cores: the layouts split the same arithmetic over
processes and add communication, so at best they match threads here; they pay where a rank has
cores or a device of its own. The step overhead over half the 1-thread step is what
docs/parallel-scaling.md builds its model from. The prefill shows where micro-batches pay
(compute-bound steps); a batch-32 decode step is bound by reading the weights, which each
micro-batch reads again (so by default a step splits only into micro-batches of 64 tokens or more).

Also the expert-parallel combine on 2 gloo ranks: one all-reduce of every token's partial output
(what layers/moe.py does, attention being replicated) against an all-to-all of the partial rows
followed by an all-gather of the summed halves (what a dispatch/combine layout pays).

MoE under DP attention (--only moe-a2a, benchmarks/parallel_moe.py): TP MoE against expert
parallel with an all-reduce or with all-to-all dispatch / combine, at 2 and 4 ranks.

DP attention vs plain TP (--only dp-attention): batch-32 decode and the 16 x 128 prefill in one
process with 2 threads, TP=2, and TP=2 with --dp-size 2 --enable-dp-attention (each rank its own
attention group: no attention all-reduces, each group attends and keeps KV for its own half of the
requests, but an all-gather of both groups' rows before every layer's MLP), 1 thread per rank; the
driver's payload and its collective calls (counted by wrapping torch.distributed in this process,
which is rank 0) per decode token / step, and whether the layouts' greedy tokens agree.

Context parallel prefill (--only cp-prefill): time to first token of one long prompt (--cp-tokens,
4096 by default, of English text: Python's pydoc topics) on the embedded SmolLM2 (context 8192),
max_new_tokens 1, greedy, radix cache off so every rep recomputes, in one process with 2 threads
against TP=2 with --attn-cp-size 2 (the prompt split by tokens over the 2 ranks, zigzag; K/V and
the MLP's rows gathered every layer), 1 thread per rank; at each of --cp-chunks (the default
chunked prefill of 512, and 4096: the prompt in one chunk). Also a short prompt (--cp-short
tokens), the fixed overhead; rank 0's payload per prompt token, and whether the first generated
token (and its log-probability) agrees between the layouts.

    python benchmarks/parallel.py [--reps 3] [--new-tokens 64]
        [--only layouts|ep-combine|dp-attention|cp-prefill|moe-a2a] [--cp-tokens 4096] [--cp-short 64]
        [--cp-chunks 512,4096] [--no-write]

Decode tokens/s = (N - 1) / (t(N tokens) - t(1 token)); medians of --reps, layouts alternating.
Writes benchmarks/results/parallel.{md,json} (with --only, replaces just that section of them;
--no-write only prints the tables, for trial runs)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
from parallel_moe import moe_a2a
from results_io import RESULTS, write_results

CONFIG = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
              num_key_value_heads=8, vocab_size=8192, max_position_embeddings=2048, tie_word_embeddings=True,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)

LAYOUTS = {"1 process, 1 thread": dict(num_threads=1), "1 process, 2 threads": dict(num_threads=2),
           "TP=2, 1 thread per rank": dict(tp_size=2, num_threads=1),
           "PP=2, one batch at a time": dict(pp_size=2, pp_micro_batches=1, num_threads=1),
           "PP=2, 2 micro-batches": dict(pp_size=2, pp_micro_batch_min_tokens=1, num_threads=1),
           "PP=2, 4 micro-batches": dict(pp_size=2, pp_micro_batches=4, pp_micro_batch_min_tokens=1,
                                         num_threads=1)}
PREFILL = (16, 128)      # prompts x tokens, one new token: compute-bound, where micro-batches pay
IDEAL = {"TP=2, 1 thread per rank": 0.5, "PP=2, one batch at a time": 1.0}   # of the 1-thread step


def make_model(path: str) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **CONFIG),
                                     dtype=torch.float32).save_pretrained(path)
    return path


def timed(engine, batch: int, new: int, prompt_len: int = 32) -> float:
    prompts = [[(7 * i + j) % 8000 + 5 for j in range(prompt_len)] for i in range(batch)]
    t = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": new,
                                                        "ignore_eos": True})
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--only", choices=SECTIONS, help="run one section; the others' results are kept")
    ap.add_argument("--cp-tokens", type=int, default=4096, help="cp-prefill: tokens of the long prompt")
    ap.add_argument("--cp-short", type=int, default=64, help="cp-prefill: tokens of the short prompt")
    ap.add_argument("--cp-chunks", type=lambda v: [int(x) for x in v.split(",")], default=[512, 4096],
                    help="cp-prefill: comma-separated --chunked-prefill-size values")
    ap.add_argument("--moe-max-ranks", type=int, default=4, help="moe-a2a: 2 ranks, and 4 unless this is 2")
    ap.add_argument("--no-write", action="store_true", help="print the tables; leave results/ alone")
    a = ap.parse_args()
    own_model = a.only not in ("ep-combine", "cp-prefill", "moe-a2a")
    path = make_model(tempfile.mkdtemp(prefix="parallel-bench-")) if own_model else ""
    if a.only:
        data, lines = SECTIONS[a.only](path, a)
        if a.no_write:
            print("\n".join(lines))
        else:
            write_section(data, lines)
        return 0
    data, lines = layouts(path, a)
    for run in (ep_combine, dp_attention, cp_prefill, moe_a2a):
        more, more_lines = run(path, a)
        data.update(more)
        lines += more_lines
    if a.no_write:
        print("\n".join(lines))
    else:
        write_results("parallel", data, lines)
    return 0


def layouts(path: str, a) -> tuple[dict, list[str]]:
    from sparkserve import Engine
    from sparkserve.distributed import parallel_state as ps
    res: dict = {k: {m: [] for m in ("decode", "batch32", "prefill", "bytes1", "bytes32")} for k in LAYOUTS}
    for _ in range(a.reps):              # layouts alternate; one parallel engine per process at a time
        for name, kw in LAYOUTS.items():
            with Engine(path, max_total_tokens=32 * 128, **kw) as eng:
                timed(eng, 1, 4)                                   # warm-up
                b0 = ps.sent_bytes()
                one = timed(eng, 1, 1)
                b1 = ps.sent_bytes()
                full = timed(eng, 1, a.new_tokens)
                b2 = ps.sent_bytes()
                res[name]["decode"].append((a.new_tokens - 1) / (full - one))
                res[name]["bytes1"].append(((b2 - b1) - (b1 - b0)) / (a.new_tokens - 1))
                res[name]["batch32"].append(32 * a.new_tokens / timed(eng, 32, a.new_tokens))
                res[name]["bytes32"].append((ps.sent_bytes() - b2) / (32 * a.new_tokens))
                res[name]["prefill"].append(PREFILL[0] * PREFILL[1] / timed(eng, PREFILL[0], 1, PREFILL[1]))
    return {"config": CONFIG, "new_tokens": a.new_tokens, "results": res}, table(res, a)


def ep_combine(path: str, a) -> tuple[dict, list[str]]:
    combine = collective_costs(a.reps)
    return {"ep_combine_ms": combine}, combine_table(combine, a)


# ---- DP attention vs plain TP -----------------------------------------------------------------
DP_LAYOUTS = {"(a) 1 process, 2 threads": dict(num_threads=2),
              "(b) TP=2, 1 thread per rank": dict(tp_size=2, num_threads=1),
              "(c) TP=2 DP=2 DP attention, 1 thread per rank": dict(tp_size=2, dp_size=2,
                                                                     enable_dp_attention=True, num_threads=1)}
COLLECTIVES = ("all_reduce", "all_gather", "broadcast", "gather", "gather_object", "isend", "recv")


def counting_collectives(calls: list[int]):
    """Wrap torch.distributed's collectives (as parallel_state calls them) to count this
    process's calls in calls[0]; returns a function that undoes it."""
    import torch.distributed as dist
    saved = {n: getattr(dist, n) for n in COLLECTIVES}

    def wrap(fn):
        def counted(*args, **kw):
            calls[0] += 1
            return fn(*args, **kw)
        return counted
    for n, fn in saved.items():
        setattr(dist, n, wrap(fn))
    return lambda: [setattr(dist, n, fn) for n, fn in saved.items()]


def generated(engine, batch: int, new: int, prompt_len: int, salt: int) -> tuple[float, list[list[int]]]:
    """Seconds and output ids of a greedy batch; a distinct salt gives prompts that share no
    prefix with other salts' (so no run reads another's prefix cache)."""
    prompts = [[(7 * i + j + 1000 * salt) % 8000 + 5 for j in range(prompt_len)] for i in range(batch)]
    t = time.perf_counter()
    out = engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": new,
                                                              "ignore_eos": True})
    return time.perf_counter() - t, [o["output_ids"] for o in out]


def dp_attention(path: str, a) -> tuple[dict, list[str]]:
    from sparkserve import Engine
    from sparkserve.distributed import parallel_state as ps
    n, load = a.new_tokens, [os.getloadavg()[0]]
    res = {k: {m: [] for m in ("decode", "prefill", "bytes", "calls", "prefill_bytes")} for k in DP_LAYOUTS}
    tokens: dict = {}
    calls = [0]
    undo = counting_collectives(calls)
    try:
        for _ in range(a.reps):
            for name, kw in DP_LAYOUTS.items():
                with Engine(path, max_total_tokens=32 * 128, **kw) as eng:
                    generated(eng, 2, 4, 32, 0)                                 # warm-up, both groups
                    b0, c0 = ps.sent_bytes(), calls[0]
                    one, _ = generated(eng, 32, 1, 32, 1)
                    b1, c1 = ps.sent_bytes(), calls[0]
                    full, ids = generated(eng, 32, n, 32, 2)
                    b2, c2 = ps.sent_bytes(), calls[0]
                    pre, pre_ids = generated(eng, PREFILL[0], 1, PREFILL[1], 3)
                    r = res[name]
                    r["decode"].append(32 * (n - 1) / (full - one))
                    r["bytes"].append(((b2 - b1) - (b1 - b0)) / (32 * (n - 1)))
                    r["calls"].append(((c2 - c1) - (c1 - c0)) / (n - 1))
                    r["prefill"].append(PREFILL[0] * PREFILL[1] / pre)
                    r["prefill_bytes"].append((ps.sent_bytes() - b2) / (PREFILL[0] * PREFILL[1]))
                    tokens.setdefault(name, (ids, pre_ids))
    finally:
        undo()
    load.append(os.getloadavg()[0])
    ref = tokens["(a) 1 process, 2 threads"]
    same = {k: sum(x == y for x, y in zip(t[0] + t[1], ref[0] + ref[1])) for k, t in tokens.items()}
    return ({"dp_attention": {"new_tokens": n, "reps": a.reps, "results": res, "same_greedy": same,
                              "sequences": 32 + PREFILL[0], "loadavg_1min": load}},
            dp_table(res, same, 32 + PREFILL[0], load, a))


def dp_table(res: dict, same: dict, seqs: int, load: list[float], a) -> list[str]:
    med = {k: {m: statistics.median(v) for m, v in r.items()} for k, r in res.items()}
    base, tp = med["(a) 1 process, 2 threads"], med["(b) TP=2, 1 thread per rank"]

    def spread(name: str, m: str, fmt: str) -> str:
        return f"{med[name][m]:{fmt}} ({min(res[name][m]):.0f}-{max(res[name][m]):.0f})"
    lines = ["", f"## DP attention vs plain TP (same model; {os.cpu_count()} cores)", "",
             f"Batch 32, prompts of 32 tokens, {a.new_tokens} new tokens, greedy: decode tokens/s = "
             "32 (N - 1) / (t(N) - t(1)); prefill: 16 prompts of 128 tokens, 1 new token, prompt "
             f"tokens/s. Medians of {a.reps}, layouts alternating; 1-minute load average "
             f"{load[0]:.2f} before, {load[1]:.2f} after. Sent = payload rank 0 puts into collectives per "
             "decode token (difference of the N- and 1-token runs) / per prefill prompt token; tok/s in "
             "brackets: the runs' min-max; "
             "collectives = rank 0's torch.distributed calls per decode step; same tokens = greedy "
             f"sequences (of {seqs}, first rep) equal to (a)'s.", "",
             "| layout | decode tok/s | vs (a) | vs (b) | prefill tok/s | vs (a) | vs (b) | sent per decode "
             "token | sent per prefill token | collectives per decode step | same tokens as (a) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in med.items():
        sent = [f"{m[k] / 1024:.1f} KiB" if m["bytes"] else "" for k in ("bytes", "prefill_bytes")]
        calls = f"{m['calls']:.0f}" if m["calls"] else ""
        lines.append(f"| {name} | {spread(name, 'decode', '.1f')} | {m['decode'] / base['decode']:.2f}x | "
                     f"{m['decode'] / tp['decode']:.2f}x | {spread(name, 'prefill', '.0f')} | "
                     f"{m['prefill'] / base['prefill']:.2f}x | {m['prefill'] / tp['prefill']:.2f}x | "
                     f"{sent[0]} | {sent[1]} | {calls} | {same[name]}/{seqs} |")
    return lines


# ---- context parallel prefill -----------------------------------------------------------------
CP_LAYOUTS = {"(a) 1 process, 2 threads": dict(num_threads=2),
              "(b) TP=2 CP=2, 1 thread per rank": dict(tp_size=2, attn_cp_size=2, num_threads=1)}


def cp_prompt(tokens: int) -> list[int]:
    """The first `tokens` ids of English text that ships with Python (pydoc's topics), under the
    embedded model's tokenizer: a prompt the model reads as text, the same on every run."""
    from pydoc_data.topics import topics

    from sparkserve.args import ServerArgs
    from sparkserve.frontend.tokenizer import load_tokenizer_for
    text = "\n\n".join(topics[k] for k in sorted(topics))
    tokenizer = load_tokenizer_for(ServerArgs())
    ids = tokenizer.encode(text[:12 * tokens])
    if len(ids) < tokens:
        ids = tokenizer.encode(text)
    assert len(ids) >= tokens, f"pydoc topics give {len(ids)} tokens, fewer than {tokens}"
    return ids[:tokens]


def first_token(engine, prompt: list[int]) -> tuple[float, int, float, float, int]:
    """Seconds to the first (only) token of a greedy request, that token, its log-probability,
    its margin over the runner-up's, and the prompt tokens the prefix cache served (0 here)."""
    t = time.perf_counter()
    out = engine.generate(input_ids=prompt, sampling_params={
        "temperature": 0, "max_new_tokens": 1, "ignore_eos": True, "return_logprob": True,
        "top_logprobs_num": 2})
    sec = time.perf_counter() - t
    meta = out["meta_info"]
    top = meta["output_top_logprobs"][0]
    return (sec, out["output_ids"][0], meta["output_token_logprobs"][0][0], top[0][0] - top[1][0],
            meta.get("cached_tokens", 0))


def cp_prefill(path: str, a) -> tuple[dict, list[str]]:
    from sparkserve import Engine
    from sparkserve.distributed import parallel_state as ps
    long, short = cp_prompt(a.cp_tokens), cp_prompt(a.cp_short)
    keys = ("ttft", "short", "bytes", "short_bytes", "token", "logprob", "margin", "short_token", "cached")
    res = {c: {k: {m: [] for m in keys} for k in CP_LAYOUTS} for c in a.cp_chunks}
    load, start = [os.getloadavg()[0]], time.perf_counter()
    for _ in range(a.reps):                  # layouts alternate; one parallel engine at a time
        for chunk in a.cp_chunks:
            for name, kw in CP_LAYOUTS.items():
                with Engine(chunked_prefill_size=chunk, disable_radix_cache=True,
                            max_total_tokens=a.cp_tokens + a.cp_short + 64, **kw) as eng:
                    assert eng.context_length > a.cp_tokens, \
                        f"context length {eng.context_length}: too short for {a.cp_tokens} tokens"
                    first_token(eng, short)                                    # warm-up
                    r = res[chunk][name]
                    b0 = ps.sent_bytes()
                    sec, tok, _, _, cached = first_token(eng, short)
                    b1 = ps.sent_bytes()
                    r["short"].append(sec)
                    r["short_token"].append(tok)
                    r["short_bytes"].append((b1 - b0) / a.cp_short)
                    sec, tok, lp, margin, cached_long = first_token(eng, long)
                    r["ttft"].append(sec)
                    r["bytes"].append((ps.sent_bytes() - b1) / a.cp_tokens)
                    r["token"].append(tok)
                    r["logprob"].append(lp)
                    r["margin"].append(margin)
                    r["cached"].append(cached + cached_long)
    load.append(os.getloadavg()[0])
    wall = time.perf_counter() - start
    return ({"cp_prefill": {"model": "embedded SmolLM2-135M-Instruct (Q4_1 GGUF)",
                            "prompt_tokens": a.cp_tokens, "short_tokens": a.cp_short, "reps": a.reps,
                            "results": {str(c): r for c, r in res.items()},
                            "loadavg_1min": load, "wall_s": wall}},
            cp_table(res, load, wall, a))


def cp_table(res: dict, load: list[float], wall: float, a) -> list[str]:
    base_name = next(iter(CP_LAYOUTS))
    lines = ["", f"## Context parallel prefill, embedded SmolLM2 ({os.cpu_count()} cores)", "",
             f"Time to first token of one prompt of {a.cp_tokens} tokens (English text: pydoc topics) and "
             f"of one of {a.cp_short} (the fixed overhead), max_new_tokens 1, greedy, radix cache off (every "
             f"rep recomputes the prompt), after a warm-up request; seconds, medians of {a.reps} with the "
             "runs' min-max, layouts alternating (a fresh engine each). Speed-up = TTFT (a) / TTFT (b) at "
             "the same chunked prefill size. Sent = payload rank 0 puts into collectives per prompt token "
             "(its K/V rows and MLP input rows gathered, and the MLP output all-reduced, every layer). "
             "Same first token: (b)'s generated token equal to (a)'s in every rep (log-probability "
             f"of (a)'s token, and its margin over the runner-up, in brackets). 1-minute load average "
             f"{load[0]:.2f} before, {load[1]:.2f} after; the section took {wall / 60:.1f} minutes.", "",
             f"| chunked prefill | layout | TTFT {a.cp_tokens} tokens (s) | speed-up | prompt tok/s | "
             f"TTFT {a.cp_short} tokens (s) | speed-up | sent per prompt token ({a.cp_tokens} / "
             f"{a.cp_short}) | same first token as (a) |",
             "|---|---|---|---|---|---|---|---|---|"]

    def spread(v: list[float]) -> str:
        return f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})"
    for chunk, by in res.items():
        base = by[base_name]
        for name, r in by.items():
            if name == base_name:
                same = (f"(logprob {statistics.median(r['logprob']):.3f}, margin "
                        f"{statistics.median(r['margin']):.3f})")
            else:
                same = ("yes" if r["token"] == base["token"] and r["short_token"] == base["short_token"]
                        else f"no: {r['token']} / {r['short_token']} vs {base['token']} / "
                             f"{base['short_token']}")
                same += f" (logprob {statistics.median(r['logprob']):.3f})"
            if any(r["cached"]):
                same += f"; prefix cache served {max(r['cached'])} tokens"
            kib = [statistics.median(r[k]) / 1024 for k in ("bytes", "short_bytes")]
            sent = f"{kib[0]:.1f} / {kib[1]:.1f} KiB" if kib[0] else ""
            ttft, ttft_short = statistics.median(r["ttft"]), statistics.median(r["short"])
            lines.append(f"| {chunk} | {name} | {spread(r['ttft'])} | "
                         f"{statistics.median(base['ttft']) / ttft:.2f}x | {a.cp_tokens / ttft:.0f} | "
                         f"{spread(r['short'])} | {statistics.median(base['short']) / ttft_short:.2f}x | "
                         f"{sent} | {same} |")
    return lines


SECTIONS = {"layouts": layouts, "ep-combine": ep_combine, "dp-attention": dp_attention,
            "cp-prefill": cp_prefill, "moe-a2a": moe_a2a}


def write_section(data: dict, lines: list[str]) -> None:
    """Put one section's results into parallel.{json,md}, keeping the others': its keys replace
    theirs, its heading's block (to the next heading) replaces the old one, or is appended."""
    jpath, mpath = (os.path.join(RESULTS, f"parallel.{ext}") for ext in ("json", "md"))
    old = json.load(open(jpath)) if os.path.exists(jpath) else {}
    md = open(mpath).read().rstrip("\n").split("\n") if os.path.exists(mpath) else []
    head = next(line for line in lines if line.startswith("#"))
    if head.split("(")[0] in [m.split("(")[0] for m in md]:
        start = [m.split("(")[0] for m in md].index(head.split("(")[0])
        end = next((i for i in range(start + 1, len(md)) if md[i].startswith("#")), len(md))
        while start > 0 and not md[start - 1]:
            start -= 1
        md = md[:start] + lines + ([""] if end < len(md) else []) + md[end:]
    else:
        md += lines
    write_results("parallel", {**old, **data}, md)


ROWS = (1, 32, 256)


def _combine_rank(rank: int, port: int, reps: int, out) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    d = CONFIG["hidden_size"]
    times = {}
    for rows in ROWS:
        x = torch.randn(rows * 2, d)          # every token's partial output (even rows: splittable)

        def all_reduce():
            dist.all_reduce(x.clone())

        def all_to_all_gather():               # each rank sums half the rows, then all gather them
            recv = torch.empty_like(x)
            dist.all_to_all_single(recv, x.clone())
            half = recv.view(2, rows, d).sum(0)
            dist.all_gather_single(torch.empty(2 * rows, d), half)
        for name, fn in (("all-reduce", all_reduce), ("all-to-all + all-gather", all_to_all_gather)):
            fn()
            dist.barrier()
            t = time.perf_counter()
            for _ in range(20 * reps):
                fn()
            times[(name, rows * 2)] = (time.perf_counter() - t) / (20 * reps) * 1e3
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def collective_costs(reps: int) -> dict:
    """Milliseconds per combine of [rows, hidden] partial outputs on 2 gloo ranks."""
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_combine_rank, args=(r, port, reps, q)) for r in range(2)]
    for p in procs:
        p.start()
    times = q.get()
    for p in procs:
        p.join()
    return {f"{name} | {rows}": ms for (name, rows), ms in times.items()}


def combine_table(combine: dict, a) -> list[str]:
    lines = ["", "## Expert-parallel combine on 2 gloo ranks (ms per combine, hidden 1024, fp32)", "",
             "| tokens | all-reduce | all-to-all + all-gather |", "|---|---|---|"]
    for rows in ROWS:
        r = rows * 2
        ar, a2a = combine[f"all-reduce | {r}"], combine[f"all-to-all + all-gather | {r}"]
        lines.append(f"| {r} | {ar:.2f} | {a2a:.2f} |")
    return lines


def table(res: dict, a) -> list[str]:
    med = {k: {m: statistics.median(v) for m, v in r.items()} for k, r in res.items()}
    base, single = med["1 process, 2 threads"], med["1 process, 1 thread"]
    pp1 = med["PP=2, one batch at a time"]
    lines = ["# Parallel layouts on 2 cores, random Llama (hidden 1024, 12 layers, 16 heads, fp32)", "",
             f"{a.new_tokens} new tokens, greedy, prompts of 32 tokens, medians of {a.reps}; ratios against "
             "one process with 2 threads (and batch-32 against PP=2 one batch at a time); sent = payload "
             "the driver rank puts into collectives and sends per generated token (batch 1 decode / "
             "batch 32 incl. prefill); step overhead = decode step - its ideal (TP=2: half the 1-thread "
             "step; PP=2 one batch at a time: the 1-thread step, as the stages run in turn)", "",
             "| layout | batch-1 decode tok/s | vs 2 threads | batch-32 tok/s | vs 2 threads | vs PP=2 one "
             f"batch | prefill tok/s ({PREFILL[0]} x {PREFILL[1]}) | vs PP=2 one batch | sent per token "
             "b1 / b32 | step overhead (ms) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in med.items():
        ideal = IDEAL.get(name)
        over = f"{(1 / m['decode'] - ideal / single['decode']) * 1e3:.1f}" if ideal else ""
        sent = f"{m['bytes1'] / 1024:.1f} / {m['bytes32'] / 1024:.1f} KiB" if m["bytes1"] else ""
        vs_pp = f"{m['batch32'] / pp1['batch32']:.2f}x" if name.startswith("PP") else ""
        vs_pp_prefill = f"{m['prefill'] / pp1['prefill']:.2f}x" if name.startswith("PP") else ""
        lines.append(f"| {name} | {m['decode']:.1f} | {m['decode'] / base['decode']:.2f}x | "
                     f"{m['batch32']:.1f} | {m['batch32'] / base['batch32']:.2f}x | {vs_pp} | "
                     f"{m['prefill']:.0f} | {vs_pp_prefill} | {sent} | "
                     f"{over} |")
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
