"""DSpark under a grammar on a running `sparkserve serve` (the embedded SmolLM2 and the draft shipped
for it, the draft proposing under each request's grammar): greedy response_format json_schema
answers through the real `openai` client equal plain constrained decoding (an in-process Engine
without speculation) and validate against the schema, and the requests speculated (drafts
accepted, as /generate's meta_info counts them)."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from server_harness import ServerProcess

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}}}
WHO = ("Alice, 30, from Paris", "Bob, 41, from Rome", "Chen, 25, from Lima")
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--max-total-tokens", "4096", "--speculative-algorithm", "DSPARK",
                      "--speculative-dspark-verify-mode", "full")
    yield s
    s.stop()
    s.remove_log()


def test_dspark_constrained_equals_plain(server):
    from sparkserve import Engine
    plain = Engine(max_total_tokens=4096, max_running_requests=4)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)
    accepted = 0
    for who in WHO:
        msgs = [{"role": "user", "content": f"Describe {who} as JSON."}]
        ref = plain.generate(messages=msgs, sampling_params={"json_schema": json.dumps(PERSON),
                                                             "temperature": 0, "max_new_tokens": 48})
        r = client.chat.completions.create(model="default", messages=msgs, response_format=FORMAT,
                                           temperature=0, max_tokens=48)
        assert r.choices[0].message.content == ref["text"]
        if r.choices[0].finish_reason == "stop":
            jsonschema.validate(json.loads(ref["text"]), PERSON)
        ids = plain.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
        g = httpx.post(server.url + "/generate", timeout=300, json={"input_ids": plain.tokenizer.encode(ids),
                       "sampling_params": {"json_schema": json.dumps(PERSON), "temperature": 0,
                                           "max_new_tokens": 48}}).json()
        assert g["output_ids"] == ref["output_ids"]
        assert g["meta_info"]["spec_verify_ct"] > 0
        accepted += g["meta_info"]["spec_accept_token_num"]
    assert accepted > 0
