"""Server controls on the embedded SmolLM2: CORS (--allowed-origins), --request-timeout (an
unfinished request ends with a 504, or a stream's error event, and its KV is freed) and
--enable-priority-scheduling over HTTP (with one request running at a time, a later request of
higher priority is admitted before an earlier one of lower priority)."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from server_harness import ServerProcess

ORIGIN = "http://app.example"
TIMEOUT_S = 6


@pytest.fixture(scope="module")
def server(smollm2_path):
    srv = ServerProcess("--model-path", smollm2_path, "--max-total-tokens", "8192",
                        "--max-running-requests", "1", "--allowed-origins", ORIGIN,
                        "--request-timeout", str(TIMEOUT_S), "--enable-priority-scheduling")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def wait_idle(http: httpx.Client, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while True:
        st = http.get("/server_info").json()["internal_states"][0]
        if st["num_running_reqs"] == 0 and st["num_queue_reqs"] == 0 and st["num_used_tokens"] == 0 \
                and st["inflight_sequences"] == 0:
            return
        assert time.monotonic() < end, f"server not idle: {st}"
        time.sleep(0.1)


def long_body(stream: bool = False, **kw) -> dict:
    return {"text": "Once upon a time", "stream": stream,
            "sampling_params": {"max_new_tokens": 6000, "ignore_eos": True, "temperature": 0}, **kw}


def test_cors_allows_the_listed_origin_only(http):
    pre = http.options("/v1/completions", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                                                   "Access-Control-Request-Headers": "content-type"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ORIGIN
    assert http.get("/v1/models", headers={"Origin": ORIGIN}).headers["access-control-allow-origin"] == ORIGIN
    other = http.get("/v1/models", headers={"Origin": "http://evil.example"})
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers
    refused = http.options("/v1/completions", headers={"Origin": "http://evil.example",
                                                       "Access-Control-Request-Method": "POST"})
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers


def test_request_timeout_is_a_504_and_frees_the_kv(http):
    t0 = time.monotonic()
    r = http.post("/generate", json=long_body())
    took = time.monotonic() - t0
    assert r.status_code == 504, r.text
    assert "--request-timeout" in r.json()["error"]["message"]
    assert TIMEOUT_S - 0.5 < took < TIMEOUT_S + 10
    wait_idle(http)
    with http.stream("POST", "/generate", json=long_body(stream=True)) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == 504 and "--request-timeout" in err["message"]
    assert json.loads(events[-3])["text"]            # it had streamed text before it timed out
    wait_idle(http)
    short = http.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 4}})
    assert short.status_code == 200 and short.json()["meta_info"]["completion_tokens"] == 4


def test_higher_priority_is_admitted_first(http):
    done: dict[str, float] = {}

    def run(name: str, body: dict) -> None:
        http.post("/generate", json=body)
        done[name] = time.monotonic()

    short = {"sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    threads = [threading.Thread(target=run, args=("blocker", long_body(rid="blocker")))]
    threads += [threading.Thread(target=run, args=(name, {"text": name, "priority": p, **short}))
                for name, p in (("low", 1), ("high", 10))]
    threads[0].start()                   # the blocker runs (one request at a time) ...
    for queued, t in enumerate(threads[1:]):     # ... and low, then high, queue behind it
        wait_for(http, lambda st, n=queued: st["num_running_reqs"] == 1 and st["num_queue_reqs"] == n)
        t.start()
    wait_for(http, lambda st: st["num_queue_reqs"] == 2)
    assert http.post("/abort_request", json={"rid": "blocker"}).status_code == 200
    for t in threads:
        t.join(60)
    assert done["high"] < done["low"], done
    wait_idle(http)


def wait_for(http: httpx.Client, cond, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond(st := http.get("/server_info").json()["internal_states"][0]):
        assert time.monotonic() < end, f"not reached: {st}"
        time.sleep(0.02)
