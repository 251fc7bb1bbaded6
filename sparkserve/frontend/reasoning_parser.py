"""Reasoning models' thinking, `<think>...</think>`, apart from the answer (SGLang's
--reasoning-parser names). deepseek-r1: the chat template opens `<think>` itself, so everything
before `</think>` is reasoning, a `<think>` the model writes again included or not. qwen3: only
an answer that starts with `<think>` reasons. An output cut before `</think>` is all reasoning.
Both parts lose their leading whitespace (the newlines around the tags), in whole and streamed
answers alike."""
from __future__ import annotations

from dataclasses import dataclass

from sparkserve.frontend.tool_parsers.base import held_back


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    opened_by_template: bool            # the prompt ends inside <think>
    start: str = "<think>"
    end: str = "</think>"

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


REASONING_PARSERS = {p.name: p for p in (ReasoningParser("deepseek-r1", opened_by_template=True),
                                        ReasoningParser("qwen3", opened_by_template=False))}
