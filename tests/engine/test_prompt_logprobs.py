"""Prompt logprobs (SGLang's return_logprob + logprob_start_len, top_logprobs_num): each prompt
token's logprob equals transformers' log-softmax of the prompt, with chunked prefill (each chunk
computes its rows), a warm prefix cache (owed rows are computed again), a start in the middle,
max_new_tokens 0 (the prompt only) and a batch of prompts asking different things."""
from __future__ import annotations

import pytest
import torch

from sparkserve import Engine
from tests.conftest import assert_no_kv_leak, hf_logits

TOP = 3


@pytest.fixture(scope="module")
def eng(llama_dir):
    return Engine(llama_dir, max_total_tokens=2048, page_size=4, chunked_prefill_size=16)


def prompt_of(n: int, seed: int) -> list[int]:
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference(hf, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row i is the log-distribution of prompt token i + 1."""
    return torch.log_softmax(hf_logits(hf, prompt)[:-1], -1)


def check_input_logprobs(meta: dict, prompt: list[int], start: int, ref: torch.Tensor) -> None:
    got = meta["input_token_logprobs"]
    assert [t for _, t in got] == prompt[start:]
    tops = meta["input_top_logprobs"]
    assert len(tops) == len(got)
    for pos, ((lp, tok), top) in enumerate(zip(got, tops), start):
        if pos == 0:
            assert lp is None and top is None
            continue
        want = ref[pos - 1]
        assert lp == pytest.approx(want[tok].item(), abs=1e-4), pos
        vals, ids = want.topk(TOP)
        assert [t for _, t in top] == ids.tolist(), pos
        assert [v for v, _ in top] == pytest.approx(vals.tolist(), abs=1e-4)


def test_prompt_logprobs_match_transformers(eng, hf_tiny):
    hf = hf_tiny["llama"]
    prompt = prompt_of(45, seed=3)             # 45 tokens: three chunks of 16
    ref = reference(hf, prompt)
    lp = dict(return_logprob=True, top_logprobs_num=TOP)
    out = eng.generate(input_ids=prompt, sampling_params={"max_new_tokens": 0}, logprob_start_len=0, **lp)
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "length"
    check_input_logprobs(out["meta_info"], prompt, 0, ref)
    # warm: the whole prompt is cached now; the owed rows are computed again, the rest is served
    for start in (0, 1, 23, 44):
        out = eng.generate(input_ids=prompt, sampling_params={"max_new_tokens": 2, "temperature": 0},
                           logprob_start_len=start, **lp)
        check_input_logprobs(out["meta_info"], prompt, start, ref)
        assert out["meta_info"]["cached_tokens"] <= max(0, start - 1)
        assert len(out["meta_info"]["output_token_logprobs"]) == 2
    assert eng.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1})["meta_info"][
        "cached_tokens"] >= 40                 # without owed rows the cache serves the prompt
    assert_no_kv_leak(eng.scheduler.cache)


def test_batch_of_prompts_with_different_starts(eng, hf_tiny):
    hf = hf_tiny["llama"]
    prompts = [prompt_of(n, seed=10 + n) for n in (5, 33, 20)]
    starts = [0, 17, -1]
    params = [{"max_new_tokens": 3, "temperature": 0, "return_logprob": True, "top_logprobs_num": TOP,
               "logprob_start_len": s} for s in starts]
    outs = eng.generate(input_ids=prompts, sampling_params=params)
    for p, s, out in zip(prompts, starts, outs):
        if s < 0:
            assert out["meta_info"]["input_token_logprobs"] == []
        else:
            check_input_logprobs(out["meta_info"], p, s, reference(hf, p))
    assert_no_kv_leak(eng.scheduler.cache)


def test_bad_values_name_the_field(eng):
    with pytest.raises(ValueError, match="logprob_start_len must be below the prompt's length"):
        eng.generate(input_ids=[1, 2, 3], return_logprob=True, logprob_start_len=3)
    with pytest.raises(ValueError, match="logprob_start_len: prompt logprobs need return_logprob"):
        eng.generate(input_ids=[1, 2, 3], sampling_params={"logprob_start_len": 0})
    with pytest.raises(ValueError, match="logprob_start_len must be -1"):
        eng.generate(input_ids=[1, 2, 3], return_logprob=True, logprob_start_len=-2)


def test_retracted_requests_keep_their_prompt_logprobs(llama_dir, hf_tiny):
    """A pool too small for every request: requests are retracted and recomputed (a half-prefilled
    one among them); each prompt's logprobs come out once and equal transformers'."""
    eng = Engine(llama_dir, max_total_tokens=160, page_size=1, chunked_prefill_size=16)
    prompts = [prompt_of(n, seed=40 + n) for n in (30, 12, 25, 18, 9, 22, 14, 27)]
    params = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
    outs = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=TOP,
                        logprob_start_len=0)
    assert eng.scheduler.num_retractions > 0
    for p, out in zip(prompts, outs):
        check_input_logprobs(out["meta_info"], p, 0, reference(hf_tiny["llama"], p))
    assert_no_kv_leak(eng.scheduler.cache)
