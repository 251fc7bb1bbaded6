"""A request's constraint as the grammar engine's grammar, checked where the request arrives: an
invalid one is a ValueError naming the field, so the HTTP layer answers 400 and the scheduler never
sees it. OpenAI's response_format maps onto the same json_schema field."""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import llguidance

from sparkserve.constrained.structural_tag import structural_tag_lark
from sparkserve.sampling_params import GRAMMAR_FIELDS, SamplingParams

GRAMMAR_BACKENDS = ("llguidance", "xgrammar", "none")
ANY_JSON_OBJECT = '{"type": "object"}'      # response_format json_object, as SGLang maps it

# llguidance's format for each SamplingParams field (ebnf: GBNF or Lark, as llguidance reads both;
# structural_tag: structural_tag.py)
_FORMATS = {"json_schema": "json_schema", "regex": "regex", "ebnf": "ebnf"}
# JSON whitespace between tokens: flexible (a model's own pretty-printing passes) but at most this
# much per gap, so a model that loops on newlines still has to write the object. A schema's own
# "x-guidance" options override it.
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,16}"


def grammar_source(field: str, text: str, special: Mapping[str, int] | None = None) -> str:
    """The llguidance grammar of a constraint; ValueError (naming the field) when it cannot be made.
    `special` (a special token's text -> id) lets a structural tag name special tokens; without it
    (the request path's check) their text is taken as text."""
    if field == "structural_tag":
        return llguidance.LLMatcher.grammar_from_lark(structural_tag_lark(text, special))
    try:
        if field == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(
                text, defaults={"whitespace_pattern": JSON_WHITESPACE})
        return llguidance.grammar_from(_FORMATS[field], text)
    except ValueError as e:
        raise ValueError(f"{field}: invalid {field}: {e}") from None


def check_grammar(params: SamplingParams, backend: str, has_tokenizer: bool) -> None:
    """Raise ValueError, naming the field, unless this server can honour the request's constraint."""
    spec = params.grammar
    if spec is None:
        return
    field, text = spec
    if backend == "none":
        raise ValueError(f"{field}: constrained decoding is off on this server (--grammar-backend none)")
    if not has_tokenizer:
        raise ValueError(f"{field}: constrained decoding needs the model's tokenizer (this server has none)")
    error = llguidance.LLMatcher.validate_grammar(grammar_source(field, text))
    if error:
        raise ValueError(f"{field}: invalid {field}: {error.strip()}")


def response_format_constraint(rf: Any) -> tuple[str, str] | None:
    """OpenAI's response_format as (field, text) of the constraint: a json_schema, or SGLang's
    structural_tag (its whole object, as SGLang passes it on); None for text. ValueError naming
    the field."""
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise ValueError(f"response_format must be an object, got {type(rf).__name__}")
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_schema", ANY_JSON_OBJECT
    if kind == "structural_tag":
        return "structural_tag", json.dumps(rf)
    if kind != "json_schema":
        raise ValueError(f"response_format.type: {kind!r} is not one of text, json_object, json_schema, "
                         "structural_tag")
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise ValueError("response_format.json_schema: an object {name, schema, strict} is required")
    if not isinstance(spec.get("name"), str):
        raise ValueError("response_format.json_schema.name: a string is required")
    schema = spec.get("schema", {})       # OpenAI: no schema means any JSON
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"response_format.json_schema.schema must be an object, got {type(schema).__name__}")
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise ValueError("response_format.json_schema.strict must be a bool")
    return "json_schema", json.dumps(schema)


def apply_response_format(req: Any, backend: str, has_tokenizer: bool) -> Any:
    """An OpenAI request (pydantic) with its response_format as its json_schema or structural_tag
    (SGLang's extra-body fields, which the sampling params take); ValueError naming response_format
    when it cannot be."""
    constraint = response_format_constraint(req.response_format)
    if constraint is None:
        return req
    given = [name for name in GRAMMAR_FIELDS if getattr(req, name) is not None]
    if given:
        raise ValueError(f"response_format: cannot be combined with {given[0]} (one constraint per request)")
    field, text = constraint
    try:
        check_grammar(SamplingParams(**{field: text}).validate(), backend, has_tokenizer)
    except ValueError as e:
        raise ValueError(f"response_format: {e}") from None
    return req.model_copy(update={field: text})
