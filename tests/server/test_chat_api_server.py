"""The chat controls on a running `sparkserve serve` (tiny random model, --chat-template given
inline, --tool-call-parser, --reasoning-parser) through the real `openai` client: with tools
offered, an answer that makes no call streams to exactly the non-streamed answer, which equals what
/generate writes for the prompt /tokenize renders (greedy); tool_choice required or named makes
even random weights call the tool with arguments that follow its schema (the grammar); a bad
tool_choice is a 400 and the server keeps serving. Calls in a model's own format, streamed and
whole, are in test_chat_tools.py (random weights never write one)."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from conftest import EXACT_FLAGS
from server_harness import ServerProcess
from tiny_chat_fixtures import CHATML, make_tiny_chat_checkpoint

MAX_TOKENS = 12
USER = [{"role": "user", "content": "Hi"}]         # the tiny model's context is 256 (byte) tokens
TOOL = {"type": "function", "function": {"name": "f", "parameters": {}}}
UNIT = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "ok": {"type": "boolean"}},
        "required": ["unit"], "additionalProperties": False}
SET_UNIT = {"type": "function", "function": {"name": "set_unit", "parameters": UNIT}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_chat_checkpoint(str(tmp_path_factory.mktemp("tiny_chat") / "llama"))
    s = ServerProcess("--model-path", path, "--served-model-name", "tiny", "--max-total-tokens", "4096",
                      "--chat-template", "{# inline #}" + CHATML, "--tool-call-parser", "qwen25",
                      "--reasoning-parser", "qwen3", *EXACT_FLAGS)
    yield s
    s.stop()
    s.remove_log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def test_no_call_answer_equals_generate(server, client):
    kw = {"model": "tiny", "messages": USER, "tools": [TOOL], "max_tokens": MAX_TOKENS,
          "temperature": 0}
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = "".join(ch.delta.content or "" for c in chunks for ch in c.choices)
    assert whole.choices[0].message.tool_calls is None
    assert streamed == whole.choices[0].message.content
    prompt = httpx.post(server.url + "/tokenize", json={"messages": USER, "tools": [TOOL]}).json()
    assert prompt["count"] == whole.usage.prompt_tokens
    params = {"max_new_tokens": MAX_TOKENS, "temperature": 0}
    gen = httpx.post(server.url + "/generate", json={"input_ids": prompt["tokens"],
                                                     "sampling_params": params}).json()
    assert gen["text"] == whole.choices[0].message.content
    detok = httpx.post(server.url + "/detokenize", json={"tokens": prompt["tokens"],
                                                         "skip_special_tokens": False}).json()
    assert detok["text"] == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "set_unit"}}])
def test_forced_calls_follow_the_tool_schema(client, choice):
    """At temperature 1 over seeds; one call each (parallel_tool_calls: false), as an unsure model
    may otherwise go on adding calls until max_tokens."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"additionalProperties": False}}},
             SET_UNIT]
    for seed in range(4):
        r = client.chat.completions.create(model="tiny", messages=USER, tools=tools, tool_choice=choice,
                                           temperature=1.0, seed=seed, parallel_tool_calls=False)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None, c
        assert len(c.message.tool_calls) == 1
        for call in c.message.tool_calls:
            if call.function.name == "set_unit":
                jsonschema.validate(json.loads(call.function.arguments), UNIT)
            else:
                assert (call.function.name, json.loads(call.function.arguments)) == ("f", {})


def test_bad_tool_choice_is_400_and_serving_goes_on(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=USER, tools=[TOOL], tool_choice="sometimes")
    assert e.value.body["param"] == "tool_choice"
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=2)
    assert r.choices[0].finish_reason == "length"
