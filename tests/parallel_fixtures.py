"""What the multi-rank tests share: a mixed batch (a prompt longer than the 16-token prefill
chunk, and a prompt that reads another's prefix from the cache) run on an Engine, and the check
that two runs gave the same tokens and logprobs."""
from __future__ import annotations

import torch

COMMON = dict(num_threads=1, chunked_prefill_size=16, max_total_tokens=2048)
PROMPTS = [list(range(3, 8)), list(range(10, 50)), [7, 3, 9] * 6,
           list(range(10, 40)) + [5, 6]]                      # the last one: a prefix-cache hit
SP = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True, "return_logprob": True,
      "top_logprobs_num": 3}


def act_as_rank(monkeypatch, tp_rank: int = 0, tp_size: int = 1, **state) -> None:
    """Build models here as tensor-parallel rank `tp_rank` of `tp_size` would (MLP and attention
    split alike), with other parallel_state fields as given; no process group."""
    import dataclasses

    from sparkserve.distributed import parallel_state as ps
    group = ps.Group(tp_rank, tp_size)
    monkeypatch.setattr(ps, "_state", dataclasses.replace(ps._state, tp=group, mlp=group, **state))


def run_mixed(eng) -> list[dict]:
    first = eng.generate(input_ids=PROMPTS[:3], sampling_params=SP)
    return first + [eng.generate(input_ids=PROMPTS[3], sampling_params=SP)]   # reads prompt 2's prefix


def assert_same(got: list[dict], want: list[dict]) -> None:
    """Same tokens, logprobs within 1e-4, same top-3 ids."""
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    for g, w in zip(got, want):
        lp = torch.tensor([x[0] for x in g["meta_info"]["output_token_logprobs"]])
        ref = torch.tensor([x[0] for x in w["meta_info"]["output_token_logprobs"]])
        torch.testing.assert_close(lp, ref, atol=1e-4, rtol=0)
        assert [[t for _, t in top] for top in g["meta_info"]["output_top_logprobs"]] == \
            [[t for _, t in top] for top in w["meta_info"]["output_top_logprobs"]]


def bigram_of(prompts: list[list[int]], outputs: list[list[int]], vocab: int) -> list[int]:
    """next-token map that follows the given greedy answers: an oracle draft built on it accepts
    where the answers repeat their bigrams and misses elsewhere."""
    bigram = [0] * vocab
    for p, o in zip(prompts, outputs):
        seq = p[-1:] + o
        for a, b in zip(seq, seq[1:]):
            bigram[a] = b
    return bigram


def make_tp3_llama(path: str, tied: bool) -> str:
    """A tiny Llama that splits over 3 ranks (6 heads, 3 KV heads, 96 MLP channels, hidden 96)
    with the conftest vocab of 320: 3 ranks pad it to 321, so the last one keeps one zero row."""
    from conftest import TINY_CONFIGS
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(7)
    cfg = AutoConfig.for_model("llama", **dict(TINY_CONFIGS["llama"], hidden_size=96, num_attention_heads=6,
                                               num_key_value_heads=3, intermediate_size=96,
                                               tie_word_embeddings=tied))
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return path
