"""DSpark's draft proposing under the request's grammar (speculative/grammar_drafts.py DraftMasks):
greedy output stays that of plain constrained decoding token for token, sampled output obeys the
schema, and on JSON, where the unmasked draft proposes tokens the grammar rejects (cut before
verify), the masked draft gets more drafts accepted per verify (the scheduler's accept_hist).
The embedded SmolLM2 with the draft shipped for it; the unmasked run is the same engine with the
masks off."""
from __future__ import annotations

import json

import jsonschema
import pytest
from dspark_fixtures import assert_no_kv_leak, dspark_single_thread, embedded_engine_pair  # noqa: F401 (autouse)

from sparkserve.speculative import grammar_drafts

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}}}
MSGS = [[{"role": "user", "content": f"Describe {who} as JSON."}]
        for who in ("Alice, 30, from Paris", "Bob, 41, from Rome", "Chen, 25, from Lima")]
PARAMS = {"json_schema": json.dumps(PERSON), "temperature": 0, "max_new_tokens": 48}


def accepted_per_verify(spec, outs) -> tuple[float, dict[int, int]]:
    metas = [o["meta_info"] for o in outs]
    verifies = sum(m["spec_verify_ct"] for m in metas)
    assert verifies > 0
    hist = dict(spec.scheduler.load().spec_accept_hist)
    return sum(m["spec_accept_token_num"] for m in metas) / verifies, hist


def hist_delta(after: dict[int, int], before: dict[int, int]) -> dict[int, int]:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0)}


@pytest.fixture(scope="module")
def embedded_engines():
    return embedded_engine_pair()


def test_masked_drafts_lossless_and_accepted_more(embedded_engines, monkeypatch):
    plain, spec = embedded_engines
    ref = plain.generate(messages=MSGS, sampling_params=PARAMS)
    h0 = dict(spec.scheduler.load().spec_accept_hist)
    masked = spec.generate(messages=MSGS, sampling_params=PARAMS)
    rate_masked, h1 = accepted_per_verify(spec, masked)
    with monkeypatch.context() as m:
        m.setattr(grammar_drafts.DraftMasks, "of", staticmethod(lambda reqs, ids: None))
        unmasked = spec.generate(messages=MSGS, sampling_params=PARAMS)
    rate_unmasked, h2 = accepted_per_verify(spec, unmasked)
    assert [o["output_ids"] for o in masked] == [r["output_ids"] for r in ref]
    assert [o["output_ids"] for o in unmasked] == [r["output_ids"] for r in ref]
    for o in masked:
        if o["meta_info"]["finish_reason"]["type"] == "stop":
            jsonschema.validate(json.loads(o["text"]), PERSON)
    print(f"accepted drafts per verify: masked {rate_masked:.2f} (hist {hist_delta(h1, h0)}), unmasked "
          f"{rate_unmasked:.2f} (hist {hist_delta(h2, h1)})")
    assert rate_masked > rate_unmasked
    assert_no_kv_leak(spec)


def test_sampled_masked_drafts_obey_the_schema(embedded_engines):
    _, spec = embedded_engines
    outs = spec.generate(messages=MSGS[0], sampling_params={**PARAMS, "temperature": 1.0, "seed": 3, "n": 3,
                                                            "max_new_tokens": 80})
    ended = [o for o in outs if o["meta_info"]["finish_reason"]["type"] == "stop"]
    assert ended
    for o in ended:
        jsonschema.validate(json.loads(o["text"]), PERSON)
    assert sum(o["meta_info"]["spec_accept_token_num"] for o in outs) > 0
    assert_no_kv_leak(spec)
