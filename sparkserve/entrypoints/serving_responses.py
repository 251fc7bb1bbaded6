"""OpenAI's Responses API (`/v1/responses`), stateless: a request is mapped onto a chat completion
(`input` as messages, `instructions` as the system message, function `tools`, `text.format` as
response_format) and the chat answer is read back as Responses output items (message, reasoning,
function_call). What a stateless server cannot honour (stored responses, conversations,
background runs, built-in tools) is a 400 naming the field."""
from __future__ import annotations

import time
from typing import Any, AsyncIterator

from pydantic import ValidationError

from sparkserve.entrypoints.openai_protocol import (
    ApiError,
    ChatCompletionRequest,
    Number,
    Objects,
    _Request,
    short_repr,
)
from sparkserve.entrypoints.responses_stream import (
    ResponseEvents,
    call_item,
    message_item,
    reasoning_item,
    response_usage,
)
from sparkserve.entrypoints.serving_base import new_id
from sparkserve.entrypoints.serving_openai import ServingChat
from sparkserve.entrypoints.tokenizer_manager import Submission
from sparkserve.messages import GenerateReq

TEXT_PARTS = ("input_text", "output_text", "text")
ROLES = ("user", "system", "developer", "assistant")


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | Objects
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    tools: Objects | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    stream: bool = False
    user: str | None = None
    metadata: dict[str, str] | None = None
    # what a stateless server cannot do: refused when set (REFUSED)
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    prompt: dict[str, Any] | None = None


# chat fields an error may name -> the Responses field they come from
CHAT_FIELDS = {"messages": "input", "max_completion_tokens": "max_output_tokens",
               "max_tokens": "max_output_tokens", "response_format": "text"}

# field -> (is it set to something this server cannot honour?, why)
REFUSED = {
    "store": (lambda v: v is True, "this server keeps no responses (send store: false, or leave it out)"),
    "previous_response_id": (lambda v: v is not None, "this server keeps no responses: send the whole "
                                                      "conversation as input"),
    "conversation": (lambda v: v is not None, "this server keeps no conversations: send them as input"),
    "background": (lambda v: v is True, "background responses are not supported"),
    "include": (lambda v: bool(v), "no extra output data is available"),
    "reasoning": (lambda v: v is not None, "reasoning effort is not configurable (see --reasoning-parser)"),
    "truncation": (lambda v: v not in (None, "disabled"), "inputs are never truncated"),
    "max_tool_calls": (lambda v: v is not None, "not supported; use tool_choice / parallel_tool_calls"),
    "top_logprobs": (lambda v: v is not None, "not supported on /v1/responses (use chat completions)"),
    "prompt": (lambda v: v is not None, "stored prompt templates are not supported"),
}


def input_messages(req: ResponsesRequest) -> list[dict]:
    """The chat messages of `instructions` + `input` (message items, function calls and their
    outputs; reasoning items are dropped, as chat templates drop earlier thinking)."""
    msgs: list[dict] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input.{i}"
        if kind == "message":
            if item.get("role") not in ROLES:
                raise ApiError(400, f"{where}.role: {short_repr(item.get('role'))} is not one of "
                                    f"{', '.join(ROLES)}", "input")
            msgs.append({"role": item["role"], "content": item_text(item.get("content"), where)})
        elif kind == "function_call":
            fn = {"name": field(item, "name", where), "arguments": field(item, "arguments", where)}
            call = {"id": field(item, "call_id", where), "type": "function", "function": fn}
            if msgs and msgs[-1]["role"] == "assistant" and msgs[-1].get("tool_calls") is not None:
                msgs[-1]["tool_calls"].append(call)          # parallel calls: one assistant turn
            else:
                # content "": templates that read an assistant turn's content refuse a None one
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            msgs.append({"role": "tool", "tool_call_id": field(item, "call_id", where),
                         "content": item_text(item.get("output"), where)})
        elif kind != "reasoning":
            raise ApiError(400, f"{where}.type: {short_repr(kind)} is not supported (message, function_call, "
                                "function_call_output, reasoning)", "input")
    return msgs


def field(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise ApiError(400, f"{where}.{name}: must be a string, got {short_repr(value)}", "input")
    return value


def item_text(content: Any, where: str) -> str:
    """A message's content: a string, or text parts (input_text / output_text) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content: must be a string or a list of text parts", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if not isinstance(part, dict) or kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ApiError(400, f"{where}.content.{j}: only text parts are supported "
                                f"({', '.join(TEXT_PARTS)}), got {short_repr(kind)}", "input")
        texts.append(part["text"])
    return "".join(texts)


def chat_tools(req: ResponsesRequest) -> dict:
    """tools / tool_choice in the chat shapes (function tools only)."""
    out: dict[str, Any] = {}
    if req.tools:
        tools = []
        for i, t in enumerate(req.tools):
            if t.get("type") != "function" or not isinstance(t.get("name"), str):
                raise ApiError(400, f"tools.{i}: only function tools (type function, with a name) are "
                                    f"supported, got type {short_repr(t.get('type'))}", "tools")
            fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
            tools.append({"type": "function", "function": fn})
        out["tools"] = tools
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise ApiError(400, f"tool_choice: a function choice is {{type: function, name}}, got "
                                f"{short_repr(choice)}", "tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        out["tool_choice"] = choice
    return out


def response_format(text: dict | None) -> dict | None:
    """text.format (text, json_object, json_schema with name / schema / strict) as chat's response_format."""
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise ApiError(400, f"text.format: must be an object, got {short_repr(fmt)}", "text")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    return fmt


class ServingResponses:
    def __init__(self, chat: ServingChat):
        self.chat = chat

    def build(self, req: ResponsesRequest, rid: str) -> tuple[ChatCompletionRequest, list[GenerateReq]]:
        for name, (refused, why) in REFUSED.items():
            if refused(getattr(req, name)):
                raise ApiError(400, f"{name}: {why}", name)
        body = {"model": req.model, "messages": input_messages(req), "max_completion_tokens":
                req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
                "parallel_tool_calls": req.parallel_tool_calls, "response_format": response_format(req.text),
                "user": req.user, **chat_tools(req)}
        try:
            chat_req = ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
            return chat_req, self.chat.build(chat_req, rid)
        except ValidationError as e:
            raise responses_error(ApiError.from_validation(e)) from None
        except ApiError as e:
            raise responses_error(e) from None

    def response(self, req: ResponsesRequest, rid: str, created: int, output: list[dict], status: str,
                 usage: dict | None = None) -> dict:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": rid, "object": "response", "created_at": created, "status": status, "model":
                self.chat.served_name, "output": output, "instructions": req.instructions, "error": None,
                "incomplete_details": incomplete, "max_output_tokens": req.max_output_tokens,
                "temperature": req.temperature, "top_p": req.top_p, "tools": req.tools or [],
                "tool_choice": req.tool_choice or "auto", "parallel_tool_calls": req.parallel_tool_calls,
                "text": req.text or {"format": {"type": "text"}}, "metadata": req.metadata or {},
                "store": False, "usage": None if usage is None else response_usage(usage)}

    async def full(self, req: ResponsesRequest, chat_req: ChatCompletionRequest, rid: str,
                   seqs: list[GenerateReq], sub: Submission) -> dict:
        answer = await self.chat.full(chat_req, rid, seqs, sub)
        choice = answer["choices"][0]
        msg = choice["message"]
        output = []
        if msg.get("reasoning_content"):
            output.append(reasoning_item(new_id("rs_"), msg["reasoning_content"]))
        if msg.get("content"):
            output.append(message_item(new_id("msg_"), msg["content"]))
        output += [call_item(c["id"], c["function"]["name"], c["function"]["arguments"])
                   for c in msg.get("tool_calls") or []]
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        return self.response(req, rid, answer["created"], output, status, answer["usage"])

    async def stream(self, req: ResponsesRequest, chat_req: ChatCompletionRequest, rid: str,
                     seqs: list[GenerateReq], sub: Submission) -> AsyncIterator[str]:
        events = ResponseEvents(lambda output, status, usage=None: self.response(
            req, rid, int(time.time()), output, status, usage))
        for e in events.start():
            yield e
        state: dict[int, Any] = {}
        async for event in self.chat.events(sub, seqs, True):
            if isinstance(event, dict):                         # usage, last
                for e in events.finish(event):
                    yield e
                continue
            for choice in self.chat.stream_choices(chat_req, event, state):
                for e in events.choice(choice):
                    yield e



def responses_error(e: ApiError) -> ApiError:
    """A chat-path error named after the Responses field it comes from (max_tokens -> max_output_tokens)."""
    name = CHAT_FIELDS.get(e.param or "")
    if name is None:
        return e
    message = name + e.message[len(e.param):] if e.message.startswith(e.param) else e.message
    return ApiError(e.status, message, name, e.headers)
