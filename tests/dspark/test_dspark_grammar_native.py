"""A DSpark batch mixing constrained and free greedy requests: the free ones keep the native greedy
draft pass (one call for their rows), the constrained ones draft piece by piece under their grammar
(DSparkWorker._mixed_pass), and every output equals plain decoding token for token (plain
constrained decoding for the constrained ones). Before, one constrained request sent the whole
batch down the piece-by-piece path. The embedded SmolLM2 with the draft shipped for it."""
from __future__ import annotations

import json

import pytest
from dspark_fixtures import assert_no_kv_leak, dspark_single_thread, embedded_engine_pair  # noqa: F401 (autouse)

from sparkserve.models.dspark_native import NativeDraftStep
from sparkserve.speculative.dspark_worker import DSparkWorker

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
MSGS = [[{"role": "user", "content": "Describe Alice, 30, as JSON."}],
        [{"role": "user", "content": "Describe the water cycle."}],
        [{"role": "user", "content": "Name three colours."}]]
PARAMS = [{"json_schema": json.dumps(PERSON), "temperature": 0, "max_new_tokens": 40},
          {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True},
          {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}]


@pytest.fixture(scope="module")
def embedded_engines():
    return embedded_engine_pair()


def test_free_rows_keep_the_native_pass_beside_a_constrained_one(embedded_engines, monkeypatch):
    plain, spec = embedded_engines
    calls: list[tuple[int, int, bool]] = []   # (batch drafting, rows of the native call, whether it ran)
    batch = [0]
    real_native, real_propose = NativeDraftStep.propose_greedy, DSparkWorker.propose

    def native(self, draft, anchors, *a, **kw):
        out = real_native(self, draft, anchors, *a, **kw)
        calls.append((batch[0], len(anchors), out is not None))
        return out

    def propose(self, reqs, *a, **kw):
        batch[0] = len(reqs)
        return real_propose(self, reqs, *a, **kw)
    monkeypatch.setattr(NativeDraftStep, "propose_greedy", native)
    monkeypatch.setattr(DSparkWorker, "propose", propose)
    ref = plain.generate(messages=MSGS, sampling_params=PARAMS)
    out = spec.generate(messages=MSGS, sampling_params=PARAMS)
    assert [o["output_ids"] for o in out] == [r["output_ids"] for r in ref]
    assert json.loads(out[0]["text"])["age"] == json.loads(ref[0]["text"])["age"]
    # while the constrained request ran, the two free ones drafted in native calls of their own
    assert (3, 2, True) in calls, calls
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in out)
    assert_no_kv_leak(spec)
