"""`sparkserve serve --tp-size 2`, `--pp-size 2` and DP attention over 2 groups: the OpenAI client
gets the single-process engine's tokens; a killed or hung rank fails the next request with a 5xx
naming the failure and the server exits non-zero instead of hanging."""
from __future__ import annotations

import json
import os
import signal
import time

import httpx
import openai
import pytest
from server_harness import ServerProcess

from sparkserve import Engine

FLAGS = ["--max-total-tokens", "2048", "--chunked-prefill-size", "16", "--dist-timeout", "20"]


DP = ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention"]


@pytest.mark.parametrize("layout,sig", [(["--tp-size", "2"], signal.SIGKILL), (["--pp-size", "2"],
                                                                               signal.SIGKILL),
                                        (["--tp-size", "2"], signal.SIGSTOP), (DP, signal.SIGKILL),
                                        (DP, signal.SIGSTOP)])
def test_parallel_server_serves_and_fails_cleanly(llama_dir, layout, sig):
    """SIGKILL: a dead rank, which the idle server notices by itself; SIGSTOP: a hung one, found by
    the --dist-timeout of 20 s. Under DP attention the other rank drives group 1: its requests
    (round robin: every second one) and the lock-step command to it fail the same way."""
    server = ServerProcess("--model-path", llama_dir, *layout, *FLAGS)
    try:
        prompts = [list(range(3, 9)), list(range(20, 60))]
        want = Engine(llama_dir, num_threads=1, max_total_tokens=2048, chunked_prefill_size=16).generate(
            input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 8, "ignore_eos": True})
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        for p, w in zip(prompts, want):
            r = client.completions.create(model="default", prompt=p, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert r.usage.completion_tokens == 8
            ids = httpx.post(server.url + "/generate", timeout=60, json={
                "input_ids": p, "sampling_params": {"temperature": 0, "max_new_tokens": 8,
                                                    "ignore_eos": True}})
            assert ids.json()["output_ids"] == w["output_ids"]
        info = httpx.get(server.url + "/server_info", timeout=10).json()
        assert (info["tp_size"], info["pp_size"]) == ((2, 1) if "--tp-size" in layout else (1, 2))
        ranks = server.rank_pids(info["scheduler_pid"])
        assert len(ranks) == 1, ranks
        os.kill(ranks[0], sig)
        if sig == signal.SIGKILL:       # a dead rank: the idle server sees it and stops, naming the rank
            assert server.proc.wait(30) != 0
            assert "the scheduler lost a rank: rank 1" in server.log_tail(), server.log_tail()
            return
        time.sleep(0.5)                 # a hung rank: the next request's collective times out
        r = httpx.post(server.url + "/generate", timeout=60, json={
            "input_ids": prompts[0], "sampling_params": {"max_new_tokens": 4}})
        assert r.status_code >= 500 and "scheduler" in r.json()["error"]["message"], r.text
        assert server.proc.wait(60) != 0               # the server stops, non-zero, within the timeout
    finally:
        server.stop()


@pytest.mark.parametrize("layout", [["--tp-size", "2"], DP])
def test_a_rank_killed_mid_stream_ends_the_stream_with_an_error(llama_dir, layout):
    """A rank SIGKILLed while a stream is in flight (stopped first, so the stream cannot finish
    before): the client gets an error event naming the failure, not a stream that stops silently
    or never ends, and the server exits non-zero. Under DP attention either group's stream ends
    so: the MLP runs over both groups' ranks."""
    server = ServerProcess("--model-path", llama_dir, *layout, *FLAGS)
    try:
        info = httpx.get(server.url + "/server_info", timeout=10).json()
        [rank] = server.rank_pids(info["scheduler_pid"])
        os.kill(rank, signal.SIGSTOP)
        body = {"input_ids": list(range(3, 9)), "stream": True,
                "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}}
        with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as s:
            assert s.status_code == 200
            time.sleep(0.5)
            os.kill(rank, signal.SIGKILL)
            start = time.monotonic()
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        assert time.monotonic() - start < 30
        assert events[-1] == "[DONE]" and "error" in json.loads(events[-2]), events[-3:]
        message = json.loads(events[-2])["error"]["message"]
        assert "scheduler" in message, message
        assert server.proc.wait(60) != 0
    finally:
        server.stop()
