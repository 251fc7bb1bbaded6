"""Prefill/decode disaggregation, the in-process core: one engine runs a prompt and samples the first
token, every component of every pool the request lives in (full KV, sliding-window pages, a split
pool's windowed slots, KDA recurrent and conv state, MLA latent, MiniMax index K and index V, the
DSpark draft's KV) is read out (mem/transfer.py) and written into a second engine's pools, and
the second engine decodes without computing the prompt: the tokens and logprobs of one colocated
engine."""
from __future__ import annotations

import pytest
import torch
from conftest import TINY_CONFIGS, assert_no_kv_leak
from dspark_fixtures import make_oracle_draft
from family_fixtures import make_family_checkpoint
from kimi_fixtures import VOCAB as KIMI_VOCAB
from kimi_fixtures import make_kimi
from minimax_fixtures import make_minimax, with_index_value
from parallel_fixtures import bigram_of
from pd_fixtures import disaggregated

from sparkserve import Engine
from sparkserve.core.forward_batch import ForwardMode

KW = dict(num_threads=1, chunked_prefill_size=16, max_total_tokens=1024)
SP = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True, "return_logprob": True,
      "top_logprobs_num": 2}
PROMPTS = [list(range(5, 45)), [7, 3, 9] * 4, list(range(5, 35)) + [1, 2]]   # the last: a prefix hit


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_dirs):
    from test_swa_pool import save_tiny
    root = tmp_path_factory.mktemp("pd")
    return {"llama": tiny_dirs["llama"],
            "windowed": save_tiny(str(root / "w8"), "mistral", sliding_window=8),
            "split": save_tiny(str(root / "qwen3"), "qwen3", head_dim=32, use_sliding_window=True,
                               sliding_window=8, max_window_layers=1),
            "kimi": make_kimi(str(root / "kimi"), "kda_mla"),
            "minimax": with_index_value(make_minimax(str(root / "minimax"))),
            "gemma3": make_family_checkpoint("gemma3", str(root / "gemma3")),
            "qwen3_moe": make_family_checkpoint("qwen3_moe", str(root / "qwen3_moe")),
            "deepseek_v2": make_family_checkpoint("deepseek_v2", str(root / "deepseek_v2"))}


def _same(got: dict, want: dict) -> None:
    assert got["output_ids"] == want["output_ids"]
    lp = torch.tensor([x[0] for x in got["meta_info"]["output_token_logprobs"]])
    ref = torch.tensor([x[0] for x in want["meta_info"]["output_token_logprobs"]])
    torch.testing.assert_close(lp, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "windowed", "split", "kimi", "minimax", "gemma3", "qwen3_moe",
                                  "deepseek_v2"])
def test_decode_continues_from_transferred_state(arch, models):
    path = models[arch]
    want = Engine(path, **KW).generate(input_ids=PROMPTS, sampling_params=SP)
    prefill, decode = Engine(path, **KW), Engine(path, **KW)
    got = [disaggregated(prefill, decode, ids, SP) for ids in PROMPTS]
    assert decode.scheduler.forward_count[ForwardMode.EXTEND] == 0      # the prompt never ran here
    if arch == "llama":      # the decode side's prefix cache held the first 30 tokens: not written again
        assert got[2]["meta_info"]["cached_tokens"] >= 30
    for g, w in zip(got, want):
        _same(g, w)
    assert_no_kv_leak(prefill.scheduler.cache)
    assert_no_kv_leak(decode.scheduler.cache)


@pytest.mark.parametrize("layouts", [("float16", "float16"), ("auto", "bfloat16")])
def test_half_precision_pools_transfer(layouts, models):
    """--kv-cache-dtype on either side: float16 pools move their rows as they are (the colocated
    float16 engine's tokens and logprobs); a float32 prefill side's rows are rounded once into a
    bfloat16 decode pool, as a bfloat16 engine would have stored them."""
    path = models["windowed"]
    want = Engine(path, **KW, kv_cache_dtype=layouts[1]).generate(input_ids=PROMPTS, sampling_params=SP)
    prefill = Engine(path, **KW, kv_cache_dtype=layouts[0])
    decode = Engine(path, **KW, kv_cache_dtype=layouts[1])
    got = [disaggregated(prefill, decode, ids, SP) for ids in PROMPTS]
    assert decode.scheduler.forward_count[ForwardMode.EXTEND] == 0
    for g, w in zip(got, want):
        if layouts[0] == layouts[1]:
            _same(g, w)
        else:     # the prefill side's attention read float32 K/V: logits move by one rounding
            assert g["output_ids"][:2] == w["output_ids"][:2]
    assert_no_kv_leak(decode.scheduler.cache)


def test_seeded_sampling_goes_on_where_prefill_left_it(models):
    """The decode side draws from the request's RNG where the prefill side's first draw left it:
    seeded sampled output equals one engine's."""
    sp = {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 12, "ignore_eos": True, "seed": 7}
    want = Engine(models["llama"], **KW).generate(input_ids=PROMPTS[0], sampling_params=sp)
    got = disaggregated(Engine(models["llama"], **KW), Engine(models["llama"], **KW), PROMPTS[0], sp)
    assert got["output_ids"] == want["output_ids"]


@pytest.mark.parametrize("arch", ["llama", "kimi"])
def test_dspark_drafts_from_the_first_decode_step(arch, models, tmp_path):
    """The draft's KV of the prompt moves too: the decode side drafts from its first step exactly
    as a colocated DSpark engine does (same verifies, same accepted drafts)."""
    path = models[arch]
    sp = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    plain = Engine(path, **KW).generate(input_ids=PROMPTS, sampling_params=sp)
    vocab = TINY_CONFIGS["llama"]["vocab_size"] if arch == "llama" else KIMI_VOCAB
    draft = make_oracle_draft(path, str(tmp_path / "d"), bigram_of(PROMPTS, [o["output_ids"] for o in plain],
                                                                   vocab), block_size=4)
    kw = dict(KW, speculative_algorithm="DSPARK", speculative_draft_model_path=draft,
              speculative_dspark_verify_mode="full")
    colocated = Engine(path, **kw).generate(input_ids=PROMPTS, sampling_params=sp)
    prefill, decode = Engine(path, **kw), Engine(path, **kw)
    got = [disaggregated(prefill, decode, ids, sp) for ids in PROMPTS]
    assert [g["output_ids"] for g in got] == [o["output_ids"] for o in plain]
    spec = ("spec_verify_ct", "spec_accept_token_num")
    assert [[g["meta_info"][k] for k in spec] for g in got] == [[c["meta_info"][k] for k in spec]
                                                                for c in colocated]
    assert sum(g["meta_info"]["spec_accept_token_num"] for g in got) > 0
