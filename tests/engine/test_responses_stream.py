"""The Responses stream built from chat stream choices (reasoning, content, two parallel tool calls
in fragments): the events parse as the `openai` client's event types, the deltas of each item add
up to the item its output_item.done and the final response carry, output indexes follow the items'
order and sequence numbers count from 0."""
from __future__ import annotations

import json

from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from sparkserve.entrypoints.responses_stream import ResponseEvents, response_usage

CHOICES = [
    {"delta": {"role": "assistant", "content": ""}},
    {"delta": {"reasoning_content": "The user wants "}}, {"delta": {"reasoning_content": "weather."}},
    {"delta": {"content": "Let me "}}, {"delta": {"content": "check."}},
    {"delta": {"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                               "function": {"name": "get_weather", "arguments": ""}}]}},
    {"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}},
    {"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}},
    {"delta": {"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                               "function": {"name": "get_time", "arguments": "{}"}}]}},
    {"delta": {}, "finish_reason": "tool_calls"},
]


def snapshot(output, status, usage=None):
    return {"id": "resp_1", "object": "response", "created_at": 0, "status": status, "model": "m",
            "output": output, "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
            "usage": None if usage is None else response_usage(usage)}


def test_chat_deltas_become_response_events():
    ev = ResponseEvents(snapshot)
    lines = ev.start() + [e for c in CHOICES for e in ev.choice(c)]
    lines += ev.finish({"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14})
    adapter = TypeAdapter(ResponseStreamEvent)
    events = [adapter.validate_python(json.loads(line.removeprefix("data: "))) for line in lines]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1]
    assert final.type == "response.completed" and final.response.usage.total_tokens == 14
    out = final.response.output
    assert [o.type for o in out] == ["reasoning", "message", "function_call", "function_call"]
    deltas: dict[int, str] = {}
    for e in events:
        if e.type in ("response.reasoning_text.delta", "response.output_text.delta",
                      "response.function_call_arguments.delta"):
            deltas[e.output_index] = deltas.get(e.output_index, "") + e.delta
    assert deltas == {0: "The user wants weather.", 1: "Let me check.", 2: '{"city": "Oslo"}', 3: "{}"}
    assert out[0].content[0].text == deltas[0] and out[1].content[0].text == deltas[1]
    assert [(o.call_id, o.name, o.arguments) for o in out[2:]] == [("call_a", "get_weather", deltas[2]),
                                                                   ("call_b", "get_time", deltas[3])]
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    done = [e for e in events if e.type == "response.output_item.done"]
    assert added == [0, 1, 2, 3] and [e.output_index for e in done] == added
    assert [e.item.model_dump() for e in done] == [o.model_dump() for o in out]
