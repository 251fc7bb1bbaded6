"""`sparkserve router` (the PD router for users without sglang-router), started through the CLI in
front of two real `sparkserve serve` servers in null mode (each ignores the bootstrap fields and
runs the whole request, so the client gets the decode server's full answer) and of recording stub
servers, which show what each side is sent and answer what a test needs.

Checked: greedy answers through the router equal a direct request (/generate single and batched,
chat, completions, streamed chat); both servers get the same body with the same pairing
(bootstrap_host = the prefill server's host, its bootstrap port, a 63-bit room; lists for a batch);
a prefill error reaches the client with its status and body and cancels the decode request (the
decode server aborts it: KV freed), and so does a client that leaves, for both requests; an
unreachable server is a 502 and is skipped from then on; dead servers are skipped after a health
check and used again once they pass; no healthy server of a role is a 503."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any, Callable

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from server_harness import ServerProcess, free_port
from starlette.responses import JSONResponse, Response
from tiny_chat_fixtures import make_tiny_chat_checkpoint

T = 60                                  # seconds any single HTTP call may take here
LONG_CONTEXT = 2048


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Two null-mode servers of the tiny chat model: (prefill side, decode side). Its context is
    raised to the pool's size, so that a long request runs for seconds: time enough for a client's
    cancel to cross the router while both servers still run it."""
    path = make_tiny_chat_checkpoint(str(tmp_path_factory.mktemp("tiny_chat") / "llama"))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**config, "max_position_embeddings": LONG_CONTEXT}, f)
    pair = [ServerProcess("--model-path", path, "--max-total-tokens", str(LONG_CONTEXT)) for _ in range(2)]
    for s in pair:
        s.wait_ready()
    yield pair
    for s in pair:
        s.stop()
        s.remove_log()


class Router:
    """`sparkserve router ...` as a subprocess on a free port."""

    def __init__(self, *args: str, interval: float = 0.3):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sparkserve.cli", "router", "--port", str(self.port),
             "--health-check-interval", str(interval), "--log-level", "warning", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        end = time.monotonic() + 30
        while time.monotonic() < end:
            assert self.proc.poll() is None, self.proc.stdout.read()
            try:
                httpx.get(self.url + "/health", timeout=1)
                return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError("the router did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture
def router():   # tests ask for `stub` first, so their routers stop (and drop their connections) first
    started: list[Router] = []

    def start(*args: str, **kw) -> Router:
        started.append(Router(*args, **kw))
        return started[-1]
    yield start
    for r in started:
        r.stop()


class Stub:
    """A recording server on a thread: /health answers 200; every POST is recorded as
    (path, body) and answered by `answer(path, body)`. A decode stub given its prefill stub
    (`after`) answers only once that one has the request too (at most 2 s), as a real decode
    server, which waits for the prefill server's state: an answer that came first would end the
    pair, and the router would cancel the prefill request, maybe before that stub records it."""

    def __init__(self, answer: Callable[[str, dict], Response], port: int | None = None,
                 after: Stub | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.seen: list[tuple[str, dict[str, Any]]] = []
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200)

        @app.post("/{path:path}")
        async def post(path: str, request: Request) -> Response:
            body = json.loads(await request.body())
            self.seen.append(("/" + path, body))
            end = time.monotonic() + 2
            while after is not None and len(after.seen) < len(self.seen) and time.monotonic() < end:
                await asyncio.sleep(0.01)
            return answer("/" + path, body)

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        end = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < end, "stub did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def stub():
    started: list[Stub] = []

    def start(answer=lambda path, body: JSONResponse({"from": "stub", "path": path}), port=None,
              after=None) -> Stub:
        started.append(Stub(answer, port, after))
        return started[-1]
    yield start
    for s in started:
        s.stop()


def _dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"          # nothing listens there


def _aborted(server: ServerProcess) -> float:
    for line in httpx.get(server.url + "/metrics", timeout=T).text.splitlines():
        if line.startswith("sglang:num_aborted_requests_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no abort counter")


def _inflight(server: ServerProcess) -> int:
    info = httpx.get(server.url + "/server_info", timeout=T).json()
    return info["internal_states"][0]["inflight_sequences"]


def _wait_idle(server: ServerProcess) -> None:
    end = time.monotonic() + 20
    while time.monotonic() < end:
        state = httpx.get(server.url + "/server_info", timeout=T).json()["internal_states"][0]
        if state["inflight_sequences"] == 0 and state["num_used_tokens"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"{server.url} still busy: {state}")


def _sse_text(r: httpx.Response) -> tuple[str, list[str]]:
    lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    text = "".join(c["delta"].get("content") or "" for line in lines[:-1]
                   for c in json.loads(line[6:])["choices"])
    return text, lines


# ---- through two real servers -------------------------------------------------------------------
def test_greedy_answers_through_the_router_equal_direct_ones(servers, router):
    prefill, decode = servers
    r = router("--prefill", prefill.url, "--decode", decode.url)
    gen = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    batch = {"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    chat = {"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 8, "temperature": 0}
    completion = {"prompt": ["The sky is", "Rain"], "max_tokens": 6, "temperature": 0}
    for path, body in (("/generate", gen), ("/generate", batch), ("/v1/chat/completions", chat),
                       ("/v1/completions", completion)):
        direct = httpx.post(decode.url + path, json=body, timeout=T).json()
        routed = httpx.post(r.url + path, json=body, timeout=T)
        assert routed.status_code == 200, routed.text
        routed = routed.json()
        if path == "/generate":
            for a, b in zip(direct if isinstance(direct, list) else [direct],
                            routed if isinstance(routed, list) else [routed], strict=True):
                assert (a["text"], a["output_ids"]) == (b["text"], b["output_ids"])
        else:
            assert routed["choices"] == direct["choices"] and routed["usage"]["completion_tokens"] == \
                direct["usage"]["completion_tokens"]
    direct = httpx.post(decode.url + "/v1/chat/completions", json=chat, timeout=T).json()
    with httpx.stream("POST", r.url + "/v1/chat/completions", json={**chat, "stream": True}, timeout=T) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        text, lines = _sse_text(s)
    assert lines[-1] == "data: [DONE]" and text == direct["choices"][0]["message"]["content"]
    # the info routes are the decode server's
    for path in ("/v1/models", "/model_info", "/server_info"):
        got = httpx.get(r.url + path, timeout=T).json()
        want = httpx.get(decode.url + path, timeout=T).json()
        assert got.keys() == want.keys() and got.get("port") == want.get("port")
    assert httpx.get(r.url + "/health", timeout=T).status_code == 200
    for s in servers:
        _wait_idle(s)


def test_a_prefill_error_reaches_the_client_and_cancels_the_decode_request(servers, stub, router):
    """The prefill side answers 503 once the real decode server runs the request: the client gets
    that status and body, and the decode server aborts its request (its KV is freed)."""
    _, decode = servers

    def fail_once_decode_runs(path: str, body: dict) -> Response:
        end = time.monotonic() + 20
        while _inflight(decode) == 0 and time.monotonic() < end:
            time.sleep(0.01)
        return JSONResponse({"error": {"message": "prefill says no", "code": 503}}, status_code=503)

    p = stub(fail_once_decode_runs)
    r = router("--prefill", p.url, "--decode", decode.url)
    long = {"input_ids": [1, 2, 3], "stream": False,
            "sampling_params": {"max_new_tokens": 240, "ignore_eos": True, "temperature": 0}}
    for stream in (False, True):
        before = _aborted(decode)
        got = httpx.post(r.url + "/generate", json={**long, "stream": stream}, timeout=T)
        assert got.status_code == 503 and got.json() == {"error": {"message": "prefill says no", "code": 503}}
        _wait_idle(decode)
        assert _aborted(decode) == before + 1
    assert len(p.seen) == 2


def test_a_client_that_leaves_cancels_both_requests(servers, router):
    """The client goes away mid-request (streamed or not): both servers abort the request."""
    r = router("--prefill", servers[0].url, "--decode", servers[1].url)
    long = {"input_ids": [1, 2, 3],
            "sampling_params": {"max_new_tokens": LONG_CONTEXT - 8, "ignore_eos": True}}

    async def leave(stream: bool) -> None:
        async with httpx.AsyncClient(timeout=T) as client:
            sent = asyncio.create_task(client.post(r.url + "/generate", json={**long, "stream": stream}))
            end = time.monotonic() + 20
            while not all(_inflight(s) for s in servers) and time.monotonic() < end and not sent.done():
                await asyncio.sleep(0.01)
            assert not sent.done(), "the request ended before the client left"
            sent.cancel()

    for stream in (False, True):
        before = [_aborted(s) for s in servers]
        asyncio.run(leave(stream))
        for s, n in zip(servers, before):
            _wait_idle(s)
            assert _aborted(s) == n + 1


# ---- what each side is sent (stubs) -------------------------------------------------------------
def test_both_servers_get_the_same_body_with_the_pairing(stub, router):
    answer = {"text": "from decode", "output_ids": [1]}
    p = stub(lambda path, body: JSONResponse({"text": "from prefill"}))
    d = stub(lambda path, body: JSONResponse(answer), after=p)
    r = router("--prefill", p.url, "7000", "--decode", d.url)
    cases = [("/generate", {"text": "hi", "bootstrap_room": 1}, None),
             ("/generate", {"text": ["a", "b", "c"]}, 3),
             ("/generate", {"input_ids": [[1], [2]]}, 2),
             ("/generate", {"input_ids": [1, 2]}, None),
             ("/v1/completions", {"prompt": ["a", "b"]}, 2),
             ("/v1/completions", {"prompt": [[1, 2], [3]]}, 2),
             ("/v1/completions", {"prompt": [1, 2]}, None),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, None)]
    for path, body, count in cases:
        got = httpx.post(r.url + path, json=body, timeout=T)
        assert got.status_code == 200 and got.json() == answer, got.text
        (p_path, sent), (d_path, d_sent) = p.seen.pop(), d.seen.pop()
        assert p_path == d_path == path and sent == d_sent
        assert {k: v for k, v in sent.items() if not k.startswith("bootstrap_")} == \
            {k: v for k, v in body.items() if not k.startswith("bootstrap_")}
        rooms = sent["bootstrap_room"] if count else [sent["bootstrap_room"]]
        hosts = sent["bootstrap_host"] if count else [sent["bootstrap_host"]]
        ports = sent["bootstrap_port"] if count else [sent["bootstrap_port"]]
        assert hosts == ["127.0.0.1"] * (count or 1) and ports == [7000] * (count or 1)
        assert len(set(rooms)) == len(rooms) == (count or 1) and all(0 <= x < 1 << 63 for x in rooms)
        assert rooms != [1]                              # the router's pairing, not the client's
    # no port given: SGLang's default
    r = router("--prefill", p.url, "--decode", d.url)
    assert httpx.post(r.url + "/generate", json={"text": "hi"}, timeout=T).status_code == 200
    assert p.seen.pop()[1]["bootstrap_port"] == 8998
    d.seen.clear()
    r = router("--prefill", p.url, "none", "--decode", d.url)            # sglang-router's spelling
    assert httpx.post(r.url + "/generate", json={"text": "hi"}, timeout=T).status_code == 200
    assert p.seen.pop()[1]["bootstrap_port"] is None
    # streaming passes the decode server's SSE on unchanged
    sse = b'data: {"text": "a"}\n\ndata: {"text": "ab"}\n\ndata: [DONE]\n\n'
    p.seen.clear()
    d2 = stub(lambda path, body: Response(sse, media_type="text/event-stream"), after=p)
    r = router("--prefill", p.url, "--decode", d2.url)
    with httpx.stream("POST", r.url + "/generate", json={"text": "hi", "stream": True}, timeout=T) as s:
        assert s.status_code == 200 and s.read() == sse
    # not JSON: the router's own 400
    got = httpx.post(r.url + "/generate", content=b"{nope", timeout=T)
    assert got.status_code == 400 and "JSON" in got.json()["error"]["message"]


def test_round_robin_skips_dead_servers_until_they_pass(stub, router):
    p1 = stub()
    d1 = stub(after=p1)
    dead_p, dead_d_port = _dead_url(), free_port()
    r = router("--prefill", p1.url, "--prefill", dead_p, "--decode", f"http://127.0.0.1:{dead_d_port}",
               "--decode", d1.url)
    for _ in range(4):                                   # the start-up check already skips the dead
        assert httpx.post(r.url + "/generate", json={"text": "x"}, timeout=T).status_code == 200
    assert len(p1.seen) == len(d1.seen) == 4
    d2 = stub(port=dead_d_port)                          # comes up: used once a check passes
    end = time.monotonic() + 10
    while not d2.seen and time.monotonic() < end:
        httpx.post(r.url + "/generate", json={"text": "x"}, timeout=T)
    assert d2.seen


def test_an_unreachable_server_is_a_502_then_skipped(stub, router):
    p = stub()
    d = stub(after=p)
    r = router("--prefill", p.url, "--decode", d.url, interval=600)
    assert httpx.post(r.url + "/generate", json={"text": "x"}, timeout=T).status_code == 200
    p.stop()                                             # dies between two health checks
    got = httpx.post(r.url + "/v1/completions", json={"prompt": "x"}, timeout=T)
    assert got.status_code == 502 and p.url in got.json()["error"]["message"]
    got = httpx.post(r.url + "/v1/completions", json={"prompt": "x"}, timeout=T)
    assert got.status_code == 503 and "prefill" in got.json()["error"]["message"]


def test_no_healthy_server_is_a_503(stub, router):
    p = stub()
    r = router("--prefill", p.url, "--decode", _dead_url(), "--decode", _dead_url())
    for path in ("/generate", "/v1/chat/completions", "/v1/completions"):
        got = httpx.post(r.url + path, json={"text": "x"}, timeout=T)
        assert got.status_code == 503 and "no healthy decode server" in got.json()["error"]["message"]
    assert httpx.get(r.url + "/v1/models", timeout=T).status_code == 503
    assert httpx.get(r.url + "/health", timeout=T).status_code == 503
    assert p.seen == []
