"""MiniMax-M3 in a quantized pool (--kv-cache-dtype int8 / fp8_e4m3): its full-attention K/V, the
sparse layers' K/V and the indexer's index K and index V are stored with block scales (components of
their own, which PD moves) and only gathered rows are dequantized. On the tiny MiniMax-M3 with its
index-value path: prompt logprobs within a stated bound of a float32 pool's (teacher-forced, so the
sparse block choice sees the same context), and PD colocated == disaggregated."""
from __future__ import annotations

import pytest
import torch
from minimax_fixtures import make_minimax, with_index_value
from pd_fixtures import assert_disaggregated_as_colocated

from sparkserve import Engine

KW = dict(num_threads=1, chunked_prefill_size=16, max_total_tokens=1024, activation_quant="none")
SP = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True, "return_logprob": True}
PROMPTS = [list(range(5, 45)), [7, 3, 9] * 4]


@pytest.fixture(scope="module")
def minimax(tmp_path_factory) -> str:
    return with_index_value(make_minimax(str(tmp_path_factory.mktemp("mmq") / "minimax")))


def prompt_logprobs(eng: Engine) -> torch.Tensor:
    return torch.tensor([lp for p in PROMPTS for lp, _ in eng.generate(
        input_ids=p, sampling_params={"max_new_tokens": 0}, return_logprob=True,
        logprob_start_len=0)["meta_info"]["input_token_logprobs"][1:]])


# |prompt logprob - float32 pool's|, max / mean over the prompts' tokens: about twice what the random
# tiny model gave (int8 0.16 / 0.014; the max where the rounding moved a near-tied sparse block choice)
@pytest.mark.parametrize("name,worst,mean", [("int8", 0.3, 0.03), ("fp8_e4m3", 0.6, 0.1)])
def test_quantized_pool_reads_as_the_float32_pool(name, worst, mean, minimax):
    ref = prompt_logprobs(Engine(minimax, **KW, kv_cache_dtype="float32"))
    eng = Engine(minimax, **KW, kv_cache_dtype=name)
    names = {c.name for c in eng.scheduler.runner.kv_pool.components()}
    assert {f"{b}_scale_{name}" for b in ("k", "v", "index_k", "index_v")} <= names
    diff = (prompt_logprobs(eng) - ref).abs()
    assert 0 < diff.max() <= worst and diff.mean() <= mean, (diff.max(), diff.mean())


def test_quantized_pool_moves_with_its_scales(minimax):
    assert_disaggregated_as_colocated(minimax, dict(KW, kv_cache_dtype="int8"), PROMPTS, SP)
