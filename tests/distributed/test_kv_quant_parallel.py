"""A quantized KV pool (--kv-cache-dtype int8) under tensor parallel (the KV heads and their block
scales split over 2 ranks) and context parallel (each rank's quantized rows gathered as bytes, so
every rank stores the whole sequence): greedy tokens and logprobs equal the single-process int8
engine's on the tiny Llama, and on Mistral's sliding window."""
from __future__ import annotations

import pytest
from conftest import assert_no_kv_leak
from parallel_fixtures import COMMON, PROMPTS, SP, assert_same

from sparkserve import Engine

INT8 = dict(COMMON, kv_cache_dtype="int8")


@pytest.mark.parametrize("arch", ["llama", "mistral"])
@pytest.mark.parametrize("layout", [dict(tp_size=2), dict(tp_size=2, attn_cp_size=2)], ids=["tp2", "cp2"])
def test_int8_pool_equals_one_process(arch, layout, tiny_dirs):
    path = tiny_dirs[arch]
    one = Engine(path, **INT8)
    assert one.scheduler.runner.kv_pool.quantized
    want = [one.generate(input_ids=p, sampling_params=SP) for p in PROMPTS]
    with Engine(path, **layout, **INT8) as eng:
        got = [eng.generate(input_ids=p, sampling_params=SP) for p in PROMPTS]
        assert_no_kv_leak(eng.scheduler.cache)
    assert_same(got, want)
