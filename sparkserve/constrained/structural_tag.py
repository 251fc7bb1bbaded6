"""SGLang's `structural_tag` (xgrammar's structural tags) as an llguidance Lark grammar: free text,
where each trigger starts one of its tags, `begin` + content + `end`, then free text again (the
tool calls of an answer that may also talk). Both shapes SGLang takes:

- legacy: `{"type": "structural_tag", "structures": [{"begin", "schema", "end"}], "triggers": [...],
  "at_least_one": false}`: each structure's begin starts with one of the triggers;
- xgrammar's: `{"type": "structural_tag", "format": {"type": "triggered_tags", "triggers", "tags":
  [{"type": "tag", "begin", "content", "end"}], "at_least_one", "stop_after_first"}}`, a content
  being `json_schema`, `const_string`, `regex` or `any_text` (other formats are refused, naming them).

A trigger is found in the text lazily (the first time it appears the tag starts), and the free text
after the last tag may not contain a trigger, so every tag the model opens is checked. Text that is
one of the tokenizer's special tokens (`special`: text -> id) is written as that token, not as its
spelling (a special token is no text the model can spell)."""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

FIELD = "structural_tag"
ANY = r"(.|\n)*"
# JSON whitespace inside a tag's schema, unless the schema sets its own (as json_schema's default)
TAG_JSON_WHITESPACE = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,16}"}


@dataclass
class Tag:
    begin: str          # starts with its trigger
    content: str        # Lark for what goes between begin and end
    end: str


def _obj(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{where}: an object is required, got {type(value).__name__}")
    return value


def _str(d: dict, key: str, where: str) -> str:
    v = d.get(key)
    if not isinstance(v, str):
        raise ValueError(f"{where}.{key}: a string is required")
    return v


def _bool(d: dict, key: str, where: str) -> bool:
    v = d.get(key, False)
    if not isinstance(v, bool):
        raise ValueError(f"{where}.{key}: a bool is required")
    return v


def _json_content(schema: Any, where: str) -> str:
    if schema is None:
        schema = {}
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise ValueError(f"{where}: not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"{where}: a JSON schema (object) is required")
    if isinstance(schema, dict) and "x-guidance" not in schema:
        schema = {**schema, "x-guidance": TAG_JSON_WHITESPACE}
    return "%json " + json.dumps(schema)


def _content(fmt: Any, where: str, special: Mapping[str, int]) -> str:
    """Lark of one xgrammar content format (any_text: its lazy end is added by the tag)."""
    fmt = _obj(fmt, where)
    kind = fmt.get("type")
    if kind == "json_schema":
        return _json_content(fmt.get("json_schema"), f"{where}.json_schema")
    if kind == "const_string":
        return _literal(_str(fmt, "value", where), special) or '""'
    if kind == "regex":
        pattern = _str(fmt, "pattern", where)
        return "/" + pattern.replace("/", "\\/") + "/"
    if kind == "any_text":
        return ""
    raise ValueError(f"{where}.type: {kind!r} is not supported here (json_schema, const_string, regex or "
                     "any_text)")


def _literal(text: str, special: Mapping[str, int]) -> str:
    """Lark matching `text` exactly, its special tokens as those tokens (empty text: '')."""
    if not text:
        return ""
    names = sorted((s for s in special if s and s in text), key=len, reverse=True)
    if not names:
        return json.dumps(text)
    parts = re.split("(" + "|".join(map(re.escape, names)) + ")", text)
    return " ".join(f"<[{special[p]}]>" if p in names else json.dumps(p) for p in parts if p)


def _parse(spec: dict, special: Mapping[str, int]) -> tuple[list[str], list[Tag], bool, bool]:
    """(triggers, tags, at_least_one, stop_after_first) of either shape."""
    if "format" in spec:
        fmt = _obj(spec["format"], f"{FIELD}.format")
        where = f"{FIELD}.format"
        if fmt.get("type") != "triggered_tags":
            raise ValueError(f"{where}.type: {fmt.get('type')!r} is not supported (triggered_tags is)")
        raw_tags = fmt.get("tags")
        if not isinstance(raw_tags, list) or not raw_tags:
            raise ValueError(f"{where}.tags: a non-empty list is required")
        tags = []
        for i, t in enumerate(raw_tags):
            w = f"{where}.tags.{i}"
            t = _obj(t, w)
            if t.get("type", "tag") != "tag":
                raise ValueError(f"{w}.type: {t.get('type')!r} is not supported (tag is)")
            tags.append(Tag(_str(t, "begin", w), _content(t.get("content"), f"{w}.content", special),
                            _str(t, "end", w)))
        return (fmt.get("triggers"), tags, _bool(fmt, "at_least_one", where),
                _bool(fmt, "stop_after_first", where))
    raw = spec.get("structures")
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{FIELD}.structures: a non-empty list is required (or xgrammar's `format`)")
    tags = []
    for i, s in enumerate(raw):
        w = f"{FIELD}.structures.{i}"
        s = _obj(s, w)
        content = _json_content(s.get("schema"), f"{w}.schema")
        tags.append(Tag(_str(s, "begin", w), content, _str(s, "end", w)))
    return spec.get("triggers"), tags, _bool(spec, "at_least_one", FIELD), False


def structural_tag_lark(text: str, special: Mapping[str, int] | None = None) -> str:
    """The Lark grammar of a structural_tag (JSON text); ValueError naming the field."""
    special = special or {}
    try:
        spec = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{FIELD}: not valid JSON: {e}") from None
    spec = _obj(spec, FIELD)
    if spec.get("type", FIELD) != FIELD:
        raise ValueError(f"{FIELD}.type: must be \"structural_tag\", got {spec.get('type')!r}")
    triggers, tags, at_least_one, stop_after_first = _parse(spec, special)
    where = f"{FIELD}.triggers"
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError(f"{where}: a non-empty list of non-empty strings is required")
    by_trigger: dict[str, list[Tag]] = {t: [] for t in triggers}
    for i, tag in enumerate(tags):
        # the longest trigger it starts with (a trigger that is a prefix of another picks the longer)
        own = max((t for t in triggers if tag.begin.startswith(t)), key=len, default=None)
        if own is None:
            raise ValueError(f"{FIELD}: tag {i}'s begin {tag.begin!r} does not start with any of the "
                             f"triggers {triggers}")
        by_trigger[own].append(tag)
    text_triggers = [t for t in by_trigger if by_trigger[t] and t not in special]
    free = f"/{ANY}/" if not text_triggers else \
        f"/{ANY}/ & ~/{ANY}(" + "|".join(re.escape(t).replace("/", "\\/") for t in text_triggers) + f"){ANY}/"
    lines = ["%llguidance {}", f"TEXT: {free}"]
    calls, k = [], 0
    for j, (trigger, own_tags) in enumerate(by_trigger.items()):
        if not own_tags:
            continue
        if trigger in special:
            lines.append(f"trig_{j}: TEXT <[{special[trigger]}]>")
        else:
            lines.append(f"trig_{j}[lazy]: /{ANY}/ {json.dumps(trigger)}")
        bodies = []
        for tag in own_tags:
            rest = _literal(tag.begin[len(trigger):], special)
            if tag.content:
                body = f"{rest} {tag.content} {_literal(tag.end, special)}"
            else:       # any_text: up to the end's first appearance
                if not tag.end:
                    raise ValueError(f"{FIELD}: an any_text tag needs a non-empty end")
                lines.append(f"text_{k}[lazy]: /{ANY}/ {_literal(tag.end, special)}")
                body = f"{rest} text_{k}"
            lines.append(f"tag_{k}: {body}")
            bodies.append(f"tag_{k}")
            k += 1
        calls.append(f"trig_{j} ({' | '.join(bodies)})")
    lines.append("call: " + " | ".join(calls))
    if stop_after_first:
        lines.append("start: call" if at_least_one else "start: TEXT | call")
    else:
        lines.append(f"start: call{'+' if at_least_one else '*'} TEXT")
    return "\n".join(lines) + "\n"
