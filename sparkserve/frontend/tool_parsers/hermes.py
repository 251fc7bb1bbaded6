"""Hermes / Qwen2.5 tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one
block per call (parallel calls are several blocks), text around them is content."""
from __future__ import annotations

import json

from sparkserve.frontend.tool_parsers.base import Split, ToolParser, held_back

START, END = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"

    def structure(self, name: str) -> tuple[str, str, str]:
        return START, f'{START}\n{{"name": {json.dumps(name)}, "arguments": ', "}\n" + END

    def split(self, text: str, final: bool) -> Split:
        outside, bodies, pos, closed = [], [], 0, True
        while True:
            i = text.find(START, pos)
            if i < 0:
                rest = text[pos:]
                outside.append(rest if final else rest[:len(rest) - held_back(rest, START)])
                break
            outside.append(text[pos:i])
            j = text.find(END, i + len(START))
            if j < 0:
                body = text[i + len(START):]
                bodies.append((body if final else body[:len(body) - held_back(body, END)]).strip())
                closed = False
                break
            bodies.append(text[i + len(START):j].strip())
            pos = j + len(END)
        if not bodies:
            return Split("".join(outside), None)
        # a block left open at the end counts when its JSON is whole (a stop string may cut the tag)
        close = "]" if closed or final else ""
        return Split("".join(outside), "[" + ",".join(bodies) + close)


class Qwen25Parser(HermesParser):
    name = "qwen25"
