"""Priority preemption over HTTP (`sparkserve serve --enable-priority-scheduling`, one running slot,
the embedded SmolLM2): a long low-priority completion streams through the real openai client; a
high-priority one arriving meanwhile preempts it, finishes first, and the long one resumes. Its
streamed deltas join to exactly the text it gives alone, unpreempted (greedy): no token lost or sent
twice. With --disable-priority-preemption the high-priority one waits for the long one."""
from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from server_harness import ServerProcess

LONG = {"prompt": "Once upon a time", "max_tokens": 160, "temperature": 0}
SHORT = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}


def serve(smollm2_path, *flags: str) -> ServerProcess:
    return ServerProcess("--model-path", smollm2_path, "--max-total-tokens", "4096", "--max-running-requests",
                         "1", "--enable-priority-scheduling", *flags)


@pytest.fixture(scope="module", params=[(), ("--disable-priority-preemption",)], ids=["preempt", "off"])
def server(request, smollm2_path):
    srv = serve(smollm2_path, *request.param)
    yield srv, not request.param
    srv.stop()


def test_high_priority_preempts_a_streaming_low_priority_one(server):
    srv, preempts = server
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    alone = client.completions.create(model=model, **LONG, extra_body={"ignore_eos": True}).choices[0].text
    done: dict[str, float] = {}

    def high() -> None:
        client.completions.create(model=model, **SHORT, extra_body={"priority": 50})
        done["high"] = time.monotonic()
    deltas, started = [], None
    stream = client.completions.create(model=model, stream=True, **LONG,
                                       extra_body={"ignore_eos": True, "priority": 0})
    for chunk in stream:
        deltas.append(chunk.choices[0].text if chunk.choices else "")
        if len(deltas) == 8:
            started = threading.Thread(target=high)
            started.start()
    done["low"] = time.monotonic()
    started.join(120)
    assert "".join(deltas) == alone                      # one continuous, correct stream
    state = httpx.get(srv.url + "/server_info").json()["internal_states"][0]
    assert (state["num_preemptions"] > 0) == preempts, state
    assert (done["high"] < done["low"]) == preempts, done
