"""Constrained decoding on a running `sparkserve serve` (tiny random model, whose free output is
never JSON): SGLang's json_schema / regex / ebnf on /generate, OpenAI's response_format through the
real `openai` client on chat (a pydantic model via `chat.completions.parse`, json_object, n=2,
streaming) and completions; every output is checked with jsonschema / re. Bad constraints are 400s
naming the field, and the server keeps serving."""
from __future__ import annotations

import json
import re
from typing import Annotated

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from server_harness import ServerProcess
from tiny_chat_fixtures import make_tiny_chat_checkpoint

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "rank"],
          "properties": {"city": {"type": "string", "maxLength": 6}, "rank": {"type": "integer"}}}
CODE = r"[A-Z]{2}-[0-9]{2,3}"
USER = [{"role": "user", "content": "Where?"}]


class Place(BaseModel):
    city: Annotated[str, Field(max_length=6)]
    rank: Annotated[int, Field(ge=0, le=99)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_chat_checkpoint(str(tmp_path_factory.mktemp("tiny_chat") / "llama"))
    s = ServerProcess("--model-path", path, "--served-model-name", "tiny", "--max-total-tokens", "4096")
    yield s
    s.stop()
    s.remove_log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def _generate(server, text, sp):
    return httpx.post(server.url + "/generate", json={"text": text, "sampling_params": sp}, timeout=120)


def test_generate_json_schema_regex_ebnf(server):
    free = {"temperature": 0, "max_new_tokens": 32}
    alone = _generate(server, ["a", "b"], free).json()
    body = {"text": ["a", "x", "b", "y", "z"], "sampling_params": [
        free, {"json_schema": json.dumps(SCHEMA), "temperature": 1, "seed": 4, "max_new_tokens": 240},
        free, {"regex": CODE, "temperature": 1, "seed": 4, "max_new_tokens": 20},
        {"ebnf": 'root ::= "on" | "off"', "temperature": 0, "max_new_tokens": 20}]}
    mixed = httpx.post(server.url + "/generate", json=body, timeout=120).json()
    assert [mixed[0]["output_ids"], mixed[2]["output_ids"]] == [o["output_ids"] for o in alone]
    jsonschema.validate(json.loads(mixed[1]["text"]), SCHEMA)
    assert mixed[1]["meta_info"]["finish_reason"]["type"] == "stop"
    assert re.fullmatch(CODE, mixed[3]["text"])
    assert mixed[4]["text"] in ("on", "off")
    with pytest.raises(json.JSONDecodeError):
        json.loads(alone[0]["text"])


def test_generate_stream_keeps_the_constraint(server):
    sp = {"regex": CODE, "temperature": 1, "seed": 9, "max_new_tokens": 20}
    body = {"text": "q", "sampling_params": sp, "stream": True}
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[-1]["text"] == _generate(server, "q", sp).json()["text"]
    assert re.fullmatch(CODE, events[-1]["text"])


@pytest.mark.parametrize("sp,field", [({"regex": "a(b"}, "regex"), ({"json_schema": "{x"}, "json_schema"),
                                      ({"json_schema": '{"type": "nope"}'}, "json_schema"),
                                      ({"regex": "a", "ebnf": 'root ::= "a"'}, "regex")])
def test_generate_bad_constraint_is_400(server, sp, field):
    r = _generate(server, "q", sp)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(field), r.text
    assert _generate(server, "q", {"regex": "fine", "max_new_tokens": 8}).json()["text"] == "fine"


def test_chat_parse_pydantic_model(client):
    for seed in range(3):
        done = client.chat.completions.parse(model="tiny", messages=USER, response_format=Place,
                                             temperature=1, seed=seed, max_tokens=220)
        msg = done.choices[0].message
        assert isinstance(msg.parsed, Place)
        jsonschema.validate(json.loads(msg.content), Place.model_json_schema())
        assert done.choices[0].finish_reason == "stop"


def test_chat_json_object_n2_and_stream(client):
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}}
    whole = client.chat.completions.create(model="tiny", messages=USER, response_format=rf, temperature=1,
                                           seed=3, n=2, max_tokens=220)
    assert len(whole.choices) == 2
    for c in whole.choices:
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    one = client.chat.completions.create(model="tiny", messages=USER, response_format=rf, temperature=0,
                                         max_tokens=220)
    chunks = list(client.chat.completions.create(model="tiny", messages=USER, response_format=rf,
                                                 temperature=0, max_tokens=220, stream=True))
    streamed = "".join(ch.delta.content or "" for c in chunks for ch in c.choices)
    assert streamed == one.choices[0].message.content
    jsonschema.validate(json.loads(streamed), SCHEMA)
    # any JSON object: the random model may write one without end; each that ends is an object, and
    # an unfinished one is the start of one (it is never anything else)
    objs = client.chat.completions.create(model="tiny", messages=USER, temperature=1, seed=0, n=6,
                                          max_tokens=220, response_format={"type": "json_object"})
    ended = [c.message.content for c in objs.choices if c.finish_reason == "stop"]
    assert ended and all(isinstance(json.loads(t), dict) for t in ended)
    assert all(c.message.content.lstrip().startswith("{") for c in objs.choices)


def test_completions_response_format(client):
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
    out = client.completions.create(model="tiny", prompt="Answer:", max_tokens=220, temperature=1, seed=1,
                                    extra_body={"response_format": rf})
    jsonschema.validate(json.loads(out.choices[0].text), SCHEMA)
    out = client.completions.create(model="tiny", prompt="Answer:", max_tokens=20, temperature=0,
                                    extra_body={"regex": CODE})
    assert re.fullmatch(CODE, out.choices[0].text)


def test_bad_response_format_is_400(client):
    bad = [{"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "nope"}}},
           {"type": "json_schema"}, {"type": "xml"}]
    for rf in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=USER, response_format=rf, max_tokens=5)
        assert e.value.body["param"] == "response_format", e.value.body
    out = client.chat.completions.create(model="tiny", messages=USER, max_tokens=3, temperature=0)
    assert out.choices[0].message.content is not None
