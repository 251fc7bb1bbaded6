"""Constrained decoding through PD disaggregation (tiny chat model, sparkserve's PD router): the
prefill server samples the first token under the grammar, the decode server rebuilds the matcher by
replaying it and goes on under the same constraint. Answers (greedy and seeded sampled) equal a
colocated run and obey their schema / regex."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from pd_fixtures import start_router
from server_harness import ServerProcess, free_port
from tiny_chat_fixtures import make_tiny_chat_checkpoint

T = 60
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["k"],
          "properties": {"k": {"type": "string", "maxLength": 5}}}
CODE = r"[a-z]{3}-[0-9]{3}"


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    path = make_tiny_chat_checkpoint(str(tmp_path_factory.mktemp("tiny_chat") / "llama"))
    port = free_port()
    common = ("--model-path", path, "--max-total-tokens", "2048")
    prefill = ServerProcess(*common, "--disaggregation-mode", "prefill",
                            "--disaggregation-bootstrap-port", str(port))
    decode = ServerProcess(*common, "--disaggregation-mode", "decode",
                           "--disaggregation-bootstrap-port", str(free_port()))
    for s in (prefill, decode):
        s.wait_ready()
    proc, url = start_router("sparkserve-router", prefill, port, decode)
    yield prefill, url
    proc.terminate()
    proc.wait(10)
    for s in (prefill, decode):
        s.stop()
        s.remove_log()


@pytest.mark.parametrize("sp", [
    {"json_schema": json.dumps(SCHEMA), "temperature": 0, "max_new_tokens": 150},
    {"json_schema": json.dumps(SCHEMA), "temperature": 1, "sampling_seed": 3, "max_new_tokens": 150},
    {"regex": CODE, "temperature": 1, "sampling_seed": 8, "max_new_tokens": 20}])
def test_constraint_survives_the_handover(pd, sp):
    prefill, url = pd
    body = {"text": "Go:", "sampling_params": sp}
    want = httpx.post(prefill.url + "/generate", json=body, timeout=T).json()     # colocated
    got = httpx.post(url + "/generate", json=body, timeout=T)
    assert got.status_code == 200, got.text
    got = got.json()
    assert got["output_ids"] == want["output_ids"] and len(got["output_ids"]) > 1
    if "regex" in sp:
        assert re.fullmatch(CODE, got["text"])
    else:
        jsonschema.validate(json.loads(got["text"]), SCHEMA)
