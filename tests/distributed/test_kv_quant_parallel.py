"""A quantized KV pool (--kv-cache-dtype int8) under tensor parallel (the KV heads and their block
scales split over 2 ranks) and context parallel (each rank's quantized rows gathered as bytes, so
every rank stores the whole sequence): greedy tokens and logprobs equal the single-process int8
engine's on the tiny Llama, and on Mistral's sliding window. Under CP a decode row attends through the
prefill tile, the single process's through the decode kernel: on AVX-512 VNNI both round an int8
pool's query to int8 alike (tests/engine/test_kv_quant_vnni.py), so the rows still agree."""
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


@pytest.mark.parametrize("layout", [dict(tp_size=2, ep_size=2), dict(tp_size=2, ep_size=2, attn_cp_size=2)],
                         ids=["ep2", "cp2"])
def test_int8_latent_equals_one_process(layout, tmp_path):
    """Kimi-Linear's MLA latent in an int8 pool (whole on every rank, its scales too; under CP each
    rank's rows gathered as bytes) beside its float32 KDA state equals the single-process int8 engine."""
    from kimi_fixtures import make_kimi
    path = make_kimi(str(tmp_path / "kimi"), "kda_mla")
    one = Engine(path, **INT8)
    assert "kv_latent_scale_int8" in {c.name for c in one.scheduler.runner.kv_pool.components()}
    want = [one.generate(input_ids=p, sampling_params=SP) for p in PROMPTS]
    with Engine(path, **layout, **INT8) as eng:
        got = [eng.generate(input_ids=p, sampling_params=SP) for p in PROMPTS]
        assert_no_kv_leak(eng.scheduler.cache)
    assert_same(got, want)
