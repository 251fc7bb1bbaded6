"""Tool calls in a model's text, whatever the format: a format (one small file each) only says
where its calls are (`ToolParser.split`); this module makes OpenAI's tool calls of that, whole
(`ToolParser.parse`) or as stream deltas (`ToolStream`).

Streaming re-reads the text so far at each step and sends what grew: content outside the calls
(minus an end that may be a marker arriving), a call's id and name once its name is complete, then
the part of its arguments that can no longer change. partial-json-parser reads the unfinished JSON
without unfinished strings and numbers, and the closing brackets it adds are held back, so every
argument fragment sent is a prefix of the final `json.dumps` of the arguments, the same string the
non-streamed response carries."""
from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from partial_json_parser import Allow
from partial_json_parser import loads as partial_loads
from partial_json_parser.core.exceptions import JSONDecodeError as PartialJSONError

log = logging.getLogger(__name__)
SETTLED = Allow.ALL & ~Allow.STR & ~Allow.NUM       # unfinished strings and numbers may still grow
# Each step re-reads the calls' JSON whole; once it is long, only after it grew by 1/32 more (a
# long call's arguments then stream in pieces of ~3% of it), so a stream's parsing stays linear in
# its length (about 32 reads of it) instead of one read per token.
REREAD_FRACTION = 32


@dataclass
class ToolCall:
    name: str
    arguments: str          # the arguments object as JSON text (OpenAI sends a string)


@dataclass
class Split:
    content: str            # the text outside the calls
    calls: str | None       # the calls so far as JSON array text, maybe unfinished; None: no call began


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def args_json(args: dict) -> str:
    return json.dumps(args, ensure_ascii=False)


def held_back(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker`: it may be the marker arriving,
    so a stream does not show it yet."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def objects_array(payload: str) -> str:
    """`{...}; {...}` or `{...}, {...}` (calls one after another) as JSON array text; an
    unfinished (or malformed) last object is left as it is, and the array unclosed."""
    decoder, parts, pos = json.JSONDecoder(), [], 0
    while True:
        while pos < len(payload) and payload[pos] in " \t\r\n;,":
            pos += 1
        if pos >= len(payload):
            return "[" + ",".join(parts) + "]"
        try:
            _, end = decoder.raw_decode(payload, pos)
        except ValueError:
            return "[" + ",".join([*parts, payload[pos:]])
        parts.append(payload[pos:end])
        pos = end


class ToolParser:
    """One tool-call format (SGLang's --tool-call-parser names)."""
    name = ""
    # whether the output is detokenized without special tokens: False where the call markers are
    # special tokens (they would vanish from the text)
    skip_special_tokens = True

    # whether several calls written as `structure` in one answer read as parallel calls (False: the
    # grammar of strict tools stops after the first)
    parallel_structures = True

    # why `structure` is None, for the 400 that refuses strict tools under tool_choice auto
    no_structure_reason = "it has no call form a grammar can check"

    def structure(self, name: str) -> tuple[str, str, str] | None:
        """(trigger, begin, end) around the arguments object of one call to `name`, as the grammar of
        strict tools under tool_choice auto writes it (SGLang's structure_info); None where this
        format has no such form."""
        return None

    def split(self, text: str, final: bool) -> Split:
        """Where the calls are. Not `final` (streaming): the content leaves out an end that may be
        the start of a marker."""
        raise NotImplementedError

    def call_of(self, obj: Any) -> tuple[str, Any] | None:
        """(name, arguments) of one call object, or None if it is not one (yet)."""
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        return obj["name"], obj.get("arguments", obj.get("parameters", {}))

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished output. Malformed calls are no calls: the whole text is
        the content (as SGLang and vLLM answer). With calls, content is the text outside them,
        stripped, None if empty."""
        s = self.split(text, final=True)
        if s.calls is None:
            return text, []
        try:
            objs = json.loads(s.calls)
        except ValueError:
            return text, []
        calls = []
        for obj in objs if isinstance(objs, list) else [objs]:
            call = self.call_of(obj)
            if call is None or not isinstance(call[1], dict):
                return text, []
            calls.append(ToolCall(call[0], args_json(call[1])))
        if not calls:
            return text, []
        return s.content.strip() or None, calls


class ToolStream:
    """One choice's streamed tool calls: feed() the text so far at each step, finish() once with
    the whole text; each returns (content delta, OpenAI `delta.tool_calls` entries)."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None):
        self.parser = parser
        self.max_calls = max_calls
        self.content_sent = ""
        self.args_sent: list[str] = []          # per call started: its arguments sent so far
        self.read_at = 0                        # length of the calls' text at the last JSON read

    @property
    def made_calls(self) -> bool:
        return bool(self.args_sent)

    def feed(self, text: str) -> tuple[str, list[dict]]:
        s = self.parser.split(text, final=False)
        content, deltas = self._content(s.content), []
        if s.calls is None or len(s.calls) - self.read_at < len(s.calls) // REREAD_FRACTION:
            return content, deltas
        self.read_at = len(s.calls)
        try:
            objs = partial_loads(s.calls, SETTLED)
        except (PartialJSONError, ValueError, IndexError):
            return content, deltas                  # nothing readable yet (or malformed: finish decides)
        objs = objs if isinstance(objs, list) else [objs]
        for i, obj in enumerate(objs):
            call = self.parser.call_of(obj)
            if call is None:
                break
            name, args = call
            if not isinstance(args, dict):
                break
            text_args = args_json(args)
            if i == len(objs) - 1:                  # the last one may be unfinished: keep its closers
                text_args = text_args.rstrip("}]")
            deltas += self._call(i, name, text_args)
        return content, deltas

    def finish(self, text: str) -> tuple[str, list[dict]]:
        content, calls = self.parser.parse(text)
        if not calls:
            # no (well-formed) calls: the text is content, unless calls went out already
            return ("" if self.made_calls else self._content(text)), []
        deltas: list[dict] = []
        rest = self._content(self.parser.split(text, final=True).content)
        for i, call in enumerate(calls):
            deltas += self._call(i, call.name, call.arguments)
        return rest, deltas

    def _content(self, content: str) -> str:
        if not content.startswith(self.content_sent):
            log.warning("tool-call stream: content no longer extends what was sent; dropped")
            return ""
        delta, self.content_sent = content[len(self.content_sent):], content
        return delta

    def _call(self, i: int, name: str, text_args: str) -> list[dict]:
        out: list[dict] = []
        if i > len(self.args_sent) or (self.max_calls is not None and i >= self.max_calls):
            return out
        if i == len(self.args_sent):
            self.args_sent.append("")
            out.append({"index": i, "id": new_call_id(), "type": "function",
                        "function": {"name": name, "arguments": ""}})
        sent = self.args_sent[i]
        if text_args.startswith(sent) and len(text_args) > len(sent):
            self.args_sent[i] = text_args
            piece = {"index": i, "function": {"arguments": text_args[len(sent):]}}
            if out:
                out[0]["function"]["arguments"] = piece["function"]["arguments"]
            else:
                out.append(piece)
        elif not text_args.startswith(sent):
            log.warning("tool-call stream: arguments of call %d no longer extend what was sent", i)
        return out
