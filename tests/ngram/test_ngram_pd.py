"""NGRAM under prefill/decode disaggregation: NGRAM keeps no per-request pool (its history is the
request's tokens, which the decode side receives), so a decode server with NGRAM takes requests
from a plain prefill server (or an NGRAM one: the same pools) and drafts from its first decode
step: the tokens of plain colocated decoding, several drafts accepted."""
from __future__ import annotations

import pytest
from dspark_fixtures import assert_no_kv_leak
from pd_fixtures import disaggregated

from sparkserve import Engine

KW = dict(num_threads=1, chunked_prefill_size=16, max_total_tokens=1024, activation_quant="none")
SP = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
PROMPTS = [list(range(5, 45)) + list(range(5, 12)), [7, 3, 9] * 4, list(range(5, 35)) + [1, 2]]
NGRAM = dict(speculative_algorithm="NGRAM", speculative_dspark_verify_mode="full")


@pytest.mark.parametrize("prefill_side", ["plain", "ngram"])
def test_decode_side_drafts_from_the_first_step(llama_dir, prefill_side):
    plain = Engine(llama_dir, **KW).generate(input_ids=PROMPTS, sampling_params=SP)
    prefill = Engine(llama_dir, **KW, **(NGRAM if prefill_side == "ngram" else {}))
    decode = Engine(llama_dir, **KW, **NGRAM)
    assert prefill.scheduler.pools() == [prefill.scheduler.runner.kv_pool]   # no draft pool either way
    got = [disaggregated(prefill, decode, ids, SP) for ids in PROMPTS]
    assert [g["output_ids"] for g in got] == [o["output_ids"] for o in plain]
    # the first prompt ends inside a span it holds earlier: its copy is drafted at once
    assert got[0]["meta_info"]["spec_accept_token_num"] > 0, got[0]["meta_info"]
    assert_no_kv_leak(decode)
