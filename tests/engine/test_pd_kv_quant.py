"""PD disaggregation with a quantized KV pool (--kv-cache-dtype int8 / fp8_*): the block scales are
pool components like K and V (mem/kv_pool.py), so they are read out, sent and written with the
rows. The decode side, which never runs the prompt, must give the tokens and logprobs of one
colocated engine with the same pool (full attention, a sliding window, a split pool's windowed
slots), in process and scheduler to scheduler over every transfer backend that loads here; two sides
whose pools disagree on the quantized format fail the request at the reservation with an error
naming both --kv-cache-dtype values, and free everything."""
from __future__ import annotations

import pytest
from conftest import assert_no_kv_leak
from pd_fixtures import assert_disaggregated_as_colocated
from test_pd_backends import _available, _swap_decode
from test_pd_tcp import KW, PROMPTS, SP, Pair, _aborted, _idle, _same

from sparkserve import Engine
from sparkserve.core.forward_batch import ForwardMode


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_dirs):
    from test_swa_pool import save_tiny
    root = tmp_path_factory.mktemp("pdquant")
    return {"llama": tiny_dirs["llama"],
            "windowed": save_tiny(str(root / "w8"), "mistral", sliding_window=8),
            "split": save_tiny(str(root / "qwen3"), "qwen3", head_dim=32, use_sliding_window=True,
                               sliding_window=8, max_window_layers=1)}


@pytest.mark.parametrize("arch", ["llama", "windowed", "split"])
@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3"])
def test_colocated_equals_disaggregated(arch, dtype, models):
    path = models[arch]
    prefill, decode = assert_disaggregated_as_colocated(path, dict(KW, kv_cache_dtype=dtype), PROMPTS, SP)
    rows = prefill.scheduler.runner.kv_pool.components()
    assert {c.name for c in rows} >= {f"k_scale_{dtype}", f"v_scale_{dtype}"}
    assert_no_kv_leak(prefill.scheduler.cache)
    assert_no_kv_leak(decode.scheduler.cache)


@pytest.mark.parametrize("backend", ["tcp", "nixl", "mooncake"])
def test_pair_over_each_backend(backend, models):
    backend = _available(backend)
    want = Engine(models["windowed"], **KW, kv_cache_dtype="int8").generate(input_ids=PROMPTS,
                                                                            sampling_params=SP)
    pair = Pair(models["windowed"], backend=backend, kv_cache_dtype="int8")
    try:
        reqs = [pair.submit(ids, SP) for ids in PROMPTS]
        pair.run([rd for _, rd in reqs])
        for (_, rd), w in zip(reqs, want):
            _same(rd, w)
        assert pair.decode_engine.scheduler.forward_count[ForwardMode.EXTEND] == 0
        _idle(pair)
    finally:
        pair.close()


@pytest.mark.parametrize("decode_dtype,named", [("float32", "float32 / float16 / bfloat16"),
                                                ("fp8_e4m3", "fp8_e4m3")])
def test_sides_disagreeing_on_the_kv_dtype_fail_at_the_reservation(decode_dtype, named, models):
    pair = Pair(models["llama"], kv_cache_dtype="int8")
    _swap_decode(pair, Engine(models["llama"], **KW, kv_cache_dtype=decode_dtype), "tcp")
    try:
        rp, rd = pair.submit(PROMPTS[0], SP)
        pair.run([rp, rd], until=10)
        _aborted(rd, 502, "transfer error: the KV caches differ: --kv-cache-dtype int8 on the prefill "
                          f"side, {named} on the decode side")
        _aborted(rp, 502, "decode server gave up")
        assert pair.decode_engine.scheduler.forward_count[ForwardMode.DECODE] == 0
        _idle(pair)
    finally:
        pair.close()
