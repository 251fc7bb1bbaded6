"""SGLang's `structural_tag` (xgrammar's structural tags) as an llguidance Lark grammar. Both shapes
SGLang takes:

- legacy: `{"type": "structural_tag", "structures": [{"begin", "schema", "end"}], "triggers": [...],
  "at_least_one": false}`, read as xgrammar's `triggered_tags` of those tags;
- xgrammar's: `{"type": "structural_tag", "format": FORMAT}`, a FORMAT being `const_string`,
  `json_schema`, `regex`, `any_text`, `sequence`, `or`, `tag` (`begin` + content + `end`),
  `triggered_tags` (free text, where each trigger opens one of its tags, then free text again: the
  tool calls of an answer that may also talk; `at_least_one`, `stop_after_first`) or
  `tags_with_separator`.

A trigger is found in the text lazily (the first time it appears its tag starts), and the free text
after the last tag may not contain a trigger, so every tag the model opens is checked. `any_text`
runs up to what follows it (a tag's end: lazily) or to the end of the answer; elsewhere it is
refused, as is free text after triggered tags. Text that is one of the tokenizer's special tokens
(`special`: text -> id) is written as that token, not as its spelling (no text spells one)."""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

FIELD = "structural_tag"
ANY = r"(.|\n)*"
# JSON whitespace inside a tag's schema, unless the schema sets its own (as json_schema's default)
TAG_JSON_WHITESPACE = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,16}"}


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


def _list(d: dict, key: str, where: str) -> list:
    v = d.get(key)
    if not isinstance(v, list) or not v:
        raise ValueError(f"{where}.{key}: a non-empty list is required")
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


class _Grammar:
    """Lark rules made while compiling one structural tag."""

    def __init__(self, special: Mapping[str, int]):
        self.special = special
        self.lines = ["%llguidance {}"]
        self.n = 0

    def rule(self, body: str, lazy: bool = False) -> str:
        name = f"r{self.n}"
        self.n += 1
        self.lines.append(f"{name}{'[lazy]' if lazy else ''}: {body}")
        return name

    def token(self, body: str) -> str:
        """A lexeme (Lark's upper-case rules: `&` and `~` combine only those)."""
        name = f"TEXT{self.n}"
        self.n += 1
        self.lines.append(f"{name}: {body}")
        return name

    def literal(self, text: str) -> str:
        """Lark matching `text` exactly, its special tokens as those tokens ('' for no text)."""
        if not text:
            return ""
        names = sorted((s for s in self.special if s and s in text), key=len, reverse=True)
        if not names:
            return json.dumps(text)
        parts = re.split("(" + "|".join(map(re.escape, names)) + ")", text)
        return " ".join(f"<[{self.special[p]}]>" if p in names else json.dumps(p) for p in parts if p)

    def format(self, fmt: Any, where: str, at_end: bool) -> str:
        """A rule for one format; `at_end`: nothing follows it (free text may run to the end)."""
        fmt = _obj(fmt, where)
        kind = fmt.get("type")
        if kind == "const_string":
            return self.rule(self.literal(_str(fmt, "value", where)) or '""')
        if kind == "json_schema":
            return self.rule(_json_content(fmt.get("json_schema"), f"{where}.json_schema"))
        if kind == "regex":
            return self.rule("/" + _str(fmt, "pattern", where).replace("/", "\\/") + "/")
        if kind == "any_text":
            if not at_end:
                raise ValueError(f"{where}: any_text must be a tag's content or end the format")
            return self.rule(f"/{ANY}/")
        if kind == "sequence":
            elements = _list(fmt, "elements", where)
            last = len(elements) - 1
            return self.rule(" ".join(self.format(e, f"{where}.elements.{i}", at_end and i == last)
                                      for i, e in enumerate(elements)))
        if kind == "or":
            return self.rule(" | ".join(self.format(e, f"{where}.elements.{i}", at_end)
                                        for i, e in enumerate(_list(fmt, "elements", where))))
        if kind == "tag":
            return self.tag(fmt, where, 0)
        if kind == "triggered_tags":
            if not at_end:
                raise ValueError(f"{where}: triggered_tags must end the format (free text follows them)")
            return self.triggered(fmt, where)
        if kind == "tags_with_separator":
            tags = [self.tag(t, f"{where}.tags.{i}", 0) for i, t in enumerate(_list(fmt, "tags", where))]
            one = self.rule(" | ".join(tags))
            if _bool(fmt, "stop_after_first", where):
                return self.rule(one if _bool(fmt, "at_least_one", where) else f"{one}?")
            sep = self.literal(_str(fmt, "separator", where))
            many = f"{one} ({sep} {one})*" if sep else f"{one}+"
            return self.rule(many if _bool(fmt, "at_least_one", where) else f"({many})?")
        raise ValueError(f"{where}.type: {kind!r} is not supported (const_string, json_schema, regex, "
                         "any_text, sequence, or, tag, triggered_tags, tags_with_separator)")

    def tag(self, fmt: Any, where: str, skip: int) -> str:
        """`begin` (less its first `skip` characters: the trigger already read) + content + `end`."""
        fmt = _obj(fmt, where)
        if fmt.get("type", "tag") != "tag":
            raise ValueError(f"{where}.type: {fmt.get('type')!r} is not supported here (tag is)")
        begin, end = _str(fmt, "begin", where), _str(fmt, "end", where)
        content = _obj(fmt.get("content"), f"{where}.content")
        head = self.literal(begin[skip:])
        if content.get("type") == "any_text":          # up to the end's first appearance
            if not end:
                raise ValueError(f"{where}.end: an any_text tag needs a non-empty end")
            return self.rule(f"{head} {self.rule(f'/{ANY}/ {self.literal(end)}', lazy=True)}")
        return self.rule(f"{head} {self.format(content, f'{where}.content', False)} {self.literal(end)}")

    def triggered(self, fmt: dict, where: str) -> str:
        triggers = fmt.get("triggers")
        if not isinstance(triggers, list) or not triggers or \
                not all(isinstance(t, str) and t for t in triggers):
            raise ValueError(f"{where}.triggers: a non-empty list of non-empty strings is required")
        by_trigger: dict[str, list[str]] = {t: [] for t in triggers}
        for i, t in enumerate(_list(fmt, "tags", where)):
            begin = _str(_obj(t, f"{where}.tags.{i}"), "begin", f"{where}.tags.{i}")
            # the longest trigger it starts with (a trigger that is a prefix of another picks the longer)
            own = max((g for g in triggers if begin.startswith(g)), key=len, default=None)
            if own is None:
                raise ValueError(f"{where}.tags.{i}: its begin {begin!r} does not start with any of the "
                                 f"triggers {triggers}")
            by_trigger[own].append(self.tag(t, f"{where}.tags.{i}", len(own)))
        text_triggers = [t for t in by_trigger if by_trigger[t] and t not in self.special]
        free = f"/{ANY}/" if not text_triggers else f"/{ANY}/ & ~/{ANY}(" + "|".join(
            re.escape(t).replace("/", "\\/") for t in text_triggers) + f"){ANY}/"
        text = self.token(free)
        calls = []
        for trigger, tags in by_trigger.items():
            if not tags:
                continue
            if trigger in self.special:
                opened = self.rule(f"{text} <[{self.special[trigger]}]>")
            else:
                opened = self.rule(f"/{ANY}/ {json.dumps(trigger)}", lazy=True)
            calls.append(f"{opened} ({' | '.join(tags)})")
        call = self.rule(" | ".join(calls))
        at_least_one = _bool(fmt, "at_least_one", where)
        if _bool(fmt, "stop_after_first", where):
            return self.rule(call if at_least_one else f"{text} | {call}")
        return self.rule(f"{call}{'+' if at_least_one else '*'} {text}")


def _legacy(spec: dict) -> dict:
    """SGLang's legacy shape as xgrammar's triggered_tags."""
    tags = []
    for i, s in enumerate(_list(spec, "structures", FIELD)):
        w = f"{FIELD}.structures.{i}"
        s = _obj(s, w)
        _json_content(s.get("schema"), f"{w}.schema")           # its own error names the structure
        tags.append({"type": "tag", "begin": _str(s, "begin", w), "end": _str(s, "end", w),
                     "content": {"type": "json_schema", "json_schema": s.get("schema") or {}}})
    return {"type": "triggered_tags", "triggers": spec.get("triggers"), "tags": tags,
            "at_least_one": _bool(spec, "at_least_one", FIELD)}


def structural_tag_lark(text: str, special: Mapping[str, int] | None = None) -> str:
    """The Lark grammar of a structural_tag (JSON text); ValueError naming the field."""
    try:
        spec = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{FIELD}: not valid JSON: {e}") from None
    spec = _obj(spec, FIELD)
    if spec.get("type", FIELD) != FIELD:
        raise ValueError(f"{FIELD}.type: must be \"structural_tag\", got {spec.get('type')!r}")
    g = _Grammar(special or {})
    where = f"{FIELD}.format" if "format" in spec else FIELD
    top = g.format(spec["format"] if "format" in spec else _legacy(spec), where, at_end=True)
    g.lines.append(f"start: {top}")
    return "\n".join(g.lines) + "\n"
