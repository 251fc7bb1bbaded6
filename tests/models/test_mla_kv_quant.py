"""MLA latents in a quantized pool (--kv-cache-dtype int8 / fp8_e4m3), DeepSeek-V2's (with rope) and
Kimi-Linear's (NoPE, beside float32 KDA state): the latent row is stored with its block scales (a
component of its own, so PD moves it) and only the gathered rows are dequantized. On the tiny
models the logprobs stay within what the rounding costs; the bytes per token priced are what the
pool's latent components hold; PD colocated == disaggregated."""
from __future__ import annotations

import pytest
import torch
from family_fixtures import make_family_checkpoint
from kimi_fixtures import make_kimi
from pd_fixtures import assert_disaggregated_as_colocated

from sparkserve import Engine
from sparkserve.mem.kv_quant import QUANT_KV_DTYPES

KW = dict(num_threads=1, chunked_prefill_size=16, max_total_tokens=1024, activation_quant="none")
SP = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True, "return_logprob": True}
PROMPTS = [list(range(5, 45)), [7, 3, 9] * 4]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("mlaq")
    return {"deepseek_v2": make_family_checkpoint("deepseek_v2", str(root / "deepseek_v2")),
            "kimi": make_kimi(str(root / "kimi"), "kda_mla")}


# bounds on |prompt logprob - float32 pool's|, max / mean over the prompts' tokens, about twice what
# the random tiny models gave (DeepSeek-V2: int8 0.051 / 0.014, e4m3 0.36 / 0.052; Kimi-Linear's
# e4m3 0.75 / 0.051): e4m3 keeps 3 mantissa bits, int8 about 7
@pytest.mark.parametrize("model", ["deepseek_v2", "kimi"])
@pytest.mark.parametrize("name,worst,mean", [("int8", 0.1, 0.03), ("fp8_e4m3", 1.5, 0.1)])
def test_quantized_latent_reads_as_the_float32_latent(name, worst, mean, model, models):
    """Teacher-forced over the prompts (prefill chunks, then cached prefixes), the prompt logprobs
    of a quantized latent stay within the bounds of a float32 latent's."""
    lps = {}
    for dtype in ("float32", name):
        eng = Engine(models[model], **KW, kv_cache_dtype=dtype)
        lps[dtype] = torch.tensor([lp for p in PROMPTS for lp, _ in eng.generate(
            input_ids=p, sampling_params={"max_new_tokens": 0}, return_logprob=True,
            logprob_start_len=0)["meta_info"]["input_token_logprobs"][1:]])
        if dtype == name:
            comps = {c.name: c for c in eng.scheduler.runner.kv_pool.components()}
            assert comps["kv_latent"].tensors[0].dtype == QUANT_KV_DTYPES[name]
            assert f"kv_latent_scale_{name}" in comps
            per_token = sum(c.tensors[0][0].nbytes * len(c.tensors) for n, c in comps.items()
                            if n.startswith("kv_latent"))
            assert eng.scheduler.runner.model.pool_bytes_per_token() == per_token
    diff = (lps[name] - lps["float32"]).abs()
    assert 0 < diff.max() <= worst and diff.mean() <= mean, (diff.max(), diff.mean())


@pytest.mark.parametrize("model", ["deepseek_v2", "kimi"])
def test_quantized_latent_moves_with_its_scales(model, models):
    assert_disaggregated_as_colocated(models[model], dict(KW, kv_cache_dtype="int8"), PROMPTS, SP)
