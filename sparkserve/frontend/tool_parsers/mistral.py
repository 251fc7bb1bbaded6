"""Mistral tool calls: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (a JSON array of
the parallel calls after the marker); text before the marker is content."""
from __future__ import annotations

import json

from sparkserve.frontend.tool_parsers.base import Split, ToolParser, held_back, objects_array

TAG = "[TOOL_CALLS]"


class MistralParser(ToolParser):
    name = "mistral"
    skip_special_tokens = False          # [TOOL_CALLS] is a special token
    parallel_structures = False          # parallel calls share one array after one marker

    def structure(self, name: str) -> tuple[str, str, str]:
        return TAG, f'{TAG} [{{"name": {json.dumps(name)}, "arguments": ', "}]"

    def split(self, text: str, final: bool) -> Split:
        i = text.find(TAG)
        if i < 0:
            return Split(text if final else text[:len(text) - held_back(text, TAG)], None)
        payload = text[i + len(TAG):].strip().removesuffix("</s>")
        return Split(text[:i], payload if payload.startswith("[") else objects_array(payload))
