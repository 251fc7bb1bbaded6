"""SGLang's structural_tag as an llguidance grammar (sparkserve/constrained/structural_tag.py), on
the embedded SmolLM2's vocabulary: canned answers are accepted or refused as the structures say
(free text; each trigger opens a whole begin / schema / end; nothing after the first tag with
stop_after_first; at least one with at_least_one; special tokens as tokens); each strict tool's
call form per --tool-call-parser reads back through that parser as the call."""
from __future__ import annotations

import json

import jsonschema
import llguidance
import pytest

from sparkserve.constrained.check import grammar_source
from sparkserve.constrained.vocab import ll_tokenizer
from sparkserve.embedded import default_model_path
from sparkserve.frontend.tokenizer import load_tokenizer
from sparkserve.frontend.tool_parsers import TOOL_PARSERS
from sparkserve.frontend.tool_parsers.deepseek import BEGIN, END
from sparkserve.frontend.tool_parsers.forced import strict_calls_tag

ARGS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}
W = '<tool_call>\n{"name": "w", "arguments": {"city": "P"}}\n</tool_call>'
LEGACY = {"type": "structural_tag", "triggers": ["<tool_call>"], "structures": [
    {"begin": '<tool_call>\n{"name": "w", "arguments": ', "schema": ARGS, "end": "}\n</tool_call>"},
    {"begin": '<tool_call>\n{"name": "t", "arguments": ', "schema": {}, "end": "}\n</tool_call>"}]}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def llt(tok):
    return ll_tokenizer(tok, tok.vocab_size)


def special_of(tok) -> dict[str, int]:
    return {tok.token_bytes(t).decode(): t for t in tok.all_special_ids}


def reads(tok, llt, spec: dict, ids: list[int] | str) -> tuple[bool, bool]:
    """(the grammar takes every token, and may end there)."""
    m = llguidance.LLMatcher(llt, grammar_source("structural_tag", json.dumps(spec), special_of(tok)))
    assert not m.is_error(), m.get_error()
    ids = tok.encode(ids) if isinstance(ids, str) else ids
    return m.try_consume_tokens(ids) == len(ids), m.is_accepting()


@pytest.mark.parametrize("text,ok", [
    ("hello, no call", (True, True)),
    (f"hi {W} bye {W}", (True, True)),
    ('x <tool_call>\n{"name": "t", "arguments": {"any": [1]}}\n</tool_call>', (True, True)),
    ("hi <tool_call> not a call", (False, False)),
    ('<tool_call>\n{"name": "w", "arguments": {"town": "P"}}', (False, False)),
    (f"{W} <tool_call>", (True, False)),                 # opened, not finished: may not end
])
def test_legacy_structures(tok, llt, text, ok):
    assert reads(tok, llt, LEGACY, text) == ok


def test_xgrammar_triggered_tags(tok, llt):
    tag = {"type": "tag", "begin": '<tool_call>\n{"name": "w", "arguments": ', "end": "}\n</tool_call>",
           "content": {"type": "json_schema", "json_schema": ARGS}}
    spec = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<tool_call>"],
                                                  "tags": [tag], "stop_after_first": True}}
    assert reads(tok, llt, spec, "hi " + W) == (True, True)
    assert reads(tok, llt, spec, "hi " + W + " more")[0] is False
    assert reads(tok, llt, spec, "just text") == (True, True)
    spec["format"]["at_least_one"] = True
    assert reads(tok, llt, spec, "just text") == (True, False)
    think = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<think>"], "tags": [
        {"begin": "<think>", "content": {"type": "any_text"}, "end": "</think>"},
    ]}}
    assert reads(tok, llt, think, "<think>a b</think> ok") == (True, True)
    assert reads(tok, llt, think, "<think>a b") == (True, False)
    rx = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["A="], "tags": [
        {"begin": "A=", "content": {"type": "regex", "pattern": "[0-9]{2}/x"}, "end": ";"}]}}
    assert reads(tok, llt, rx, "z A=12/x; k") == (True, True)
    assert reads(tok, llt, rx, "z A=1x;")[0] is False


def test_special_token_trigger(tok, llt):
    """A trigger that is a special token is that token (the model cannot spell it as text)."""
    start, repo = tok.encode("<|im_start|>"), tok.encode("<repo_name>")
    assert len(start) == 1 and len(repo) == 1
    spec = {"type": "structural_tag", "triggers": ["<|im_start|>"],
            "structures": [{"begin": "<|im_start|>call ", "schema": ARGS, "end": "<repo_name>"}]}
    good = tok.encode("hi ") + start + tok.encode('call {"city": "x"}') + repo + tok.encode(" ok")
    assert reads(tok, llt, spec, good) == (True, True)
    assert reads(tok, llt, spec, tok.encode("hi ") + start + tok.encode("nope"))[0] is False


@pytest.mark.parametrize("spec,where", [
    ({"type": "structural_tag", "triggers": ["<a>"], "structures": [{"begin": "<b>", "end": ""}]}, "trigger"),
    ({"type": "structural_tag", "structures": []}, "structural_tag.structures"),
    ({"type": "structural_tag", "format": {"type": "qwen_xml_parameter"}}, "structural_tag.format.type"),
    ({"type": "structural_tag", "format": {"type": "sequence"}}, "structural_tag.format.elements"),
    ({"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "any_text"}, {"type": "const_string", "value": "x"}]}}, "structural_tag.format.elements.0"),
    ({"type": "json_schema"}, "structural_tag.type"),
])
def test_bad_structural_tags_name_the_field(spec, where):
    with pytest.raises(ValueError, match=where.replace(".", r"\.")):
        grammar_source("structural_tag", json.dumps(spec))


@pytest.mark.parametrize("name", ["hermes", "qwen25", "llama3", "mistral", "deepseekv3", "deepseekv31"])
def test_strict_call_forms_read_back(tok, llt, name):
    """Each parser's strict call form: text the grammar accepts (a call to a strict tool written in
    its form) parses back, through the same parser, to that call; arguments off the schema are
    refused."""
    parser = TOOL_PARSERS[name]()
    tools = [{"type": "function", "function": {"name": "w", "parameters": ARGS, "strict": True}}]
    spec = json.loads(strict_calls_tag(tools, parser))
    trigger, begin, end = parser.structure("w")
    # DeepSeek's calls sit in one calls block, whose markers the model writes as free text
    head, tail = (BEGIN, END) if name.startswith("deepseek") else ("", "")
    text = "Let me look. " + head + begin + json.dumps({"city": "Rome"}) + end + tail
    special = special_of(tok)
    plain = {k: v for k, v in special.items() if k not in text}      # SmolLM2 has none of these markers
    m = llguidance.LLMatcher(llt, grammar_source("structural_tag", json.dumps(spec), plain))
    ids = tok.encode(text)
    assert m.try_consume_tokens(ids) == len(ids) and m.is_accepting()
    content, calls = parser.parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("w", {"city": "Rome"})]
    jsonschema.validate(json.loads(calls[0].arguments), ARGS)
    bad = tok.encode("Let me look. " + head + begin + json.dumps({"town": "Rome"}) + end)
    m = llguidance.LLMatcher(llt, grammar_source("structural_tag", json.dumps(spec), plain))
    assert m.try_consume_tokens(bad) < len(bad)
    assert spec["format"]["stop_after_first"] is (not parser.parallel_structures)


def test_gpt_oss_has_no_strict_form():
    tools = [{"type": "function", "function": {"name": "w", "parameters": ARGS, "strict": True}}]
    with pytest.raises(ValueError, match="gpt-oss"):
        strict_calls_tag(tools, TOOL_PARSERS["gpt-oss"]())


def test_xgrammar_combinators(tok, llt):
    """or / sequence / const_string / tags_with_separator, and the JSON-or-calls shape strict tools
    take beside a response_format (calls from the start, free text after the first)."""
    tag = {"type": "tag", "begin": "<f>", "end": "</f>",
           "content": {"type": "json_schema", "json_schema": ARGS}}
    seq = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "Answer: "}, {"type": "or", "elements": [
            {"type": "regex", "pattern": "[0-9]+"}, tag]}]}}
    assert reads(tok, llt, seq, "Answer: 42") == (True, True)
    assert reads(tok, llt, seq, 'Answer: <f>{"city": "x"}</f>') == (True, True)
    assert reads(tok, llt, seq, "Answer: yes")[0] is False
    sep = {"type": "structural_tag", "format": {"type": "tags_with_separator", "tags": [tag],
                                                 "separator": ",", "at_least_one": True}}
    two = '<f>{"city": "x"}</f>,<f>{"city": "y"}</f>'
    assert reads(tok, llt, sep, two) == (True, True)
    assert reads(tok, llt, sep, two + " and")[0] is False
    assert reads(tok, llt, sep, "") == (True, False)
    tools = [{"type": "function", "function": {"name": "w", "parameters": ARGS, "strict": True}}]
    answer = json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                         "additionalProperties": False})
    both = json.loads(strict_calls_tag(tools, TOOL_PARSERS["hermes"](), True, answer))
    assert reads(tok, llt, both, '{"ok": true}') == (True, True)
    assert reads(tok, llt, both, W + " then " + W) == (True, True)
    assert reads(tok, llt, both, "Sure: " + W)[0] is False             # talk first: neither shape
    assert reads(tok, llt, both, '{"ok": 1}')[0] is False
