"""A chat answer's text as OpenAI's assistant message: reasoning apart (reasoning_parser.py), then
tool calls out of the rest (tool_parsers/), whole or streamed. Streaming keeps the text so far
and, at each step, sends how each part grew (the reasoning, without stream_reasoning, only once
it is whole)."""
from __future__ import annotations

from dataclasses import dataclass, field

from sparkserve.frontend.reasoning_parser import HarmonyReasoningParser, ReasoningParser
from sparkserve.frontend.tool_parsers import ToolCall, ToolParser, ToolStream
from sparkserve.frontend.tool_parsers.base import new_call_id


@dataclass
class ChatOutput:
    reasoning: str | None
    content: str | None
    calls: list[ToolCall] = field(default_factory=list)

    def message(self, with_reasoning: bool) -> dict:
        msg: dict = {"role": "assistant", "content": self.content}
        if with_reasoning:
            msg["reasoning_content"] = self.reasoning
        if self.calls:
            msg["tool_calls"] = [{"id": new_call_id(), "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in self.calls]
        return msg


@dataclass(frozen=True)
class ChatOutputParser:
    reasoning: ReasoningParser | HarmonyReasoningParser | None
    tools: ToolParser | None
    max_calls: int | None = None            # parallel_tool_calls: false -> 1 (later calls dropped)
    # SGLang's stream_reasoning: False holds the reasoning back and sends it in one delta once
    # it is whole (its end tag came, or the answer ended)
    stream_reasoning: bool = True

    def parse(self, text: str) -> ChatOutput:
        reasoning, content = self.reasoning.split(text, final=True) if self.reasoning else (None, text)
        if self.tools is None:
            return ChatOutput(reasoning, content)
        content_, calls = self.tools.parse(content)
        return ChatOutput(reasoning, content_, calls[:self.max_calls])

    def stream(self) -> "ChatOutputStream":
        return ChatOutputStream(self)


class ChatOutputStream:
    """One streamed choice: feed() each text delta; returns the chunk's `delta` fields."""

    def __init__(self, parser: ChatOutputParser):
        self.parser = parser
        self.text = ""
        self.reasoning_sent = ""
        self.content_sent = ""
        self.tools = ToolStream(parser.tools, parser.max_calls) if parser.tools else None

    @property
    def made_calls(self) -> bool:
        return self.tools is not None and self.tools.made_calls

    def feed(self, delta: str, final: bool) -> dict:
        self.text += delta
        out: dict = {}
        if self.parser.reasoning:
            reasoning, content = self.parser.reasoning.split(self.text, final)
        else:
            reasoning, content = None, self.text
        sent = self.reasoning_sent
        whole = final or bool(reasoning) and self.parser.reasoning.thought(self.text, content)
        if reasoning and (self.parser.stream_reasoning or whole) and reasoning.startswith(sent) \
                and len(reasoning) > len(sent):
            out["reasoning_content"], self.reasoning_sent = reasoning[len(sent):], reasoning
        if self.tools is not None:
            text, calls = self.tools.finish(content) if final else self.tools.feed(content)
        else:
            text, calls = self._content(content), []
        if text:
            out["content"] = text
        if calls:
            out["tool_calls"] = calls
        return out

    def _content(self, content: str) -> str:
        if not content.startswith(self.content_sent):
            return ""
        delta, self.content_sent = content[len(self.content_sent):], content
        return delta
