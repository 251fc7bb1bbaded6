"""Context parallel for attention (--attn-cp-size 2, gloo, 1 torch thread per rank): a long prefill
splits by tokens over the attention group's two ranks in the zigzag layout (a prompt shorter than
4 tokens does not), K/V (MLA latent, index K/V) are gathered so each rank stores the whole
sequence, Kimi's KDA layers run the gathered chunk in order, and greedy tokens and logprobs are
the single-process engine's on Llama, Mistral (sliding windows), Kimi-Linear and MiniMax-M3 (with
its index-value path), alone and under DP attention (tp 4, dp 2, cp 2); DSpark stays lossless
under DP attention + CP (the draft's KV made from the gathered, reordered taps)."""
from __future__ import annotations

import pytest
import torch
from conftest import TINY_CONFIGS, assert_no_kv_leak
from dspark_fixtures import make_oracle_draft
from family_fixtures import make_family_checkpoint
from kimi_fixtures import VOCAB as KIMI_VOCAB
from kimi_fixtures import make_kimi
from minimax_fixtures import make_minimax, with_index_value
from parallel_fixtures import COMMON, PROMPTS, assert_same, bigram_of, run_mixed

from sparkserve import Engine
from sparkserve.args import ServerArgs
from sparkserve.distributed import context_parallel
from sparkserve.layers import attention as attention_mod

CP2 = dict(tp_size=2, attn_cp_size=2)
DP2_CP2 = dict(tp_size=4, dp_size=2, enable_dp_attention=True, attn_cp_size=2)
LONG, SHORT = list(range(20, 60)), [9, 4, 7]          # 40 tokens split (2 chunks of 16 + 8); 3 do not
OTHER, OTHER_SHORT = list(range(100, 140)), [[8, 2, 5], [6, 1]]   # prompts no cache holds
SP = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True, "return_logprob": True,
      "top_logprobs_num": 3}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tiny_dirs):
    root = tmp_path_factory.mktemp("cp_models")
    return {"llama": tiny_dirs["llama"], "mistral": tiny_dirs["mistral"],
            "kimi": make_kimi(str(root / "kimi"), "kda_mla"),
            "minimax": with_index_value(make_minimax(str(root / "minimax"))),
            # issue #45's families: sliding layers with a local rope table; sinks in eager attention + MoE
            "gemma3": make_family_checkpoint("gemma3", str(root / "gemma3")),
            "gpt_oss": make_family_checkpoint("gpt_oss", str(root / "gpt_oss")),
            "deepseek_v2": make_family_checkpoint("deepseek_v2", str(root / "deepseek_v2"))}


@pytest.fixture
def shards(monkeypatch) -> list[list[int]]:
    """The token counts of each batch the driver (this process) split: its share, per request."""
    seen: list[list[int]] = []
    real = context_parallel.shard

    def recording(batch):
        out = real(batch)
        if out is not None:
            seen.append(list(out.extend_lens))
        return out
    monkeypatch.setattr(context_parallel, "shard", recording)
    return seen


@pytest.fixture
def prefill_runs(monkeypatch) -> list[list[int]]:
    """The query runs of each prefill-kernel call in the driver: a share's zigzag blocks attend
    as runs of their own."""
    seen: list[list[int]] = []
    ext = attention_mod.load_extension()

    class Spy:
        def prefill_attention(self, *args):
            seen.append(list(args[8]))
            return ext.prefill_attention(*args)

        def __getattr__(self, name):
            return getattr(ext, name)
    monkeypatch.setattr(attention_mod, "load_extension", Spy)
    return seen


def test_zigzag_layout():
    assert context_parallel.zigzag_blocks(10, 2) == [[range(0, 3), range(8, 10)], [range(3, 6), range(6, 8)]]
    rows = context_parallel.owned_rows([10, 3, 2], 2)     # one long request, two short ones
    assert [r.tolist() for r in rows] == [[0, 1, 2, 8, 9, 10, 11, 12], [3, 4, 5, 6, 7, 13, 14]]
    assert context_parallel.owned_rows([3, 1], 2) is None          # nothing of 2C tokens
    assert context_parallel.owned_rows([1] * 4, 2) is None         # decode never splits
    assert context_parallel.owned_rows([4], 4) is None             # 4 ranks need >= 8 tokens


def _extra(arch: str) -> dict:
    return dict(ep_size=2) if arch in ("kimi", "minimax", "gpt_oss", "deepseek_v2") else {}


@pytest.mark.parametrize("arch", ["llama", "mistral", "kimi", "minimax", "gemma3", "gpt_oss", "deepseek_v2"])
def test_cp_equals_one_process(arch, model_dirs, shards, prefill_runs):
    path = model_dirs[arch]
    one = Engine(path, **COMMON)
    want = ([one.generate(input_ids=p, sampling_params=SP) for p in (LONG, SHORT)] + run_mixed(one) +
            one.generate(input_ids=[OTHER, *OTHER_SHORT], sampling_params=SP))
    with Engine(path, **CP2, **_extra(arch), **COMMON) as eng:
        prefill_runs.clear()
        got = [eng.generate(input_ids=LONG, sampling_params=SP)]
        assert shards == [[8], [8], [4]]                    # chunks of 16, 16, 8 tokens: half each
        if arch in ("llama", "mistral"):                   # their attention layers: blocks 0 and 3 of 4
            assert {tuple(r) for r in prefill_runs} == {(4, 4), (2, 2)}
        got.append(eng.generate(input_ids=SHORT, sampling_params=SP))
        assert len(shards) == 3                             # 3 tokens < 2C: ran whole
        got += run_mixed(eng)
        shards.clear()
        got += eng.generate(input_ids=[OTHER, *OTHER_SHORT], sampling_params=SP)   # one batch:
        assert shards[-1] == [4, 3]           # OTHER's last 8 cut, the short ones whole on rank 0 / 1
        assert_no_kv_leak(eng.scheduler.cache)
    assert_same(got, want)


@pytest.mark.parametrize("arch", ["llama", "kimi", "minimax", "gemma3"])
def test_dp_attention_with_cp_equals_one_process(arch, model_dirs, shards):
    """tp 4 = 2 DP groups x 2 CP ranks: each group splits its own long prefills."""
    path = model_dirs[arch]
    want = run_mixed(Engine(path, **COMMON))
    extra = dict(ep_size=4) if arch in ("kimi", "minimax") else {}
    with Engine(path, **DP2_CP2, **extra, **COMMON) as eng:
        got = run_mixed(eng)
        assert shards                                       # group 0 split its prefill chunks
    assert_same(got, want)


@pytest.mark.parametrize("arch", ["llama", "kimi"])
def test_dspark_with_dp_attention_and_cp(arch, model_dirs, shards, tmp_path):
    """The case SGLang refuses: prefill taps come back gathered in sequence order, so the draft's
    KV is the single-process one; group 0 idles while group 1 runs, then both run."""
    path = model_dirs[arch]
    vocab = TINY_CONFIGS["llama"]["vocab_size"] if arch == "llama" else KIMI_VOCAB
    sp = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    prompts = PROMPTS + [LONG]
    plain = Engine(path, **COMMON).generate(input_ids=prompts, sampling_params=sp)
    draft = make_oracle_draft(path, str(tmp_path / "draft"),
                              bigram_of(prompts, [o["output_ids"] for o in plain], vocab), block_size=4)
    extra = dict(ep_size=4) if arch == "kimi" else {}
    with Engine(path, **DP2_CP2, **extra, speculative_algorithm="DSPARK", speculative_draft_model_path=draft,
                speculative_dspark_verify_mode="full", **COMMON) as eng:
        routed = eng.generate(input_ids=prompts, sampling_params=sp, routed_dp_rank=1)
        both = eng.generate(input_ids=prompts, sampling_params=sp)
        assert shards                                       # group 0 split LONG in the second run
        hist = eng.scheduler.load().spec_accept_hist
    for got in (routed, both):
        assert [g["output_ids"] for g in got] == [o["output_ids"] for o in plain]
    assert sum(k * v for k, v in hist.items()) > 0 and hist.get(0, 0) > 0, hist


def test_cp_hidden_states_in_sequence_order(model_dirs, shards):
    """return_hidden_states of a split prefill: the gathered rows in the prompt's order."""
    kw = dict(COMMON, disable_radix_cache=True, enable_return_hidden_states=True)
    sp = {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}
    want = Engine(model_dirs["llama"], **kw).generate(input_ids=LONG, sampling_params=sp,
                                                      return_hidden_states=True)
    with Engine(model_dirs["llama"], **CP2, **kw) as eng:
        got = eng.generate(input_ids=LONG, sampling_params=sp, return_hidden_states=True)
        assert shards
    torch.testing.assert_close(got["meta_info"]["hidden_states"], want["meta_info"]["hidden_states"],
                               atol=1e-4, rtol=1e-4)


def test_bad_cp_layouts_are_refused(llama_dir):
    def refused(match: str, **kw) -> None:
        with pytest.raises(ValueError, match=match):
            ServerArgs(llama_dir, **kw).validate()
    refused(r"--tp-size 3 must be a multiple of --dp-size 1 x --attn-cp-size 2", tp_size=3, attn_cp_size=2)
    refused(r"--tp-size 6 must be a multiple of --dp-size 2 x --attn-cp-size 2", tp_size=6, dp_size=2,
            enable_dp_attention=True, attn_cp_size=2)
    refused(r"--attn-cp-size 2 with attention heads split too .* give --tp-size 2", tp_size=4, attn_cp_size=2)
    refused(r"--attn-cp-size with --pp-size 2: not supported", tp_size=2, pp_size=2, attn_cp_size=2)
    refused(r"--attn-cp-size must be >= 1", attn_cp_size=0)
