"""The Responses API's output items and its stream: a chat stream's deltas (reasoning_content,
content, tool_calls fragments) become Responses events (output_item.added, output_text.delta,
reasoning_text.delta, function_call_arguments.delta, ... .done, response.completed), each with its
sequence_number. An item is closed when an item of another kind opens, and every open one at the end."""
from __future__ import annotations

from typing import Callable

from sparkserve.entrypoints.serving_base import new_id, sse


def response_usage(u: dict) -> dict:
    """Chat usage in the Responses shape."""
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
            "total_tokens": u["total_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [] if text is None else [text_part(text)]}


def reasoning_item(item_id: str, text: str | None) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [] if text is None else [{"type": "reasoning_text", "text": text}]}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": "fc_" + call_id.removeprefix("call_"), "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}


class ResponseEvents:
    """One response's stream; `snapshot(output, status, usage=None)` is the response object."""

    def __init__(self, snapshot: Callable[..., dict]):
        self.snapshot = snapshot
        self.seq = 0
        self.items: list[dict] = []        # output items, finished or not, in output order
        self.texts: list[str] = []         # each item's text (message, reasoning) or arguments
        self.open: dict[str | int, int] = {}    # "message" / "reasoning" / call index -> output index
        self.finish_reason: str | None = None

    def event(self, kind: str, **body) -> str:
        self.seq += 1
        return sse({"type": kind, "sequence_number": self.seq - 1, **body})

    def start(self) -> list[str]:
        resp = self.snapshot([], "in_progress")
        return [self.event("response.created", response=resp),
                self.event("response.in_progress", response=resp)]

    def choice(self, choice: dict) -> list[str]:
        """The events of one chat stream choice (a delta, or the finish)."""
        out: list[str] = []
        delta = choice.get("delta") or {}
        for key, kind in (("reasoning_content", "reasoning"), ("content", "message")):
            if delta.get(key):
                out += self._text(kind, delta[key])
        for call in delta.get("tool_calls") or []:
            out += self._call(call)
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
        return out

    def finish(self, usage: dict) -> list[str]:
        out = self._close_all()
        status = "incomplete" if self.finish_reason == "length" else "completed"
        return out + [self.event(f"response.{status}", response=self.snapshot(self.items, status, usage))]

    # ---- items ------------------------------------------------------------------------------
    def _open(self, key: str | int, item: dict) -> list[str]:
        out = self._close_all()
        self.open[key] = len(self.items)
        self.items.append(item)
        self.texts.append("")
        i = self.open[key]
        out.append(self.event("response.output_item.added", output_index=i, item=item))
        if item["type"] == "message":
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=i,
                                  content_index=0, part=text_part("")))
        return out

    def _text(self, kind: str, piece: str) -> list[str]:
        out = [] if kind in self.open else self._open(
            kind, message_item(new_id("msg_"), None, "in_progress") if kind == "message"
            else reasoning_item(new_id("rs_"), None))
        i = self.open[kind]
        self.texts[i] += piece
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        return out + [self.event(name, item_id=self.items[i]["id"], output_index=i, content_index=0,
                                 delta=piece, **extra)]

    def _call(self, call: dict) -> list[str]:
        key = call.get("index", 0)
        fn = call.get("function") or {}
        if key not in self.open:
            out = self._open(key, call_item(call["id"], fn["name"], "", "in_progress"))
        else:
            out = []
        i = self.open[key]
        piece = fn.get("arguments") or ""
        if not piece:
            return out
        self.texts[i] += piece
        return out + [self.event("response.function_call_arguments.delta", item_id=self.items[i]["id"],
                                 output_index=i, delta=piece)]

    def _close_all(self) -> list[str]:
        out: list[str] = []
        for i in sorted(self.open.values()):
            item, text = self.items[i], self.texts[i]
            if item["type"] == "message":
                out.append(self.event("response.output_text.done", item_id=item["id"], output_index=i,
                                      content_index=0, text=text, logprobs=[]))
                out.append(self.event("response.content_part.done", item_id=item["id"], output_index=i,
                                      content_index=0, part=text_part(text)))
                item.update(content=[text_part(text)], status="completed")
            elif item["type"] == "reasoning":
                out.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=i,
                                      content_index=0, text=text))
                item.update(content=[{"type": "reasoning_text", "text": text}])
            else:
                out.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=i, arguments=text))
                item.update(arguments=text, status="completed")
            out.append(self.event("response.output_item.done", output_index=i, item=item))
        self.open.clear()
        return out
