"""DP attention (--enable-dp-attention --dp-size D --tp-size T, gloo, 1 torch thread per rank):
each attention group schedules its own requests on its own KV pool and prefix cache, the
groups' tokens meet in every layer's MLP / MoE, and the greedy tokens and logprobs are the
single-process engine's, on Llama, Kimi-Linear and MiniMax-M3, with attention split inside a
group (T 4, D 2) or not (T 2, D 2); DSpark stays lossless with one group idle while the other
verifies; requests go where routed_dp_rank says, or by round robin / shortest queue; bad layouts
are refused at start-up naming the flags."""
from __future__ import annotations

import pytest
import torch
from conftest import TINY_CONFIGS, assert_no_kv_leak
from dspark_fixtures import make_oracle_draft
from family_fixtures import make_family_checkpoint
from kimi_fixtures import VOCAB as KIMI_VOCAB
from kimi_fixtures import make_kimi
from minimax_fixtures import make_minimax, with_index_value
from parallel_fixtures import COMMON, PROMPTS, SP, assert_same, bigram_of, run_mixed

from sparkserve import Engine
from sparkserve.args import ServerArgs
from sparkserve.distributed.sharding import check_tp
from sparkserve.frontend.prepare import params_list
from sparkserve.models.registry import load_config, model_class

DP2 = dict(tp_size=2, dp_size=2, enable_dp_attention=True)


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp_moe")
    return {"kimi": make_kimi(str(root / "kimi"), "kda_mla"),
            "minimax": with_index_value(make_minimax(str(root / "minimax"))),
            "deepseek_v2": make_family_checkpoint("deepseek_v2", str(root / "deepseek_v2"))}


def _groups_used(eng) -> set[int]:
    return {g for _, g in eng.scheduler.remote.values()}


@pytest.mark.parametrize("arch,layout", [("llama", DP2), ("llama", dict(DP2, tp_size=4)),
                                         ("kimi", dict(DP2, ep_size=2)), ("minimax", dict(DP2, ep_size=2)),
                                         ("deepseek_v2", dict(DP2, ep_size=2))])
def test_dp_attention_equals_one_process(arch, layout, llama_dir, moe_dirs):
    """Round robin puts prompts 0 and 2 on group 0, 1 and 3 on group 1: the groups' steps hold
    different requests and token counts (prefill chunks beside decodes, one group finishing
    first and then running IDLE forwards), and prompt 3 reads prompt 1's prefix from group 1's
    cache (Llama; the hybrid models keep recurrent state and run without it). DeepSeek-V2: MLA
    latents with rope in each group's pool, its routed experts split over the two ranks."""
    path = llama_dir if arch == "llama" else moe_dirs[arch]
    want = run_mixed(Engine(path, **COMMON))
    with Engine(path, **layout, **COMMON) as eng:
        got = run_mixed(eng)
        if arch == "llama":
            assert got[3]["meta_info"]["cached_tokens"] >= 16
        assert_no_kv_leak(eng.scheduler.local.cache)
        assert eng.scheduler.load().num_used_tokens == 0          # group 1's pool is empty too
    assert_same(got, want)


def test_hidden_states_and_flush_under_dp_attention(llama_dir):
    """return_hidden_states of a request run by the other group reach the caller; the prefix
    cache of every group flushes."""
    kw = dict(COMMON, disable_radix_cache=True, enable_return_hidden_states=True)
    sp = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    want = Engine(llama_dir, **kw).generate(input_ids=PROMPTS[:2], sampling_params=sp,
                                            return_hidden_states=True)
    prompt_only = Engine(llama_dir, **kw).generate(input_ids=PROMPTS[1], return_hidden_states=True,
                                                   sampling_params={"max_new_tokens": 0})
    with Engine(llama_dir, **DP2, **kw) as eng:
        got = eng.generate(input_ids=PROMPTS[:2], sampling_params=sp, return_hidden_states=True,
                           routed_dp_rank=1)
        got.append(eng.generate(input_ids=PROMPTS[1], return_hidden_states=True, routed_dp_rank=1,
                                sampling_params={"max_new_tokens": 0}))      # prefill only, on group 1
        assert eng.flush_cache()
    assert got[2]["output_ids"] == [] and got[2]["meta_info"]["finish_reason"]["type"] == "length"
    for g, w in zip(got, want + [prompt_only]):
        assert g["output_ids"] == w["output_ids"]
        torch.testing.assert_close(g["meta_info"]["hidden_states"], w["meta_info"]["hidden_states"],
                                   atol=1e-4, rtol=1e-4)


def test_abandoned_requests_free_every_group(llama_dir):
    """generate_many's consumer stops after the first result: the requests still running in
    either group are aborted and every group's pool is free again; the engine keeps serving."""
    sp = {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True}
    with Engine(llama_dir, **DP2, **COMMON) as eng:
        results = eng.generate_many(PROMPTS, sampling_params=sp, max_in_flight=4)
        next(results)
        results.close()
        while eng.scheduler.has_work():
            eng.scheduler.step()
        assert eng.scheduler.load().num_used_tokens == 0 and not eng.scheduler.remote
        assert len(eng.generate(input_ids=PROMPTS[0], sampling_params=sp)["output_ids"]) == 30


@pytest.mark.parametrize("arch", ["llama", "kimi", "deepseek_v2"])
def test_dspark_with_one_group_idle(arch, llama_dir, moe_dirs, tmp_path):
    """Every request on group 1: group 0 runs IDLE forwards while group 1 drafts and verifies
    (Kimi: KDA state committed after each verify; DeepSeek-V2: MLA latents); then both groups
    speculate at once."""
    path = llama_dir if arch == "llama" else moe_dirs[arch]
    vocab = {"llama": TINY_CONFIGS["llama"]["vocab_size"], "kimi": KIMI_VOCAB,
             "deepseek_v2": load_config(path).vocab_size}[arch]
    sp = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    plain = Engine(path, **COMMON).generate(input_ids=PROMPTS, sampling_params=sp)
    draft = make_oracle_draft(path, str(tmp_path / "draft"),
                              bigram_of(PROMPTS, [o["output_ids"] for o in plain], vocab), block_size=4)
    layout = DP2 if arch == "llama" else dict(DP2, ep_size=2)
    with Engine(path, **layout, speculative_algorithm="DSPARK", speculative_draft_model_path=draft,
                speculative_dspark_verify_mode="full", **COMMON) as eng:
        routed = eng.generate(input_ids=PROMPTS, sampling_params=sp, routed_dp_rank=1)
        assert eng.scheduler.local.num_forwards == 0            # group 0 only ran IDLE forwards
        both = eng.generate(input_ids=PROMPTS, sampling_params=sp)
        hist = eng.scheduler.load().spec_accept_hist
    for got in (routed, both):
        assert [g["output_ids"] for g in got] == [o["output_ids"] for o in plain]
    assert sum(k * v for k, v in hist.items()) > 0 and hist.get(0, 0) > 0, hist    # accepts and misses
    assert eng.scheduler.local.accept_hist                     # group 0 verified in the second run


def test_dspark_adaptive_plans_per_group(llama_dir, tmp_path):
    """Adaptive verify: each group's driver measures its own step costs at start-up (forwards the
    groups run in step) and plans its own verify budgets; tokens stay the plain ones."""
    sp = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    plain = Engine(llama_dir, **COMMON).generate(input_ids=PROMPTS, sampling_params=sp)
    draft = make_oracle_draft(llama_dir, str(tmp_path / "draft"),
                              bigram_of(PROMPTS, [o["output_ids"] for o in plain], 320), block_size=4)
    with Engine(llama_dir, **DP2, speculative_algorithm="DSPARK", speculative_draft_model_path=draft,
                speculative_dspark_verify_mode="adaptive", **COMMON) as eng:
        assert eng.scheduler.local.spec.planner.costs is not None
        got = eng.generate(input_ids=PROMPTS, sampling_params=sp)
    assert [g["output_ids"] for g in got] == [o["output_ids"] for o in plain]


def test_load_balancing_and_routing(llama_dir):
    """shortest_queue sends a new request to the group holding fewer (ties: the lowest group);
    routed_dp_rank overrides it; out of range is refused; outputs stay the single-process ones."""
    want = Engine(llama_dir, **COMMON).generate(input_ids=PROMPTS, sampling_params=SP)
    with Engine(llama_dir, **DP2, load_balance_method="shortest_queue", **COMMON) as eng:
        a = eng._submit(PROMPTS[0], eng_params(SP), routed_dp_rank=0)      # group 0 holds one
        b = eng._submit(PROMPTS[1], eng_params(SP))                         # -> group 1 (0 < 1)
        assert _groups_used(eng) == {1}
        c = eng._submit(PROMPTS[2], eng_params(SP))                         # 1 : 1 -> group 0
        d = eng._submit(PROMPTS[3], eng_params(SP), routed_dp_rank=0)      # routed: group 0 (3 : 1)
        assert eng.scheduler.queued(0) == 3 and eng.scheduler.queued(1) == 1
        got = eng._run_to_completion([a, b, c, d])
        assert_no_kv_leak(eng.scheduler.local.cache)
        with pytest.raises(ValueError, match=r"routed_dp_rank 2: .* 2 DP attention group\(s\); use 0..1"):
            eng.generate(input_ids=PROMPTS[0], sampling_params=SP, routed_dp_rank=2)
    assert_same(got, want)
    with Engine(llama_dir, **DP2, **COMMON) as eng:                    # round robin: 0, 1, 0, 1
        reqs = [eng._submit(ids, eng_params(SP)) for ids in PROMPTS]
        assert [g for _, g in eng.scheduler.remote.values()] == [1, 1]
        assert [r.rid for r in eng.scheduler.local.waiting] == [reqs[0][0].rid, reqs[2][0].rid]
        assert_same(eng._run_to_completion(reqs), want)


def eng_params(sp: dict):
    return params_list(sp, 1)[0]


def test_bad_dp_layouts_are_refused(llama_dir):
    def refused(match: str, **kw) -> None:
        with pytest.raises(ValueError, match=match):
            ServerArgs(llama_dir, **kw).validate()
    refused(r"--dp-size 2 without --enable-dp-attention", tp_size=2, dp_size=2)
    refused(r"--tp-size 3 must be a multiple of --dp-size 2", tp_size=3, dp_size=2, enable_dp_attention=True)
    refused(r"--enable-dp-attention with --pp-size 2: not supported", tp_size=2, dp_size=2, pp_size=2,
            enable_dp_attention=True)
    refused(r"--enable-dp-lm-head needs --enable-dp-attention", enable_dp_lm_head=True)
    refused(r"--load-balance-method fastest: use one of round_robin, shortest_queue",
            load_balance_method="fastest")
    # attention splits over tp / dp ranks, the MLP over all tp ranks: each is checked on its own
    cfg = load_config(llama_dir)            # 4 heads, 2 KV heads, 128 MLP channels
    dims = model_class(cfg).tp_dims(cfg)
    with pytest.raises(ValueError, match=r"--tp-size 8: the model's 4 attention heads do not split"):
        check_tp(cfg, 8, 1, dims)
    check_tp(cfg, 8, 1, dims, attn_tp=4)     # dp 2: attention over 4 ranks, MLP over 8
    check_tp(cfg, 8, 1, dims, attn_tp=1)     # dp 2 x cp 4: whole heads on each rank
    msg = (r"--tp-size 16 over --dp-size x --attn-cp-size \(attention over 8 ranks\): the model's 4 "
           r"attention heads do not split over 8 ranks; use one of 1, 2, 4")
    with pytest.raises(ValueError, match=msg):
        check_tp(cfg, 16, 1, dims, attn_tp=8)
