"""--kv-cache-dtype: a float16 / bfloat16 KV pool for Llama-family models (the kernel-level and
native-step checks are in test_decode_attention.py and test_native_step.py). The flag reaches the
pool, halves what a token costs (so the same memory holds twice the tokens), and the greedy
tokens of the tiny model stay those of a float32 pool (float16; bfloat16 keeps its first ones);
auto is float16 for a GGUF checkpoint (as llama.cpp caches it) and float32 otherwise; a model
whose pools hold other state refuses a half type at start-up, naming the flag."""
from __future__ import annotations

import os

import pytest
import torch
from conftest import assert_no_kv_leak
from kimi_fixtures import make_kimi

from sparkserve import Engine
from sparkserve.args import ServerArgs
from sparkserve.models.registry import load_config, load_model
from sparkserve.scheduler.runtime import pool_sizes

GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
PROMPTS = [[5, 9, 2, 41, 7], list(range(3, 40)), [11] * 3]


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_half_pool_serves_the_float32_tokens(llama_dir, name):
    outs = []
    for dtype in ("float32", name):
        with Engine(llama_dir, kv_cache_dtype=dtype, max_total_tokens=512) as eng:
            pool = eng.scheduler.runner.kv_pool
            assert pool.k[0].dtype == getattr(torch, dtype)
            outs.append([r["output_ids"] for r in eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)])
            assert_no_kv_leak(eng.scheduler.cache)
    if name == "float16":
        assert outs[0] == outs[1]
    else:       # 3 fewer mantissa bits: a random model's near-ties may part later in the answer
        assert [o[:2] for o in outs[0]] == [o[:2] for o in outs[1]]


def test_auto_is_float16_for_gguf_only(llama_dir, smollm2_path, tmp_path):
    """auto: float16 for the embedded GGUF (Llama family), float32 for an HF checkpoint, and for a
    model whose pools hold other state (which it then starts, rather than refusing)."""
    kimi = make_kimi(str(tmp_path / "kimi"), "kda_mla")
    for path, want in ((smollm2_path, torch.float16), (llama_dir, torch.float32), (kimi, torch.float32)):
        with Engine(path, max_total_tokens=256) as eng:
            comps = eng.scheduler.runner.kv_pool.components()
            assert {t.dtype for c in comps for t in c.tensors if t.is_floating_point()} == {want}, path


def test_half_pool_holds_twice_the_tokens(llama_dir):
    """Sized by memory (--mem-fraction-static), a float16 pool gets twice a float32 pool's slots."""
    cfg = load_config(llama_dir)
    model = load_model(llama_dir, cfg)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    args = ServerArgs(model_path=llama_dir, mem_fraction_static=(1 << 20) / ram)
    full = model.pool_bytes_per_token()
    slots = pool_sizes(args, cfg, full)[0]
    model.set_kv_cache_dtype(torch.float16)
    assert model.pool_bytes_per_token() * 2 == full
    assert pool_sizes(args, cfg, model.pool_bytes_per_token())[0] == 2 * slots
    assert model.make_pool(64, 4).k[0].dtype == torch.float16


def test_models_with_other_pool_state_refuse_it(tmp_path):
    path = make_kimi(str(tmp_path / "kimi"), "kda_mla")
    with pytest.raises(ValueError, match="--kv-cache-dtype float16: KimiLinearForCausalLM keeps its pools in "
                                         "float32, int8, fp8_e4m3, fp8_e5m2; use one of them, or auto"):
        Engine(path, kv_cache_dtype="float16", max_total_tokens=256)
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8: use one of auto, float32, float16, bfloat16"):
        Engine(path, kv_cache_dtype="fp8", max_total_tokens=256)
