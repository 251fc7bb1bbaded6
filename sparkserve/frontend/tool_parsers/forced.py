"""Tool calls a grammar forces (tool_choice `required` or a named function), read the same way
whatever the model's own format, as vLLM does: the grammar (`forced_schema`) makes the answer a
JSON array of `{"name", "parameters"}` (required) or the named function's arguments object.
Strict tools under tool_choice auto keep the model's own format (`strict_calls_tag`)."""
from __future__ import annotations

import json

from sparkserve.frontend.tool_parsers.base import Split, ToolParser

# JSON whitespace the grammar allows in a forced call: one optional space per gap (`{"a": 1}` as
# models write it), not the runs of blanks and newlines an unsure model loops on until max_tokens
COMPACT = {"x-guidance": {"whitespace_pattern": "[ ]?"}}


def parameters_schema(tool: dict) -> dict:
    """A tool's arguments schema, always an object (OpenAI's arguments are one): none given, or
    `{}` as clients send for a function without parameters, is an object of any keys."""
    params = tool["function"].get("parameters")
    params = params if isinstance(params, dict) else {}
    return params if "type" in params else {"type": "object", **params}


def forced_schema(tools: list[dict], named: str | None, parallel: bool = True) -> str:
    """The JSON schema the answer must follow: the named tool's parameters, or (required) an array
    of one or more calls (one without `parallel`), each naming one of the tools with that tool's
    parameters."""
    if named is not None:
        params = next(parameters_schema(t) for t in tools if t["function"]["name"] == named)
        return json.dumps({**params, **COMPACT})
    calls = [{"type": "object", "properties": {"name": {"enum": [t["function"]["name"]]},
                                               "parameters": parameters_schema(t)},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    most = {} if parallel else {"maxItems": 1}
    return json.dumps({"type": "array", "minItems": 1, **most, "items": {"anyOf": calls}, **COMPACT})


def is_strict(tool: dict) -> bool:
    return tool["function"].get("strict") is True


def strict_calls_tag(tools: list[dict], parser: ToolParser, parallel: bool = True,
                     answer: str | None = None) -> str:
    """tool_choice auto with strict tools: the answer is free text, but each call the model opens
    in its own format (`parser.structure`) is written whole, a strict tool's arguments following
    its schema (the others' any object), as SGLang's structural tag for strict tools. Without
    `parallel` (or where the format keeps parallel calls in one block) the answer ends after the
    first call. With an `answer` JSON schema (response_format), the answer is either that JSON or
    calls from its start on (free text after the first). ValueError where the format has no such
    form."""
    tags, triggers = [], []
    for t in tools:
        name = t["function"]["name"]
        form = parser.structure(name)
        if form is None:
            raise ValueError(f"--tool-call-parser {parser.name}: {parser.no_structure_reason}")
        trigger, begin, end = form
        schema = {**(parameters_schema(t) if is_strict(t) else {"type": "object"}), **COMPACT}
        tags.append({"type": "tag", "begin": begin, "end": end,
                     "content": {"type": "json_schema", "json_schema": schema}})
        if trigger not in triggers:
            triggers.append(trigger)
    one = not parallel or not parser.parallel_structures
    calls = {"type": "triggered_tags", "triggers": triggers, "tags": tags, "stop_after_first": one}
    if answer is not None:
        first = {"type": "or", "elements": tags}
        calls = {"type": "or", "elements": [
            {"type": "json_schema", "json_schema": json.loads(answer)},
            first if one else {"type": "sequence", "elements": [first, calls]}]}
    return json.dumps({"type": "structural_tag", "format": calls})


class RequiredCallsParser(ToolParser):
    name = "required"

    def split(self, text: str, final: bool) -> Split:
        body = text.strip()
        return Split("", body or None)


class NamedCallParser(ToolParser):
    name = "named"

    def __init__(self, function: str):
        self.head = '[{"name": ' + json.dumps(function) + ', "parameters": '

    def split(self, text: str, final: bool) -> Split:
        body = text.strip()
        if not body:
            return Split("", None)
        return Split("", self.head + body + ("}]" if final else ""))
