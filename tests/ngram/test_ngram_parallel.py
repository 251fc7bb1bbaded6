"""NGRAM under tensor and pipeline parallelism: the driver drafts from the requests' tokens and the
VERIFY forward runs on every rank as DSpark's does, so two ranks give one process's tokens and the
same verifies (drafting depends on the tokens only)."""
from __future__ import annotations

import pytest
from parallel_fixtures import COMMON, PROMPTS

from sparkserve import Engine

SP = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
NGRAM = dict(COMMON, speculative_algorithm="NGRAM", speculative_dspark_verify_mode="full")


@pytest.mark.parametrize("layout", [dict(tp_size=2), dict(pp_size=2, pp_micro_batch_min_tokens=1)],
                         ids=["tp2", "pp2"])
def test_ranks_equal_one(llama_dir, layout):
    plain = Engine(llama_dir, **COMMON).generate(input_ids=PROMPTS, sampling_params=SP)
    one = Engine(llama_dir, **NGRAM)
    want = one.generate(input_ids=PROMPTS, sampling_params=SP)
    assert [o["output_ids"] for o in want] == [o["output_ids"] for o in plain]
    with Engine(llama_dir, **NGRAM, **layout) as eng:
        got = eng.generate(input_ids=PROMPTS, sampling_params=SP)
        hist = dict(eng.scheduler.accept_hist)
    assert [g["output_ids"] for g in got] == [o["output_ids"] for o in plain]
    assert hist == one.scheduler.accept_hist and sum(k * v for k, v in hist.items()) > 0, hist
