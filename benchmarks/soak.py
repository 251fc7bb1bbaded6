"""A soak of `sparkserve serve`: long mixed load on the embedded model, watched over time. Not a
test (it takes half an hour), but what the tests cannot show: whether a server that has served
thousands of varied requests, many cut off by their clients and some refused in overload bursts,
still answers every request, holds its memory flat, and gives every KV slot back at the end.

    python benchmarks/soak.py [--minutes 30] [--clients 6] [--port 0] [--seed 0]

It starts the server itself (SmolLM2, DSpark with the shipped draft, --max-running-requests 8,
--max-queued-requests 16, --max-total-tokens 16384, loopback, a free port) and always stops it
(also on Ctrl-C or an error).
`--clients` loops each send a random mix until `--minutes` are up: /v1/chat/completions and
/v1/completions (through httpx or the `openai` client), /generate; streaming and not, n 1-3, stop
strings, frequency / presence / repetition penalties, temperature 0 or > 0 with a seed, logprobs,
max_tokens 8-128, some long prompts (chunked prefill), a shared system prompt (prefix cache).
Some requests are cut off by their client: streams closed after a few events, plain requests
dropped mid-flight. A few times a run a burst sends many requests at once, to be refused with 503:
those 503s are asked for and counted apart; any other status >= 400, exception, timeout or
malformed response or SSE stream is an error. Before the clock starts, the prefix cache fills
the KV pool once (fill_pool says why). Every ~10 s a sample: requests, errors, 503s, the
RSS of the server's processes, KV slots held by requests (/server_info num_used_tokens, the prefix
cache not included) and the window's p99 latency. At the end it waits for the server to be idle,
reads the KV in use, flushes the prefix cache, and writes benchmarks/results/soak.{md,json,png}.

Goals (exit status 1 if one is missed): no errors besides the 503s asked for (nor a traceback in
the server's log), RSS growth < 5 % from the end of warm-up (the first 5 minutes, a third of
shorter runs) to the end, no KV held at the end, and the bursts got their 503s."""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx
from results_io import RESULTS, machine_info, machine_line, write_results
from servers import free_port, wait_ready

# the test extra has the openai client, the bench extra not: httpx alone then
try:
    import openai
except ImportError:
    openai = None

MAX_RUNNING, MAX_QUEUED = 8, 16        # capacity 24 sequences: 6 clients x n <= 3 stay below it
# A KV pool of 16k tokens (8 sequences of a 700-word prompt and 128 tokens fit in half of it), not
# the default share of RAM (55k tokens here): filled before the clock starts (fill_pool), a smaller
# pool leaves less of the RSS to it, so 5 % of RSS is a finer leak test, and the prefix cache evicts
# all along.
POOL_TOKENS = 16384
REQUEST_TIMEOUT_S = 120                # a single request, even queued behind a burst, takes far less
SYSTEM = "You are a helpful assistant. Answer in a few sentences."
TOPICS = ["the ocean", "a city at night", "learning to code", "the moon", "autumn leaves", "trains",
          "friendship", "coffee", "mountains", "a thunderstorm", "libraries", "gardening", "robots"]
STOPS = [".", "\n", "!", " the", ",", "END"]
WORDS = ("the a of and to in is was for on with as by at from that this it time year people way day "
         "world life hand part place case week system program question work number night point home "
         "water room area money story fact month book eye job word business issue side kind head house "
         "service friend power hour game line end member law car city name team minute idea").split()
MIX = ("chat 45 % (a quarter through the openai client), completions 30 % (likewise), /generate 25 %; "
       "streaming 50 %, n 1-3 (1 at 60 %), stop strings 40 %, penalties 40 %, temperature 0 at 30 % "
       "(else 0.3-1.2 with a seed), ignore_eos 30 %, chat logprobs 10 %, max_tokens 8-128, long prompts "
       "(300-700 words) 10 %; 12 % of streams closed after 1-4 events, 5 % of plain requests dropped "
       "after 0.1-1 s")


class Bad(Exception):
    """A response the server should not have sent (bad shape, malformed SSE, an error event)."""


@dataclass
class State:
    """What the clients and the sampler share (one event loop, so no locks)."""
    t0: float = 0.0
    done: int = 0                      # requests answered (cut ones included)
    cut: int = 0                       # requests their client closed early
    asked_503: int = 0                 # 503s while a burst was on (burst requests and clients' own)
    burst_active: bool = False
    errors: list[dict] = field(default_factory=list)
    latencies: list[tuple[float, float]] = field(default_factory=list)    # (end s, latency s)
    samples: list[dict] = field(default_factory=list)
    bursts: list[dict] = field(default_factory=list)
    end: dict = field(default_factory=dict)
    by_route: dict[str, int] = field(default_factory=dict)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def error(self, kind: str, path: str, body: dict | None, status: int | None, detail: str) -> None:
        e = {"t_s": round(self.now(), 1), "kind": kind, "path": path, "status": status,
             "body": body, "detail": detail[:1000]}
        self.errors.append(e)
        print(f"ERROR {json.dumps(e)}", file=sys.stderr, flush=True)


# ---- requests -------------------------------------------------------------------------------------
def _prompt(rng: random.Random) -> str:
    if rng.random() < 0.1:             # long enough for several prefill chunks
        notes = " ".join(rng.choice(WORDS) for _ in range(rng.randint(300, 700)))
        return f"Summarize these notes on {rng.choice(TOPICS)}: {notes}"
    return rng.choice(["Write about", "Tell me a story about", "List three facts about",
                       "Explain"]) + f" {rng.choice(TOPICS)}."


def make_request(rng: random.Random) -> tuple[str, dict]:
    """One request of the mix: (path, JSON body)."""
    route = rng.choices(["/v1/chat/completions", "/v1/completions", "/generate"], [45, 30, 25])[0]
    p: dict = {"max_tokens": rng.randint(8, 128), "n": rng.choices([1, 2, 3], [60, 25, 15])[0]}
    if rng.random() < 0.3:
        p["temperature"] = 0
    else:
        p.update(temperature=round(rng.uniform(0.3, 1.2), 2), seed=rng.randrange(1 << 30))
    if rng.random() < 0.4:
        p["stop"] = rng.sample(STOPS, rng.randint(1, 2))
    if rng.random() < 0.4:
        p.update(frequency_penalty=round(rng.uniform(0, 1), 2), presence_penalty=round(rng.uniform(0, 1), 2),
                 repetition_penalty=round(rng.uniform(1, 1.3), 2))
    if rng.random() < 0.3:
        p["ignore_eos"] = True
    stream = rng.random() < 0.5
    if route == "/generate":
        sp = dict(p, max_new_tokens=p.pop("max_tokens"))
        return route, {"text": _prompt(rng), "sampling_params": sp, "stream": stream}
    body = {"model": "default", **p, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if route == "/v1/completions":
        body["prompt"] = _prompt(rng)
    else:
        body["messages"] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": _prompt(rng)}]
        if rng.random() < 0.1:
            body.update(logprobs=True, top_logprobs=2)
    return route, body


def _n(path: str, body: dict) -> int:
    return (body["sampling_params"] if path == "/generate" else body).get("n", 1)


def _stops(path: str, body: dict) -> list[str]:
    return (body["sampling_params"] if path == "/generate" else body).get("stop") or []


def _check_texts(path: str, body: dict, texts: dict[int, str], finishes: dict[int, object]) -> None:
    """Every one of the n sequences ended, normally, without a stop string in its text."""
    n = _n(path, body)
    if sorted(texts) != list(range(n)) or sorted(finishes) != list(range(n)):
        raise Bad(f"choices {sorted(texts)} / finished {sorted(finishes)}, want {n}")
    for i, fr in finishes.items():
        kind = fr.get("type") if isinstance(fr, dict) else fr
        if kind not in ("stop", "length"):
            raise Bad(f"sequence {i} finished with {fr!r}")
        hit = [s for s in _stops(path, body) if s in texts[i]]
        if hit:
            raise Bad(f"sequence {i} holds its stop string {hit[0]!r}: {texts[i][:200]!r}")


def check_json(path: str, body: dict, data) -> None:
    """A non-streaming response's shape."""
    if path == "/generate":
        items = data if isinstance(data, list) else [data]
        _check_texts(path, body, {i: d["text"] for i, d in enumerate(items)},
                     {i: d["meta_info"]["finish_reason"] for i, d in enumerate(items)})
        return
    chat = path.endswith("chat/completions")
    choices = data["choices"]
    _check_texts(path, body, {c["index"]: c["message"]["content"] if chat else c["text"] for c in choices},
                 {c["index"]: c["finish_reason"] for c in choices})
    if chat and body.get("logprobs") and any(not isinstance((c.get("logprobs") or {}).get("content"), list)
                                             for c in choices):
        raise Bad("logprobs asked for, none returned")
    if data["usage"]["completion_tokens"] > body["max_tokens"] * _n(path, body):
        raise Bad(f"usage {data['usage']} over max_tokens x n")


class StreamCheck:
    """Events of one SSE stream, fed one at a time; `finish()` checks the whole once [DONE] came."""

    def __init__(self, path: str, body: dict):
        self.path, self.body = path, body
        self.texts: dict[int, str] = {}
        self.finishes: dict[int, object] = {}

    def feed(self, ev: dict) -> None:
        if "error" in ev:
            raise Bad(f"error event {ev['error']}")
        if self.path == "/generate":               # cumulative text per sequence
            i = ev.get("index", 0)
            self.texts[i] = ev["text"]
            if ev["meta_info"]["finish_reason"] is not None:
                self.finishes[i] = ev["meta_info"]["finish_reason"]
            return
        chat = self.path.endswith("chat/completions")
        for c in ev["choices"]:
            piece = (c["delta"].get("content") if chat else c["text"]) or ""
            self.texts[c["index"]] = self.texts.get(c["index"], "") + piece
            if c["finish_reason"] is not None:
                self.finishes[c["index"]] = c["finish_reason"]

    def finish(self) -> None:
        _check_texts(self.path, self.body, self.texts, self.finishes)


async def via_httpx(client: httpx.AsyncClient, path: str, body: dict, cut_after: int) -> tuple[int, str]:
    """Send one request; (status, error text) for a refusal, (200, '') when it was answered whole
    or cut off after `cut_after` SSE events (0: never)."""
    if not body.get("stream"):
        r = await client.post(path, json=body)
        if r.status_code != 200:
            return r.status_code, r.text
        check_json(path, body, r.json())
        return 200, ""
    check, events, done = StreamCheck(path, body), 0, False
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            return r.status_code, (await r.aread()).decode(errors="replace")
        async for line in r.aiter_lines():
            if not line.strip():
                continue
            if done or not line.startswith("data: "):
                raise Bad(f"unexpected SSE line {line[:200]!r}")
            if line == "data: [DONE]":
                done = True
                continue
            try:
                check.feed(json.loads(line[6:]))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise Bad(f"malformed event ({e!r}): {line[:300]!r}") from None
            events += 1
            if events == cut_after:
                return 200, "cut"                  # leaving the block closes the connection
    if not done:
        raise Bad("stream ended without [DONE]")
    check.finish()
    return 200, ""


OPENAI_EXTRA = ("repetition_penalty", "ignore_eos")


async def via_openai(client, path: str, body: dict, cut_after: int) -> tuple[int, str]:
    """The same through the real `openai` client (sparkserve's own fields in extra_body)."""
    kw = {k: v for k, v in body.items() if k not in OPENAI_EXTRA}
    extra = {k: body[k] for k in OPENAI_EXTRA if k in body}
    api = client.chat.completions if path.endswith("chat/completions") else client.completions
    try:
        resp = await api.create(**kw, extra_body=extra or None)
    except openai.APIStatusError as e:
        return e.status_code, e.response.text
    if not body.get("stream"):
        check_json(path, body, resp.model_dump())
        return 200, ""
    check, events = StreamCheck(path, body), 0
    try:
        async for chunk in resp:
            check.feed(chunk.model_dump())
            events += 1
            if events == cut_after:
                return 200, "cut"
    finally:
        await resp.close()
    check.finish()
    return 200, ""


async def client_loop(st: State, base: str, cid: int, seed: int, t_end: float) -> None:
    """One client: random requests back to back until `t_end` (monotonic)."""
    rng = random.Random(seed * 1000 + cid)
    async with httpx.AsyncClient(base_url=base, timeout=REQUEST_TIMEOUT_S) as hc:
        oc = openai and openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0,
                                           timeout=REQUEST_TIMEOUT_S)
        while time.monotonic() < t_end:
            path, body = make_request(rng)
            use_openai = path != "/generate" and rng.random() < 0.25 and oc is not None
            cut_after = rng.randint(1, 4) if body["stream"] and rng.random() < 0.12 else 0
            drop_after = rng.uniform(0.1, 1.0) if not body["stream"] and rng.random() < 0.05 else None
            route = path + (" (openai)" if use_openai else "")
            st.by_route[route] = st.by_route.get(route, 0) + 1
            t = time.monotonic()
            try:
                coro = (via_openai(oc, path, body, cut_after) if use_openai
                        else via_httpx(hc, path, body, cut_after))
                status, text = await asyncio.wait_for(coro, drop_after) if drop_after else await coro
            except asyncio.TimeoutError:          # wait_for dropped it: the client went away
                st.done, st.cut = st.done + 1, st.cut + 1
                continue
            except Bad as e:
                st.error("malformed", route, body, 200, str(e))
                continue
            except Exception as e:                 # transport errors, the openai client's own
                st.error("exception", route, body, None, repr(e))
                continue
            st.done += 1
            if status == 503 and st.burst_active:
                st.asked_503 += 1
            elif status != 200:
                st.error(f"http {status}", route, body, status, text)
            elif text == "cut":
                st.cut += 1
            else:
                st.latencies.append((st.now(), time.monotonic() - t))
        if oc is not None:
            await oc.close()


async def burst(st: State, base: str, size: int) -> None:
    """`size` short requests at once, past the server's capacity: the 503s are what is asked for;
    the clients' own 503s while it lasts (and a second after) count as asked for too."""
    st.burst_active = True
    t = st.now()
    body = {"model": "default", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16}
    async with httpx.AsyncClient(base_url=base, timeout=REQUEST_TIMEOUT_S,
                                 limits=httpx.Limits(max_connections=size)) as hc:
        rs = await asyncio.gather(*(hc.post("/v1/chat/completions", json=body) for _ in range(size)),
                                  return_exceptions=True)
    counts = {"200": 0, "503": 0}
    for r in rs:
        if isinstance(r, Exception):
            st.error("exception", "burst", body, None, repr(r))
        elif r.status_code == 503:
            counts["503"] += 1
        elif r.status_code == 200:
            counts["200"] += 1
        else:
            st.error(f"http {r.status_code}", "burst", body, r.status_code, r.text)
    st.asked_503 += counts["503"]
    st.done += len(rs)
    st.bursts.append({"t_s": round(t, 1), "size": size, "ok": counts["200"], "503": counts["503"],
                      "s": round(st.now() - t, 1)})
    print(f"burst at {t:.0f} s: {counts}", file=sys.stderr, flush=True)
    await asyncio.sleep(1)
    st.burst_active = False


# ---- the server -----------------------------------------------------------------------------------
def _tree(pid: int) -> list[int]:
    """`pid` and its descendants (the HTTP process, its scheduler child, multiprocessing's helper)."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += [c for c, pp in parent.items() if pp == p]
    return out


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def start_server(port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "sparkserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--speculative-algorithm", "DSPARK", "--max-running-requests", str(MAX_RUNNING),
           "--max-queued-requests", str(MAX_QUEUED), "--max-total-tokens", str(POOL_TOKENS),
           "--log-level", "warning"]
    log = open(os.path.join(tempfile.gettempdir(), f"soak-server-{port}.log"), "w")
    # its own session: a Ctrl-C here does not reach it half-way, and the group is ours to stop
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    proc.log_path, proc.cmd = log.name, " ".join(cmd[1:])
    return proc


def stop_server(proc: subprocess.Popen) -> int | None:
    """SIGTERM, then SIGKILL to its whole process group; never returns with one of them alive."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for sig in (signal.SIGTERM, signal.SIGKILL):          # a child left behind by its parent
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        os.killpg(proc.pid, sig)
        time.sleep(2)
    return proc.returncode


# ---- the run --------------------------------------------------------------------------------------
def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[max(0, math.ceil(0.99 * len(xs)) - 1)] if xs else float("nan")


async def sample(st: State, hc: httpx.AsyncClient, pid: int, last_t: float) -> dict:
    """One row: counters, RSS of the server's processes, KV in use, latency of the window since `last_t`."""
    try:
        kv = (await hc.get("/server_info", timeout=30)).json()["internal_states"][0]
    except Exception as e:
        st.error("exception", "/server_info", None, None, repr(e))
        kv = {}
    tree = _tree(pid)
    window = [lat for t, lat in st.latencies if t > last_t]
    row = {"t_s": round(st.now(), 1), "requests": st.done, "errors": len(st.errors),
           "asked_503": st.asked_503, "cut": st.cut, "rss_http_mb": round(_rss_mb(pid), 1),
           "rss_children_mb": round(sum(_rss_mb(p) for p in tree[1:]), 1),
           "kv_used": kv.get("num_used_tokens"), "kv_cached": kv.get("num_cached_tokens"),
           "running": kv.get("num_running_reqs"), "queued": kv.get("num_queue_reqs"),
           "window_n": len(window), "p50_s": round(sorted(window)[len(window) // 2], 3) if window else None,
           "p99_s": round(p99(window), 3) if window else None}
    row["rss_mb"] = round(row["rss_http_mb"] + row["rss_children_mb"], 1)
    st.samples.append(row)
    return row


async def wait_idle(hc: httpx.AsyncClient, timeout: float = 60) -> tuple[dict, float]:
    """As the server tests define idle: nothing running or queued, no sequence in flight, no KV
    held by a request (the prefix cache may hold some). Returns the state and the seconds it took."""
    t = time.monotonic()
    while True:
        s = (await hc.get("/server_info")).json()["internal_states"][0]
        if (s["num_running_reqs"], s["num_queue_reqs"], s["num_used_tokens"], s["inflight_sequences"]) \
                == (0, 0, 0, 0) or time.monotonic() - t > timeout:
            return s, time.monotonic() - t
        await asyncio.sleep(0.2)


async def fill_pool(st: State, hc: httpx.AsyncClient, pid: int) -> None:
    """Fill the KV pool once with the prefix cache, before the clock starts. The pool takes RAM
    only as its pages are first written (mem/heap.py) and the prefix cache evicts only when the
    pool is full, so a fresh server's RSS grows for many minutes of this load as its pool fills,
    up to the pool's size: what a long-running server holds anyway, and no leak. Distinct
    random-token prompts, one output token each, until the cache holds (nearly) all of it."""
    t, rng = time.monotonic(), random.Random(1)
    st.end["rss_before_fill_mb"] = round(sum(_rss_mb(p) for p in _tree(pid)), 1)
    held, last = 0, -1
    while time.monotonic() - t < 600:
        ids = [rng.randrange(1000, 40000) for _ in range(2048)]
        r = await hc.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1}},
                          timeout=REQUEST_TIMEOUT_S)
        if r.status_code != 200:
            raise RuntimeError(f"filling the KV pool: HTTP {r.status_code}: {r.text[:500]}")
        s = (await hc.get("/server_info")).json()["internal_states"][0]
        held, total = s["num_used_tokens"] + s["num_cached_tokens"], s["max_total_num_tokens"]
        if held >= 0.97 * total or held <= last:           # full, or evicting already
            break
        last = held
    st.end.update(fill={"tokens": held, "pool": total, "s": round(time.monotonic() - t, 1)})
    print(f"KV pool filled: {st.end['fill']}", file=sys.stderr, flush=True)


async def soak(st: State, base: str, pid: int, a: argparse.Namespace) -> None:
    duration = a.minutes * 60
    every = min(300.0, duration / 3)               # bursts at 0.5, 1.5, 2.5, .. x `every`
    burst_at = [every * (k + 0.5) for k in range(int(duration / every + 0.5))]
    async with httpx.AsyncClient(base_url=base, timeout=30) as hc:
        await fill_pool(st, hc, pid)
        st.t0 = time.monotonic()
        t_end = st.t0 + duration
        await sample(st, hc, pid, -1)
        clients = [asyncio.create_task(client_loop(st, base, c, a.seed, t_end)) for c in range(a.clients)]
        bursts, last = [], 0.0
        while time.monotonic() < t_end:
            await asyncio.sleep(min(a.sample_every, max(0.0, t_end - time.monotonic())))
            if burst_at and st.now() >= burst_at[0]:
                burst_at.pop(0)
                bursts.append(asyncio.create_task(burst(st, base, a.burst_size)))
            row = await sample(st, hc, pid, last)
            last = row["t_s"]
            print(json.dumps(row), file=sys.stderr, flush=True)
        await asyncio.gather(*clients, *bursts)
        state, took = await wait_idle(hc)
        st.end.update(idle_after_s=round(took, 1), kv_used=state["num_used_tokens"],
                      kv_cached=state["num_cached_tokens"], running=state["num_running_reqs"],
                      queued=state["num_queue_reqs"], inflight=state["inflight_sequences"])
        flush = await hc.post("/flush_cache")
        state = (await hc.get("/server_info")).json()["internal_states"][0]
        st.end.update(flush_status=flush.status_code, kv_used_after_flush=state["num_used_tokens"],
                      kv_cached_after_flush=state["num_cached_tokens"])
        await sample(st, hc, pid, last)


def _log_problems(path: str) -> list[str]:
    try:
        with open(path, errors="replace") as f:
            lines = f.readlines()
    except OSError:
        return []
    return [ln.rstrip() for ln in lines if "Traceback" in ln or " ERROR " in ln or ln.startswith("ERROR")]


def plot(st: State, warm_s: float, base_rss: float, name: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = st.samples
    t = [r["t_s"] / 60 for r in rows]
    fig, axes = plt.subplots(4, 1, figsize=(10, 10), sharex=True)
    ax = axes[0]
    for key, label in (("rss_mb", "total"), ("rss_children_mb", "scheduler + helpers"),
                       ("rss_http_mb", "HTTP")):
        ax.plot(t, [r[key] for r in rows], label=label)
    ax.axhline(1.05 * base_rss, color="red", ls="--", lw=1, label="goal: warm-up's + 5 %")
    ax.set_ylabel("RSS (MB)")
    ax.legend(loc="center right", fontsize=8)
    axes[1].plot(t, [r["kv_used"] for r in rows], label="held by requests")
    axes[1].plot(t, [r["kv_cached"] for r in rows], label="prefix cache only", alpha=0.6)
    axes[1].set_ylabel("KV tokens")
    axes[1].legend(loc="upper right", fontsize=8)
    axes[2].plot(t, [r["p99_s"] for r in rows], marker=".", label="p99")
    axes[2].plot(t, [r["p50_s"] for r in rows], marker=".", label="p50")
    axes[2].set_ylabel("latency per window (s)")
    axes[2].legend(loc="upper right", fontsize=8)
    axes[3].plot(t, [r["errors"] for r in rows], label="errors", color="red")
    axes[3].plot(t, [r["asked_503"] for r in rows], label="503s asked for", color="gray")
    axes[3].plot(t, [r["cut"] for r in rows], label="cut by the client", color="tab:purple")
    axes[3].set_ylabel("count (cumulative)")
    axes[3].set_xlabel("minutes")
    axes[3].legend(loc="upper left", fontsize=8)
    for ax in axes:
        ax.axvline(warm_s / 60, color="k", ls=":", lw=1)
        for b in st.bursts:
            ax.axvspan(b["t_s"] / 60, (b["t_s"] + b["s"]) / 60, color="orange", alpha=0.3)
    axes[0].set_title("sparkserve soak (orange: 503 bursts, dotted: end of warm-up)")
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, f"{name}.png"), dpi=90)


def report(st: State, a: argparse.Namespace, proc: subprocess.Popen, exit_code: int | None,
           interrupted: bool) -> bool:
    """Write soak.{md,json,png}; True when every goal is met."""
    duration = a.minutes * 60
    warm = min(300.0, duration / 3)
    rows, fill = st.samples, st.end.get("fill") or {}
    base = next((r for r in rows if r["t_s"] >= warm), rows[-1])
    last = rows[-1]
    growth = last["rss_mb"] / base["rss_mb"] - 1 if base["rss_mb"] else float("nan")
    peak = max(r["rss_mb"] for r in rows if r["t_s"] >= base["t_s"])
    log_problems = _log_problems(proc.log_path)
    lat_all = [lat for _, lat in st.latencies]
    after = [lat for t, lat in st.latencies if t >= warm]
    thirds = [[lat for t, lat in st.latencies if warm + k * (duration - warm) / 3 <= t
               < warm + (k + 1) * (duration - warm) / 3] for k in range(3)]
    goals = {
        "no errors besides the 503s asked for": not st.errors and not log_problems,
        "RSS growth after warm-up < 5 %": growth < 0.05,
        "no KV held at the end": st.end.get("kv_used") == 0 and st.end.get("kv_used_after_flush") == 0
        and st.end.get("kv_cached_after_flush") == 0,
        "every burst got 503s": bool(st.bursts) and all(b["503"] > 0 for b in st.bursts),
    }
    if interrupted:
        goals["ran to the end"] = False
    cpu = machine_info()
    lines = [f"# Soak of `sparkserve serve`, {a.minutes:g} minutes ({time.strftime('%Y-%m-%d %H:%M')})", "",
             f"{machine_line(cpu)}", "",
             f"Server: `{proc.cmd}` (embedded SmolLM2-135M-Instruct, DSpark with the shipped draft); "
             f"{a.clients} clients back to back, seed {a.seed}. Mix: {MIX}. Bursts of {a.burst_size} short "
             f"chats at once every {warm / 60:.1f} min (capacity {MAX_RUNNING + MAX_QUEUED} sequences). "
             f"Before the clock starts, the prefix cache fills the KV pool once (random-token prompts): "
             "the pool becomes resident as it is first written, which would otherwise read as RSS growth for "
             f"many minutes. Warm-up: the first {warm / 60:.1f} min. Latency: end to end, requests answered "
             "whole.", "",
             "## Goals", ""]
    lines += [f"- {'PASS' if ok else '**FAIL**'}: {g}" for g, ok in goals.items()]
    lines += ["", "## Summary", "",
              f"- requests: {st.done}: {len(lat_all)} answered whole, {st.cut} cut off by their client, "
              f"{st.asked_503} 503s asked for, {sum(b['ok'] for b in st.bursts)} burst requests answered; "
              "the clients' per route: "
              + ", ".join(f"{k} {v}" for k, v in sorted(st.by_route.items())),
              f"- errors: {len(st.errors)}; server log lines with a traceback or ERROR: {len(log_problems)}",
              f"- RSS (HTTP + scheduler + helpers): {st.end.get('rss_before_fill_mb', 0):.0f} MB once up, "
              f"{rows[0]['rss_mb']:.0f} MB with the KV pool filled ({fill.get('tokens')} of "
              f"{fill.get('pool')} tokens in {fill.get('s')} s), "
              f"{base['rss_mb']:.0f} MB at {base['t_s'] / 60:.1f} min (end of warm-up), peak {peak:.0f} MB "
              f"after it, {last['rss_mb']:.0f} MB at the end: **{100 * growth:+.1f} %** after warm-up "
              f"(HTTP {base['rss_http_mb']:.0f} -> "
              f"{last['rss_http_mb']:.0f} MB, scheduler {base['rss_children_mb']:.0f} -> "
              f"{last['rss_children_mb']:.0f} MB)",
              f"- KV at the end: {st.end.get('kv_used')} tokens held by requests once idle (after "
              f"{st.end.get('idle_after_s')} s; {st.end.get('kv_cached')} in the prefix cache), "
              f"after /flush_cache ({st.end.get('flush_status')}) {st.end.get('kv_used_after_flush')} / "
              f"{st.end.get('kv_cached_after_flush')}",
              f"- latency p99: {p99(lat_all):.2f} s overall, {p99(after):.2f} s after warm-up; by thirds "
              "of the rest: " + " / ".join(f"{p99(x):.2f}" for x in thirds) + " s; median "
              f"{sorted(lat_all)[len(lat_all) // 2] if lat_all else float('nan'):.2f} s",
              "- bursts: " + "; ".join(f"{b['t_s'] / 60:.1f} min: {b['503']} x 503, {b['ok']} x 200 "
                                       f"in {b['s']} s" for b in st.bursts),
              f"- server exit status on SIGTERM: {exit_code}"]
    if st.errors or log_problems:
        lines += ["", "## Errors", ""]
        lines += [f"- {e['t_s']} s, {e['kind']}, {e['path']}: {e['detail'][:300]!r}; body "
                  f"`{json.dumps(e['body'])[:400]}`" for e in st.errors[:20]]
        lines += [f"- server log: `{ln[:300]}`" for ln in log_problems[:10]]
    step = max(1, math.ceil(len(rows) / 40))
    lines += ["", f"## Samples (every {step * a.sample_every:g} s)", "",
              "| min | requests | errors | 503 asked | cut | RSS MB (HTTP / sched) | KV used | KV cached "
              "| running | p50 s | p99 s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows[::step] + ([last] if (len(rows) - 1) % step else []):
        lines.append(f"| {r['t_s'] / 60:.1f} | {r['requests']} | {r['errors']} | {r['asked_503']} "
                     f"| {r['cut']} | {r['rss_mb']:.0f} ({r['rss_http_mb']:.0f} / "
                     f"{r['rss_children_mb']:.0f}) "
                     f"| {r['kv_used']} | {r['kv_cached']} | {r['running']} | {r['p50_s']} | {r['p99_s']} |")
    data = {"minutes": a.minutes, "clients": a.clients, "seed": a.seed, "server": proc.cmd, "machine": cpu,
            "goals": goals, "rss_growth": growth, "end": st.end, "bursts": st.bursts, "errors": st.errors,
            "server_log_problems": log_problems, "samples": rows, "by_route": st.by_route,
            "server_exit": exit_code, "interrupted": interrupted, "date": time.strftime("%Y-%m-%d %H:%M")}
    write_results("soak", data, lines)
    plot(st, warm, base["rss_mb"], "soak")
    return all(goals.values())


def _sigterm(*_):
    raise KeyboardInterrupt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--clients", type=int, default=6, help="concurrent client loops, n <= 3 sequences each: "
                    f"over {(MAX_RUNNING + MAX_QUEUED) // 3} may get 503s outside the bursts (errors)")
    ap.add_argument("--port", type=int, default=0, help="loopback port (default: a free one)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--burst-size", type=int, default=2 * (MAX_RUNNING + MAX_QUEUED))
    ap.add_argument("--sample-every", type=float, default=10, help="seconds between samples")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, _sigterm)
    port = a.port or free_port()
    base = f"http://127.0.0.1:{port}"
    st, interrupted = State(), False
    proc = start_server(port)
    try:
        wait_ready(base, proc)
        asyncio.run(soak(st, base, proc.pid, a))
    except KeyboardInterrupt:
        interrupted = True
        print("interrupted: stopping the server", file=sys.stderr)
    finally:
        exit_code = stop_server(proc)
        print(f"server stopped ({exit_code}); its log: {proc.log_path}", file=sys.stderr)
    if not st.samples:
        return 130 if interrupted else 1
    ok = report(st, a, proc, exit_code, interrupted)
    return 130 if interrupted else (0 if ok else 1)


if __name__ == "__main__":
    sys.exit(main())
