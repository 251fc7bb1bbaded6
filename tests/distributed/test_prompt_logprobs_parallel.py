"""Prompt logprobs under tensor parallelism (the LM head over the ranks' vocabulary slices) and DP
attention (a request run by another group, its logprobs sent back to the caller; max_new_tokens 0
included): the same values and alternatives as one process (itself checked against transformers in
tests/engine/test_prompt_logprobs.py)."""
from __future__ import annotations

import pytest
from parallel_fixtures import COMMON, PROMPTS

from sparkserve import Engine

LP = dict(return_logprob=True, top_logprobs_num=3, logprob_start_len=0)
SP = {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True}


def prompt_logprobs(eng: Engine, **kw) -> list:
    outs = eng.generate(input_ids=PROMPTS, sampling_params=SP, **LP, **kw)
    outs.append(eng.generate(input_ids=PROMPTS[1], sampling_params={"max_new_tokens": 0}, **LP, **kw))
    return [(o["output_ids"], o["meta_info"]["input_token_logprobs"], o["meta_info"]["input_top_logprobs"])
            for o in outs]


def assert_close(got: list, want: list) -> None:
    for (ids, lps, tops), (w_ids, w_lps, w_tops) in zip(got, want, strict=True):
        assert ids == w_ids and [t for _, t in lps] == [t for _, t in w_lps]
        assert [lp for lp, _ in lps[1:]] == pytest.approx([lp for lp, _ in w_lps[1:]], abs=1e-4)
        assert [[t for _, t in top] for top in tops[1:]] == [[t for _, t in top] for top in w_tops[1:]]


@pytest.mark.parametrize("layout", [dict(tp_size=2), dict(tp_size=2, dp_size=2, enable_dp_attention=True)],
                         ids=["tp2", "dp2"])
def test_prompt_logprobs_equal_one_process(llama_dir, layout):
    want = prompt_logprobs(Engine(llama_dir, **COMMON))
    with Engine(llama_dir, **layout, **COMMON) as eng:
        kw = {"routed_dp_rank": 1} if "dp_size" in layout else {}
        assert_close(prompt_logprobs(eng, **kw), want)
