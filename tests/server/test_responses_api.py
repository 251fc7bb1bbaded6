"""OpenAI's Responses API (/v1/responses, stateless) with the real `openai` client on the embedded
SmolLM2: each answer equals the chat completion of the same conversation (greedy), as text, as a
function call (a named tool_choice), and streamed (the deltas add up to the full answer, the
events numbered in order); what a stateless server cannot do is a 400 naming the field."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from conftest import EXACT_FLAGS
from openai.types.responses import Response
from server_harness import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather of a city", "parameters": WEATHER}
CHAT_TOOL = {"type": "function", "function": {k: TOOL[k] for k in ("name", "description", "parameters")}}


@pytest.fixture(scope="module")
def client(smollm2_path):
    srv = ServerProcess("--model-path", smollm2_path, "--max-total-tokens", "8192", *EXACT_FLAGS)
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
    srv.stop()


def chat_text(client, messages, max_tokens):
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content, r


def test_text_answer_equals_chat(client):
    r = client.responses.create(model=MODEL, input="What is the capital of France?", instructions="Be brief.",
                                max_output_tokens=12, temperature=0)
    want, chat = chat_text(client, [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "What is the capital of France?"}], 12)
    Response.model_validate(r.to_dict())        # every field the client's model requires, typed
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == want and r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens


def test_message_items_and_tool_results_equal_chat(client):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Paris", "unit": "C"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "21 degrees, sunny"},
             {"role": "user", "content": "So, should I take an umbrella?"}]
    r = client.responses.create(model=MODEL, input=items, max_output_tokens=16, temperature=0)
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"},
            {"role": "user", "content": "So, should I take an umbrella?"}]
    assert r.output_text == chat_text(client, msgs, 16)[0]


def test_named_tool_choice_is_a_function_call(client):
    kw = dict(model=MODEL, input="What's the weather in Oslo?", temperature=0, max_output_tokens=64)
    r = client.responses.create(tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"}, **kw)
    Response.model_validate(r.to_dict())
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    named = {"type": "function", "function": {"name": "get_weather"}}
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": kw["input"]}],
                                          tools=[CHAT_TOOL], max_tokens=64, temperature=0, tool_choice=named)
    assert calls[0].arguments == chat.choices[0].message.tool_calls[0].function.arguments
    choice = {"type": "function", "name": "get_weather"}
    streamed = list(client.responses.create(tools=[TOOL], tool_choice=choice, stream=True, **kw))
    args = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    assert args == calls[0].arguments
    done = [e for e in streamed if e.type == "response.output_item.done"]
    assert done[-1].item.type == "function_call" and done[-1].item.arguments == args
    assert streamed[-1].response.output[-1].arguments == args


def test_function_tool_fields_reach_the_chat_path():
    """A function tool's `strict` (and name, description, parameters) reach the chat request the
    Responses API is served as: strict asks every call checked under tool_choice auto, or a 400 naming
    it where the tool parser cannot (it was dropped, so silently ignored)."""
    from sparkserve.entrypoints.serving_responses import ResponsesRequest, chat_tools
    for strict in (True, False):
        req = ResponsesRequest(input="hi", tools=[dict(TOOL, strict=strict)], tool_choice="auto")
        assert chat_tools(req) == {"tools": [{"type": "function", "function": dict(CHAT_TOOL["function"],
                                                                                     strict=strict)}],
                                   "tool_choice": "auto"}


def test_stream_adds_up_to_the_full_answer(client):
    kw = dict(model=MODEL, input="Tell me about the sea.", max_output_tokens=20, temperature=0)
    full = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[1].type == "response.in_progress"
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.status == full.status and events[-1].response.output_text == full.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == full.output_text
    assert events[-1].response.usage.output_tokens == full.usage.output_tokens


@pytest.mark.parametrize("kw,param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/i.png"}]}]},
     "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({"tool_choice": {"type": "function"}}, "tool_choice"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text"),
    ({"input": [{"role": "wizard", "content": "hi"}]}, "input"),
])
def test_what_cannot_be_honoured_is_a_400(client, kw, param):
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**body)
    assert e.value.body["param"] == param and param in e.value.body["message"]
    assert client.responses.create(model=MODEL, input="hi", max_output_tokens=2).output_text is not None
