"""Priority preemption on the decode side of a PD pair: a `--disaggregation-mode prefill` and a
`--disaggregation-mode decode` server (tiny Llama, token ids) behind `sparkserve router`, both with
--enable-priority-scheduling, the decode server's pool too small for a long low-priority request's
sequence and a high-priority request's 100-token prompt together. The high one's reservation
preempts the running low one on the decode server (before, it waited in the decode server's
queue until the long one finished): it finishes first, and the low one resumes there (its prompt
and output recomputed on the decode server) with the tokens it gives alone, greedy or seeded
sampled (its generator goes on where it stood). No KV slot stays held on either server."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from pd_fixtures import start_router
from server_harness import ServerProcess, free_port

T = 120
LOW_IDS, LOW_TOKENS = list(range(5, 13)), 120
HIGH = {"input_ids": list(range(100, 200)), "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                                 "ignore_eos": True}, "priority": 20}
DECODE_POOL = 140        # holds the low request (128) or the high one (104), not both at once


@pytest.fixture(scope="module")
def pd(tiny_dirs):
    port = free_port()
    common = ("--model-path", tiny_dirs["llama"], "--skip-tokenizer-init", "--enable-priority-scheduling",
              "--log-level", "info")
    prefill = ServerProcess(*common, "--max-total-tokens", "1024", "--disaggregation-mode", "prefill",
                            "--disaggregation-bootstrap-port", str(port))
    decode = ServerProcess(*common, "--max-total-tokens", str(DECODE_POOL), "--disaggregation-mode", "decode",
                           "--disaggregation-bootstrap-port", str(free_port()))
    for s in (prefill, decode):
        s.wait_ready()
    proc, url = start_router("sparkserve-router", prefill, port, decode)
    yield prefill, decode, url
    proc.terminate()
    proc.wait(10)
    for s in (prefill, decode):
        s.stop()
        s.remove_log()


def _state(server: ServerProcess) -> dict:
    return httpx.get(server.url + "/server_info", timeout=T).json()["internal_states"][0]


def _low(sp: dict) -> dict:
    return {"input_ids": LOW_IDS, "priority": 0,
            "sampling_params": {"max_new_tokens": LOW_TOKENS, "ignore_eos": True, **sp}}


@pytest.mark.parametrize("sp", [{"temperature": 0}, {"temperature": 1.0, "top_p": 0.9, "sampling_seed": 7}],
                         ids=["greedy", "seeded"])
def test_a_high_priority_request_preempts_on_the_decode_server(pd, sp):
    prefill, decode, url = pd
    alone = httpx.post(url + "/generate", json=_low(sp), timeout=T)
    assert alone.status_code == 200, alone.text
    alone = alone.json()["output_ids"]
    assert len(alone) == LOW_TOKENS
    before = _state(decode)["num_preemptions"]
    done: dict[str, float] = {}
    high: dict = {}

    def send_high() -> None:
        r = httpx.post(url + "/generate", json=HIGH, timeout=T)
        high.update(r.json())
        done["high"] = time.monotonic()
    sender, ids = None, []
    with httpx.stream("POST", url + "/generate", json={**_low(sp), "stream": True}, timeout=T) as s:
        for line in s.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "output_ids" in chunk, chunk
            ids = chunk["output_ids"]                        # cumulative
            if sender is None and len(ids) >= 40:            # the decode pool can no longer hold both
                sender = threading.Thread(target=send_high)
                sender.start()
    done["low"] = time.monotonic()
    sender.join(T)
    assert ids == alone                                      # resumed where it stopped, same tokens
    assert len(high["output_ids"]) == 4
    assert done["high"] < done["low"]                        # it did not wait for the long one
    state = _state(decode)
    assert state["num_preemptions"] == before + 1, state
    for server in (prefill, decode):                         # every slot free or only cached
        assert _state(server)["num_used_tokens"] == 0
