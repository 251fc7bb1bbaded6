"""DSpark with a grammar: a constrained request still speculates (verify forwards run for it, drafts
are accepted), drafts the grammar rejects are cut before verify, and greedy output equals plain
constrained decoding token for token (the verify reads the grammar-masked target). Sampled outputs
obey the schema. The embedded SmolLM2 with the draft shipped for it."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
from dspark_fixtures import assert_no_kv_leak, dspark_single_thread, embedded_engine_pair  # noqa: F401 (autouse)

from sparkserve.constrained.matcher import GrammarMatcher

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}}}
MSGS = [[{"role": "user", "content": "Describe Alice, 30, from Paris, as JSON."}],
        [{"role": "user", "content": "Write the date of the first moon landing as YYYY-MM-DD."}],
        [{"role": "user", "content": "Describe the water cycle."}]]
PARAMS = [{"json_schema": json.dumps(PERSON), "temperature": 0, "max_new_tokens": 60},
          {"regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}", "temperature": 0, "max_new_tokens": 20},
          {"temperature": 0, "max_new_tokens": 24}]


@pytest.fixture(scope="module")
def embedded_engines():
    return embedded_engine_pair()


def test_greedy_under_grammar_equals_plain_constrained(embedded_engines, monkeypatch):
    plain, spec = embedded_engines
    cuts = []
    orig = GrammarMatcher.cut_drafts

    def recording(self, drafts, output_ids):
        n = orig(self, drafts, output_ids)
        cuts.append((len(drafts), n))
        return n
    monkeypatch.setattr(GrammarMatcher, "cut_drafts", recording)
    ref = plain.generate(messages=MSGS, sampling_params=PARAMS)
    out = spec.generate(messages=MSGS, sampling_params=PARAMS)
    assert [o["output_ids"] for o in out] == [r["output_ids"] for r in ref]
    jsonschema.validate(json.loads(out[0]["text"]), PERSON)
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", out[1]["text"])
    metas = [o["meta_info"] for o in out[:2]]    # the constrained requests speculated, and gained
    assert all(m["spec_verify_ct"] > 0 for m in metas) and metas[0]["spec_accept_token_num"] > 0, metas
    assert cuts and any(n < k for k, n in cuts), cuts      # the grammar rejected some drafts
    assert_no_kv_leak(spec)


def test_sampled_under_grammar_obeys_the_schema(embedded_engines):
    _, spec = embedded_engines
    outs = spec.generate(messages=MSGS[0], sampling_params={
        "json_schema": json.dumps(PERSON), "temperature": 1.0, "seed": 5, "n": 3, "max_new_tokens": 80})
    ended = [o for o in outs if o["meta_info"]["finish_reason"]["type"] == "stop"]
    assert ended
    for o in ended:
        jsonschema.validate(json.loads(o["text"]), PERSON)
    assert sum(o["meta_info"]["spec_verify_ct"] for o in outs) > 0
    assert_no_kv_leak(spec)
