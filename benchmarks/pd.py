"""Prefill/decode disaggregation (GitHub issue #19): how fast each transfer backend moves a
request's prompt state, and what a prefill server + a decode server behind `sparkserve router`
give a mixed load next to one colocated server.

Transfer (--only transfer): one request's prompt state of N tokens (--tokens, 1024 and 4096 by
default; pages of 1 token) in the embedded SmolLM2's KV pool (30 layers x K,V x 3 KV heads x 64
dims fp32: 45 KiB a token) of one `Engine()`, moved by a backend's prefill-side transfer object
(`prefill_transfer`) into another `Engine()`'s pool through its decode-side one
(`decode_transfer`), in one process over 127.0.0.1: the decode side reserves the room, the
prefill side's `send_rows` sends positions 0..N (with the request-row state, as its last chunk
does), and the clock stops when the decode side hears the room's rows are there (tcp: written by
the decode side; nixl/mooncake: written by the prefill side into the decode side's registered
memory, then the `rows` notice). Each rep checks every row arrived intact. Slots as a fresh pool
hands them out (contiguous: one run) and scattered (both pools' free pages shuffled: every token
a run of its own, one descriptor per token per buffer for the registered-memory backends).
Against the raw loopback figure of that backend in the same run: tcp, pyzmq PUSH/PULL of the
same byte count in 1 MB frames over tcp://127.0.0.1; nixl/mooncake, their own engine's write of
one contiguous registered buffer of that size. Every backend of --backends that imports here
runs; one that does not is skipped and the table says why. Medians of --reps after a warm-up;
--threads torch threads (1: as each server of the disaggregated pair below; on 2 shared cores,
2 threads make the row gathers and scatters of send_rows and of the tcp decode side wait on
descheduled OpenMP threads).

Serving (--only serving): streaming chat completions at concurrency 8 (--concurrency), greedy,
max_tokens 32 with ignore_eos, of a mixed load (--requests, every --long-every'th one a long
prompt of ~--long-tokens tokens of English text (Python's pydoc topics, each its own slice, so
no two share a prefix), the others short chats of ~30 tokens), and of the short chats alone
(the reference: what the short chats' inter-token latency is without long prompts), through
(a) one colocated `sparkserve serve --num-threads 2`, (b) `sparkserve serve
--disaggregation-mode prefill` + `--disaggregation-mode decode`, `--num-threads 1` each, behind
`sparkserve router`, and (c) (a) with `--enable-mixed-chunk` (running requests decode inside
prefill steps), each setup alone on the machine while measured. TTFT and ITL median and
p90 for the short chats and the long prompts separately, output tokens/s, and the KV bytes each
request's prompt state is (prompt tokens x the pool's bytes per token) and what moved (less the
prompt tokens the decode server's prefix cache held).

    python benchmarks/pd.py [--only transfer|serving] [--reps 5] [--tokens 1024,4096]
        [--backends tcp,nixl,mooncake] [--threads 1] [--requests 32] [--concurrency 8] [--long-every 4]
        [--long-tokens 1000] [--max-tokens 32] [--no-write]

Writes benchmarks/results/pd.{md,json} (with --only, replaces just that section; --no-write only
prints the tables, for trial runs)."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
from results_io import RESULTS, write_results

MB = 1 << 20


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=("transfer", "serving"),
                    help="run one section; the other's results are kept")
    ap.add_argument("--reps", type=int, default=5, help="transfer: timed moves per case (after a warm-up)")
    ap.add_argument("--tokens", type=lambda v: [int(x) for x in v.split(",")], default=[1024, 4096],
                    help="transfer: comma-separated prompt lengths")
    ap.add_argument("--backends", default="tcp,nixl,mooncake", help="transfer: comma-separated backends")
    ap.add_argument("--threads", type=int, default=1,
                    help="transfer: torch threads (the engines' --num-threads)")
    ap.add_argument("--requests", type=int, default=32, help="serving: requests of the mixed load")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--long-every", type=int, default=4, help="serving: every n-th request is a long prompt")
    ap.add_argument("--long-tokens", type=int, default=1000, help="serving: tokens of a long prompt's text")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--no-write", action="store_true", help="print the tables; leave results/ alone")
    a = ap.parse_args()
    start = time.perf_counter()
    old = {}
    if a.only and not a.no_write and os.path.exists(os.path.join(RESULTS, "pd.json")):
        with open(os.path.join(RESULTS, "pd.json")) as f:
            old = json.load(f)
    data = {**old, "machine": machine()}
    if a.only in (None, "transfer"):
        data["transfer"] = transfer(a)
    if a.only in (None, "serving"):
        data["serving"] = serving(a)
    cmd = "python benchmarks/pd.py " + shlex.join(sys.argv[1:])
    data.setdefault("commands", {})
    for section in ("transfer", "serving"):
        if a.only in (None, section):
            data["commands"][section] = {"command": cmd.strip(), "wall_s": data[section]["wall_s"],
                                         "run_wall_s": time.perf_counter() - start,
                                         "date": time.strftime("%Y-%m-%d %H:%M")}
    lines = tables(data)
    if a.no_write:
        print("\n".join(lines))
    else:
        write_results("pd", data, lines)
    print(f"\nwall time {time.perf_counter() - start:.0f} s")
    return 0


def machine() -> dict:
    model = ""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines()
                      if ln.startswith("Model name")), "")
    except OSError:
        pass
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((ln for ln in f if ln.startswith("flags")), ":").split(":", 1)[1].split())
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(), "avx512f": "avx512f" in flags, "avx2": "avx2" in flags,
            "torch": torch.__version__, "python": sys.version.split()[0]}


# ---- transfer throughput per backend ----------------------------------------------------------

def _token_buffers(sched) -> list[torch.Tensor]:
    return [t for pool in sched.pools() for c in pool.components() if c.kind != "request_row"
            for t in c.tensors]


def _reserve(sched, n: int, scattered: bool, seed: int):
    """A request of n prompt tokens holding a row and n slots in `sched`'s pools (nothing computed):
    slots as a fresh pool hands them out, or from a free list shuffled with `seed`."""
    from sparkserve.frontend.prepare import params_list
    from sparkserve.messages import GenerateReq
    from sparkserve.scheduler.req_outputs import req_from_message
    alloc = sched.cache.allocator
    assert alloc.free_slots == alloc.num_pages * alloc.page_size, "the pool holds a request already"
    pages = list(range(alloc.num_pages - 1, -1, -1))      # pop() gives page 0 first, as a fresh pool
    if scattered:
        random.Random(seed).shuffle(pages)
    alloc.free_pages = pages
    ids = [(7 * i + seed) % 8000 + 5 for i in range(n)]
    req = req_from_message(GenerateReq(f"pd-bench-{seed}", ids, params_list({"max_new_tokens": 1}, 1)[0]),
                           sched.eos_ids)
    assert sched.reserve_prebuilt(req) == 0
    return req


def _runs(a: torch.Tensor, b: torch.Tensor) -> int:
    """Runs of positions whose slots are consecutive on both sides."""
    if len(a) == 0:
        return 0
    step = (a[1:] == a[:-1] + 1) & (b[1:] == b[:-1] + 1)
    return int((~step).sum()) + 1


def _wait(cond, what: str, timeout: float = 60.0):
    end = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > end:
            raise TimeoutError(what)


class Skipped(Exception):
    """A backend that cannot run here (the reason)."""


def backend_moves(name: str, pe, de, a) -> dict:
    """Seconds per move of one request's prompt state, by (tokens, layout), through `name`."""
    from sparkserve.disaggregation.backend import (
        Arrived,
        Failed,
        Heard,
        Reservation,
        decode_transfer,
        prefill_transfer,
    )
    from sparkserve.messages import Bootstrap
    port = _free_port()
    try:
        pre = prefill_transfer(name, port)
    except ValueError as e:                 # its package is missing or does not load here
        raise Skipped(str(e)) from None
    try:
        dec = decode_transfer(name)
    except BaseException:
        pre.close()
        raise
    ps, ds = pe.scheduler, de.scheduler
    out = {}
    try:
        room = 100
        for n in a.tokens:
            for layout in ("contiguous", "scattered"):
                room += 1
                scattered = layout == "scattered"
                rp, rd = _reserve(ps, n, scattered, room), _reserve(ds, n, scattered, -room)
                src, dst = ps.request_rows(rp, n), ds.request_rows(rd, n)
                boot = Bootstrap("127.0.0.1", port, room)
                dec.reserve(boot, dst, 0)
                [res] = _wait(lambda: [e for e in pre.poll(10) if isinstance(e, Reservation)],
                              f"{name}: no reservation")

                def arrived():
                    for e in dec.poll(1):
                        if isinstance(e, Failed):
                            raise RuntimeError(f"{name}: {e.message}")
                        if isinstance(e, (Heard, Arrived)) and e.room == room:
                            return True
                    return False
                sbuf, dbuf = _token_buffers(ps), _token_buffers(ds)
                ss, dd = src.pages.slots, dst.pages.slots
                times = []
                for rep in range(a.reps + 1):               # the first connects, registers, warms up
                    for t in dbuf:
                        t[dd] = 0
                    t0 = time.perf_counter()
                    pre.send_rows(res, src, 0, last=True)
                    _wait(arrived, f"{name}: the rows did not arrive")
                    sec = time.perf_counter() - t0
                    bad = [i for i, (s, d) in enumerate(zip(sbuf, dbuf)) if not torch.equal(s[ss], d[dd])]
                    if bad:
                        raise RuntimeError(f"{name}: {len(bad)} buffers arrived wrong")
                    if rep:
                        times.append(sec)
                dec.cancel(boot, "benchmark done")
                _wait(lambda: pre.poll(10) or True, "")
                ps.cache.release(rp)
                ds.cache.release(rd)
                out[f"{n} | {layout}"] = {"tokens": n, "layout": layout, "runs": _runs(ss, dd),
                                          "buffers": len(sbuf), "seconds": times}
    finally:
        dec.close()
        pre.close()
    return out


def raw_zmq(nbytes: int, reps: int) -> list[float]:
    """pyzmq PUSH -> PULL over tcp://127.0.0.1, `nbytes` in 1 MB frames, one process."""
    import zmq
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    for s in (push, pull):
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.RCVHWM, 0)
        s.setsockopt(zmq.LINGER, 0)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).numpy()
    view = memoryview(buf)
    frames = [view[i:i + MB] for i in range(0, nbytes, MB)]
    times = []
    try:
        for rep in range(reps + 1):
            t0 = time.perf_counter()
            for f in frames:
                push.send(f, copy=False)
            got = sum(len(pull.recv(copy=False)) for _ in frames)
            sec = time.perf_counter() - t0
            assert got == nbytes
            if rep:
                times.append(sec)
    finally:
        push.close()
        pull.close()
        ctx.term()
    return times


def raw_nixl(nbytes: int, reps: int) -> list[float]:
    """Two NIXL agents (UCX) in one process: WRITE of one contiguous registered DRAM buffer."""
    from nixl._api import nixl_agent, nixl_agent_config
    tag = f"{os.getpid()}-{random.getrandbits(32):08x}"
    src_agent = nixl_agent(f"pd-bench-src-{tag}", nixl_agent_config(backends=["UCX"]))
    dst_agent = nixl_agent(f"pd-bench-dst-{tag}", nixl_agent_config(backends=["UCX"]))
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    regs = [(src_agent, src_agent.register_memory([(src.data_ptr(), nbytes, 0, "")], "DRAM")),
            (dst_agent, dst_agent.register_memory([(dst.data_ptr(), nbytes, 0, "")], "DRAM"))]
    remote = src_agent.add_remote_agent(dst_agent.get_agent_metadata())

    def descs(ptr: int) -> np.ndarray:
        return np.array([[ptr, nbytes, 0]], dtype=np.uint64)
    times = []
    try:
        for rep in range(reps + 1):
            dst.zero_()
            t0 = time.perf_counter()
            xfer = src_agent.initialize_xfer("WRITE", src_agent.get_xfer_descs(descs(src.data_ptr()), "DRAM"),
                                             src_agent.get_xfer_descs(descs(dst.data_ptr()), "DRAM"), remote)
            state = src_agent.transfer(xfer)
            while state == "PROC":
                state = src_agent.check_xfer_state(xfer)
            sec = time.perf_counter() - t0
            src_agent.release_xfer_handle(xfer)
            if state != "DONE":
                raise RuntimeError(f"nixl write state {state}")
            assert torch.equal(src, dst)
            if rep:
                times.append(sec)
    finally:
        src_agent.remove_remote_agent(remote)
        for agent, reg in regs:
            agent.deregister_memory(reg)
    return times


def raw_mooncake(nbytes: int, reps: int) -> list[float]:
    """Two Mooncake TransferEngines (TCP protocol, P2P handshake) in one process: a synchronous
    write of one contiguous registered buffer."""
    from mooncake.engine import TransferEngine
    engines = []
    for _ in range(2):
        e = TransferEngine()
        if e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("the mooncake transfer engine did not start")
        engines.append(e)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    for e, t in zip(engines, (src, dst)):
        if e.register_memory(t.data_ptr(), nbytes) != 0:
            raise RuntimeError("mooncake could not register the buffer")
    session = f"127.0.0.1:{engines[1].get_rpc_port()}"
    times = []
    try:
        for rep in range(reps + 1):
            dst.zero_()
            t0 = time.perf_counter()
            ret = engines[0].batch_transfer_sync_write(session, [src.data_ptr()], [dst.data_ptr()], [nbytes])
            sec = time.perf_counter() - t0
            if ret != 0:
                raise RuntimeError(f"mooncake write returned {ret}")
            assert torch.equal(src, dst)
            if rep:
                times.append(sec)
    finally:
        for e, t in zip(engines, (src, dst)):
            e.unregister_memory(t.data_ptr())
    return times


RAW = {"tcp": ("pyzmq PUSH/PULL, 1 MB frames", raw_zmq), "nixl": ("NIXL UCX WRITE, one buffer", raw_nixl),
       "mooncake": ("Mooncake TCP write, one buffer", raw_mooncake)}


def transfer(a) -> dict:
    from sparkserve import Engine
    start = time.perf_counter()
    kw = dict(max_total_tokens=max(a.tokens) + 64, disable_radix_cache=True, num_threads=a.threads)
    load = [os.getloadavg()[0]]
    with Engine(**kw) as pe, Engine(**kw) as de:
        for t in _token_buffers(pe.scheduler):
            t.normal_()
        bytes_per_token = sum(t[0].nbytes for t in _token_buffers(pe.scheduler))
        model = os.path.basename(pe.args.model_path)
        backends: dict = {}
        for name in a.backends.split(","):
            entry: dict = {"raw_kind": RAW[name][0]}
            try:
                entry["moves"] = backend_moves(name, pe, de, a)
            except Skipped as e:
                backends[name] = {"skipped": str(e)}
                print(f"{name}: skipped: {e}", flush=True)
                continue
            except Exception as e:          # noqa: BLE001  (a backend's failure is a result)
                entry["error"] = f"{type(e).__name__}: {e}"
            entry["raw"] = {}
            for n in a.tokens:
                try:
                    entry["raw"][str(n)] = RAW[name][1](n * bytes_per_token, a.reps)
                except Exception as e:      # noqa: BLE001
                    entry.setdefault("raw_error", f"{type(e).__name__}: {e}")
            backends[name] = entry
            print(f"{name}: done", flush=True)
    load.append(os.getloadavg()[0])
    return {"model": model, "bytes_per_token": bytes_per_token, "tokens": a.tokens, "reps": a.reps,
            "threads": a.threads, "backends": backends, "loadavg_1min": load,
            "wall_s": time.perf_counter() - start}


def transfer_table(t: dict) -> list[str]:
    bpt = t["bytes_per_token"]
    lines = ["", f"## Transfer throughput per backend ({t['model']}, {bpt} bytes a token)", "",
             f"One request's prompt state (K and V of every layer, pages of 1 token) from a prefill-side "
             "transfer object to a decode-side one in one process over 127.0.0.1, until the decode side "
             "hears every row is written (each rep checked intact); contiguous = slots as a fresh pool "
             "gives them, scattered = both pools' free pages shuffled (runs = runs of slots consecutive on "
             "both sides: descriptors per buffer for nixl/mooncake). Raw = that backend's own loopback "
             f"figure for the same bytes in the same run. Medians of {t['reps']} after a warm-up; MB = "
             f"10^6 bytes; in brackets the runs' min-max MB/s. torch threads {t['threads']} (as each server "
             "of the disaggregated pair below); 1-minute load average "
             + ", ".join(f"{x:.2f}" for x in t["loadavg_1min"]) + " (before, after).", "",
             "Backends that ran: "
             + (", ".join(k for k, e in t["backends"].items() if "moves" in e) or "none")
             + "; skipped (not importable here, the reason in its row): "
             + (", ".join(k for k, e in t["backends"].items() if "skipped" in e) or "none") + ".", "",
             "| backend | tokens | MB | slots | runs x buffers | ms | MB/s | pages/s | raw MB/s | of raw |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, e in t["backends"].items():
        if "skipped" in e:
            lines.append(f"| {name} | skipped: {e['skipped']} |  |  |  |  |  |  |  |  |")
            continue
        if "error" in e:
            lines.append(f"| {name} | failed: {e['error']} |  |  |  |  |  |  |  |  |")
        for m in e.get("moves", {}).values():
            n, mb = m["tokens"], m["tokens"] * bpt / 1e6
            sec = statistics.median(m["seconds"])
            raw = e["raw"].get(str(n))
            raw_rate = mb / statistics.median(raw) if raw else None
            spread = f"{mb / max(m['seconds']):.0f}-{mb / min(m['seconds']):.0f}"
            lines.append(f"| {name} | {n} | {mb:.1f} | {m['layout']} | {m['runs']} x {m['buffers']} | "
                         f"{sec * 1e3:.1f} | {mb / sec:.0f} ({spread}) | {n / sec:,.0f} | "
                         + (f"{raw_rate:.0f} ({e['raw_kind']}) | {mb / sec / raw_rate:.2f} |" if raw_rate
                            else f"{e.get('raw_error', '')} |  |"))
    return lines


# ---- TTFT and ITL, disaggregated vs colocated -------------------------------------------------

TOPICS = ["the ocean", "a city at night", "learning to code", "the moon", "autumn leaves", "trains",
          "friendship", "coffee", "mountains", "a thunderstorm", "libraries", "gardening", "robots",
          "the desert", "music", "winter mornings"]
ASKS = ["Write a short paragraph about {}.", "Tell me something interesting about {}.",
        "Describe {} in a few sentences.", "What do people love about {}?"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def long_texts(count: int, tokens: int) -> list[str]:
    """`count` texts of about `tokens` tokens each under the embedded model's tokenizer: slices of
    Python's pydoc topics one after another (no two share a prefix)."""
    from pydoc_data.topics import topics

    from sparkserve.args import ServerArgs
    from sparkserve.frontend.tokenizer import load_tokenizer_for
    text = "\n\n".join(topics[k] for k in sorted(topics))
    tok = load_tokenizer_for(ServerArgs())
    ids = tok.encode(text[:6 * tokens * count])
    assert len(ids) >= tokens * count, f"pydoc topics give {len(ids)} tokens, fewer than {tokens * count}"
    return [tok.decode(ids[i * tokens:(i + 1) * tokens]).strip() + "\n\nSummarize the text above."
            for i in range(count)]


def loads(a) -> dict[str, list[tuple[str, str]]]:
    """(kind, prompt) per request: the mixed load, and its short chats alone (other words, so
    neither load finds the other's prompts in a prefix cache). One more long and short text are
    kept for the warm-up."""
    n_long = sum(1 for i in range(a.requests) if i % a.long_every == 1 % a.long_every)
    texts = long_texts(n_long + 1, a.long_tokens)
    shorts = [ask.format(topic) for ask in ASKS for topic in TOPICS]
    mixed, k, li = [], 0, 0
    for i in range(a.requests):
        if i % a.long_every == 1 % a.long_every:
            mixed.append(("long", texts[li]))
            li += 1
        else:
            mixed.append(("short", shorts[k % len(shorts)]))
            k += 1
    n_short = a.requests - n_long
    alone = [("short", shorts[(k + j) % len(shorts)] + " Be brief.") for j in range(n_short)]
    warm = [("short", "Say hello."), ("long", texts[-1])]
    return {"warm-up": warm, "short chats alone": alone, "mixed": mixed}


async def _one(client, base: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": "default", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps, usage = [], None
    async with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices", []):
                if c.get("delta", {}).get("content"):
                    stamps.append(time.perf_counter())
    t1 = time.perf_counter()
    usage = usage or {}
    return {"ttft": stamps[0] - t0 if stamps else t1 - t0, "e2e": t1 - t0,
            "tokens": usage.get("completion_tokens") or len(stamps),
            "prompt_tokens": usage.get("prompt_tokens", 0),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "itl": [b - x for x, b in zip(stamps, stamps[1:])]}


async def _load(base: str, reqs: list[tuple[str, str]], conc: int, max_tokens: int) -> dict:
    import httpx
    sem = asyncio.Semaphore(conc)
    async with httpx.AsyncClient(timeout=600) as client:
        async def run(kind, prompt):
            async with sem:
                return {"kind": kind, **await _one(client, base, prompt, max_tokens)}
        t = time.perf_counter()
        res = await asyncio.gather(*(run(k, p) for k, p in reqs))
        wall = time.perf_counter() - t
    return {"wall_s": wall, "requests": res, "output_tok_s": sum(r["tokens"] for r in res) / wall}


def _p90(v: list[float]) -> float:
    return statistics.quantiles(v, n=10, method="inclusive")[8] if len(v) > 1 else v[0]


def summarize(load: dict, bytes_per_token: int) -> dict:
    out = {"wall_s": load["wall_s"], "output_tok_s": load["output_tok_s"], "requests": len(load["requests"])}
    for kind in ("short", "long"):
        rs = [r for r in load["requests"] if r["kind"] == kind]
        if not rs:
            continue
        ttft, itl = [r["ttft"] for r in rs], [x for r in rs for x in r["itl"]]
        out[kind] = {"n": len(rs), "ttft_median_s": statistics.median(ttft), "ttft_p90_s": _p90(ttft),
                     "itl_median_ms": 1e3 * statistics.median(itl), "itl_p90_ms": 1e3 * _p90(itl),
                     "itl_p99_ms": 1e3 * statistics.quantiles(itl, n=100, method="inclusive")[98],
                     "itl_max_ms": 1e3 * max(itl),
                     "prompt_tokens_median": statistics.median(r["prompt_tokens"] for r in rs),
                     "kv_bytes_median": bytes_per_token * statistics.median(r["prompt_tokens"] for r in rs),
                     "kv_moved_bytes_median": bytes_per_token * statistics.median(
                         r["prompt_tokens"] - r["cached_tokens"] for r in rs),
                     "completion_tokens": sum(r["tokens"] for r in rs)}
    return out


class Servers:
    """Server processes, their logs in a temporary folder (the tail shown when one fails)."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen, str]] = []
        self.dir = tempfile.mkdtemp(prefix="pd-bench-")

    def start(self, name: str, args: list[str], threads: int | None = None) -> str:
        log = os.path.join(self.dir, f"{name}.log")
        env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
        with open(log, "w") as f:
            proc = subprocess.Popen([sys.executable, "-m", "sparkserve.cli", *args], stdout=f,
                                    stderr=subprocess.STDOUT, env=env)
        self.procs.append((name, proc, log))
        return "sparkserve " + shlex.join(args)

    def wait_ready(self, base: str, path: str = "/v1/models", timeout: float = 300) -> None:
        import httpx
        end = time.time() + timeout
        while time.time() < end:
            for name, proc, log in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.tail(log)}")
            try:
                if httpx.get(base + path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"{base} did not come up")

    @staticmethod
    def tail(log: str) -> str:
        with open(log) as f:
            return "".join(f.readlines()[-30:])

    def stop(self) -> None:
        for _, proc, _ in reversed(self.procs):
            proc.terminate()
        for _, proc, _ in reversed(self.procs):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = []


def _setup(kind: str, srv: Servers) -> tuple[str, list[str]]:
    """Start a setup; its base URL and the commands that started it."""
    common = ["--log-level", "warning"]
    if kind.startswith("colocated"):
        port = _free_port()
        mixed = ["--enable-mixed-chunk"] if kind == "colocated_mixed" else []
        cmds = [srv.start(kind, ["serve", "--port", str(port), "--num-threads", "2", *mixed, *common], 2)]
        base = f"http://127.0.0.1:{port}"
        srv.wait_ready(base)
        return base, cmds
    pport, dport, rport, boot = _free_port(), _free_port(), _free_port(), _free_port()
    one = ["--num-threads", "1", "--disaggregation-mode"]
    cmds = [srv.start("prefill", ["serve", "--port", str(pport), *one, "prefill",
                                  "--disaggregation-bootstrap-port", str(boot), *common], 1),
            srv.start("decode", ["serve", "--port", str(dport), *one, "decode", *common], 1)]
    srv.wait_ready(f"http://127.0.0.1:{pport}")
    srv.wait_ready(f"http://127.0.0.1:{dport}")
    cmds.append(srv.start("router", ["router", "--prefill", f"http://127.0.0.1:{pport}", str(boot),
                                     "--decode", f"http://127.0.0.1:{dport}", "--port", str(rport),
                                     "--log-level", "warning"]))
    base = f"http://127.0.0.1:{rport}"
    srv.wait_ready(base)
    return base, cmds


SETUPS = {"colocated": "(a) colocated, 1 server, 2 threads",
          "disaggregated": "(b) prefill + decode server (1 thread each) + router",
          "colocated_mixed": "(c) colocated with --enable-mixed-chunk, 2 threads"}


def serving(a) -> dict:
    from sparkserve import Engine
    from sparkserve.args import ServerArgs
    start = time.perf_counter()
    with Engine(max_total_tokens=64) as eng:       # the pool's bytes per token, as the servers hold it
        bpt = sum(t[0].nbytes for t in _token_buffers(eng.scheduler))
    reqs = loads(a)
    load_avg = [os.getloadavg()[0]]
    out: dict = {"bytes_per_token": bpt, "concurrency": a.concurrency, "max_tokens": a.max_tokens,
                 "long_tokens": a.long_tokens, "model": os.path.basename(ServerArgs().model_path),
                 "setups": {}}
    for kind in SETUPS:
        srv = Servers()
        try:
            base, cmds = _setup(kind, srv)
            asyncio.run(_load(base, reqs["warm-up"], 2, 4))
            res = {"commands": cmds}
            for name in ("short chats alone", "mixed"):
                raw = asyncio.run(_load(base, reqs[name], a.concurrency, a.max_tokens))
                res[name] = summarize(raw, bpt)
                res[name]["raw"] = [{k: v for k, v in r.items()} for r in raw["requests"]]
                print(f"{kind} / {name}: {raw['wall_s']:.1f} s", flush=True)
            out["setups"][kind] = res
        finally:
            srv.stop()
        load_avg.append(os.getloadavg()[0])
    out["loadavg_1min"] = load_avg
    out["wall_s"] = time.perf_counter() - start
    return out


def serving_table(s: dict) -> list[str]:
    mixed = next(iter(s["setups"].values()))["mixed"]
    lines = ["", f"## TTFT and ITL, disaggregated vs colocated ({s['model']}, {os.cpu_count()} cores)", "",
             f"Streaming chat completions, concurrency {s['concurrency']}, greedy, max_tokens "
             f"{s['max_tokens']} with ignore_eos. Mixed load: {mixed['requests']} requests, "
             f"{mixed['long']['n']} of them long prompts (~{s['long_tokens']} tokens of pydoc topics text, "
             "each its own, + \"Summarize the text above.\"; "
             f"{mixed['long']['prompt_tokens_median']:.0f} prompt tokens with the chat template) "
             f"among short chats ({mixed['short']['prompt_tokens_median']:.0f} prompt tokens); "
             "\"short chats alone\" = the same number of short chats without the long prompts (the ITL "
             "reference). Each setup alone on the machine, after a warm-up; TTFT as the client sees it "
             "(through the router for (b)); ITL = gaps between streamed tokens; output tok/s = every "
             "completion token / the load's wall time. KV = the prompt's state (prompt tokens x "
             f"{s['bytes_per_token']} bytes), moved = less what the decode server's prefix cache held (the "
             "chat template's system prompt); medians. 1-minute load average "
             + ", ".join(f"{x:.2f}" for x in s["loadavg_1min"]) + " (before, then after each setup).", "",
             "| setup | load | requests | TTFT median / p90 (s) | ITL median / p90 (ms) | "
             "ITL p99 / max (ms) | output tok/s (whole load) | KV per request / moved (MB) |",
             "|---|---|---|---|---|---|---|---|"]
    for kind, res in s["setups"].items():
        for load in ("short chats alone", "mixed"):
            r = res[load]
            for cls in ("short", "long"):
                if cls not in r:
                    continue
                c = r[cls]
                kv = f"{c['kv_bytes_median'] / 1e6:.2f} / " + (
                    f"{c['kv_moved_bytes_median'] / 1e6:.2f}" if kind == "disaggregated" else "-")
                lines.append(f"| {SETUPS[kind]} | {load}: {cls} | {c['n']} | {c['ttft_median_s']:.3f} / "
                             f"{c['ttft_p90_s']:.3f} | {c['itl_median_ms']:.1f} / {c['itl_p90_ms']:.1f} | "
                             f"{c['itl_p99_ms']:.0f} / {c['itl_max_ms']:.0f} | "
                             f"{r['output_tok_s']:.1f} | {kv} |")
    lines += ["", "Commands: " + "; ".join(f"{SETUPS[k]}: `" + "`, `".join(re.sub(r"\d{4,5}", "PORT", c)
                                                                           for c in res["commands"]) + "`"
                                           for k, res in s["setups"].items())]
    return lines


def tables(data: dict) -> list[str]:
    m = data["machine"]
    flags = ", ".join(f"{f} {'yes' if m[f] else 'no'}" for f in ("avx512f", "avx2"))
    lines = [f"# Prefill/decode disaggregation on {m['cores']} cores ({m['cpu']}; {flags}; "
             f"torch {m['torch']})"]
    if "transfer" in data:
        lines += transfer_table(data["transfer"])
    if "serving" in data:
        lines += serving_table(data["serving"])
    lines += ["", "Runs:"]
    for section, c in data.get("commands", {}).items():
        lines.append(f"- {section}: `{c['command']}` ({c['date']}; the section {c['wall_s'] / 60:.1f} "
                     f"minutes, the whole run {c['run_wall_s'] / 60:.1f})")
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
