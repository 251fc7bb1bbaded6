"""Llama 3.1/3.2 JSON tool calls: `{"name": ..., "parameters": {...}}`, after `<|python_tag|>` or
as the whole answer, several separated by `;`. Text before the tag is content; an answer that
does not start with `{` (or whose JSON is no call) is plain content."""
from __future__ import annotations

import json

from sparkserve.frontend.tool_parsers.base import Split, ToolParser, held_back, objects_array

TAG = "<|python_tag|>"
END_TOKENS = ("<|eom_id|>", "<|eot_id|>")


class Llama3Parser(ToolParser):
    name = "llama3"
    skip_special_tokens = False          # <|python_tag|> is a special token

    def structure(self, name: str) -> tuple[str, str, str]:
        return TAG, f'{TAG}{{"name": {json.dumps(name)}, "parameters": ', "}"

    def split(self, text: str, final: bool) -> Split:
        i = text.find(TAG)
        if i >= 0:
            content, payload = text[:i], text[i + len(TAG):]
        elif text.lstrip().startswith("{"):
            content, payload = "", text
        elif final:
            return Split(text, None)
        elif not text.strip():
            return Split("", None)        # a call may still begin
        else:
            return Split(text[:len(text) - held_back(text, TAG)], None)
        payload = payload.rstrip()
        for end in END_TOKENS:
            payload = payload.removesuffix(end)
        return Split(content, objects_array(payload))
