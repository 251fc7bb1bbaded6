"""Reasoning models' thinking apart from the answer (SGLang's --reasoning-parser names).
`<think>...</think>`: deepseek-r1's chat template opens `<think>` itself, so everything before
`</think>` is reasoning, a `<think>` the model writes again included or not; qwen3: only an answer
that starts with `<think>` reasons. An output cut before `</think>` is all reasoning. Both parts
lose their leading whitespace (the newlines around the tags), in whole and streamed answers alike.
gpt-oss (harmony): the `analysis` channel's messages are reasoning, the others' (`final`,
`commentary`) content; its markers are special tokens, so the answer keeps them to be read."""
from __future__ import annotations

import re
from dataclasses import dataclass

from sparkserve.frontend.tool_parsers.base import held_back


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    opened_by_template: bool            # the prompt ends inside <think>
    start: str = "<think>"
    end: str = "</think>"
    skip_special_tokens = True

    def split(self, text: str, final: bool) -> tuple[str | None, str]:
        """(reasoning, content); reasoning None when the answer does not reason. Not `final`
        (streaming): what may still change (a tag arriving, leading whitespace) is left out."""
        body = text.lstrip()
        if body.startswith(self.start):
            body = body[len(self.start):]
        elif not final and self.start.startswith(body):
            return ("" if self.opened_by_template else None), ""       # the tag may be arriving
        elif not self.opened_by_template:
            return None, text
        j = body.find(self.end)
        if j < 0:
            reasoning = body if final else body[:len(body) - held_back(body, self.end)]
            return reasoning.lstrip(), ""
        return body[:j].lstrip(), body[j + len(self.end):].lstrip()

    def thought(self, text: str, content: str) -> bool:
        """Whether the reasoning of `text` (split into `content`) is whole: its end tag came."""
        return self.end in text


CHANNEL, MESSAGE = "<|channel|>", "<|message|>"
MESSAGE_ENDS = ("<|end|>", "<|return|>", "<|call|>")


RECIPIENT = re.compile(r"to=(functions\.[^\s<]+)")


class HarmonyReasoningParser:
    """gpt-oss: `<|channel|>NAME<|message|>BODY<|end|>` messages (the next one after
    `<|start|>assistant`); text outside any message is content when no channel ever opens. A
    message to a function (`to=functions.NAME` in its header) stays in the content as
    `<|channel|>commentary to=functions.NAME<|message|>ARGS<|call|>`, for the gpt-oss tool parser."""
    name = "gpt-oss"
    skip_special_tokens = False

    def split(self, text: str, final: bool) -> tuple[str | None, str]:
        reasoning: list[str] | None = None
        content: list[str] = []
        pos = 0
        if CHANNEL not in text:
            held = 0 if final else max(held_back(text, m) for m in (CHANNEL, "<|start|>"))
            return None, text[:len(text) - held]
        while True:
            c = text.find(CHANNEL, pos)
            m = text.find(MESSAGE, c) if c >= 0 else -1
            if m < 0:
                break                                   # no further message, or its header unfinished
            header = text[c + len(CHANNEL):m]
            channel = header.split(" ", 1)[0].strip()
            to = RECIPIENT.search(text[pos:c] + " " + header)
            start = m + len(MESSAGE)
            ends = [(i, e) for e in MESSAGE_ENDS if (i := text.find(e, start)) >= 0]
            stop, marker = min(ends) if ends else (len(text), "")
            body = text[start:stop]
            if not ends and not final:
                body = body[:len(body) - max(held_back(body, e) for e in MESSAGE_ENDS)]
            if to is not None:
                content.append(f"{CHANNEL}commentary to={to.group(1)}{MESSAGE}{body}{marker}")
            elif channel == "analysis":
                reasoning = (reasoning or []) + [body]
            else:
                content.append(body)
            if not ends:
                break
            pos = stop + len(marker)
        return ("".join(reasoning) if reasoning is not None else None), "".join(content)

    def thought(self, text: str, content: str) -> bool:
        """Whether the reasoning is whole: a message on another channel began."""
        return bool(content)


REASONING_PARSERS = {p.name: p for p in (ReasoningParser("deepseek-r1", opened_by_template=True),
                                        ReasoningParser("qwen3", opened_by_template=False),
                                        HarmonyReasoningParser())}
