"""MiniMax-M3 (block-sparse attention, lightning indexer, index K/V pools, MoE) vs transformers.

A tiny random `minimax_m3_vl_text` checkpoint (hidden 64, 3 layers: dense attention + dense MLP,
then two sparse-attention MoE layers; index block 4, top-3 blocks, 1 local block) so prompts of
40-100 tokens really drop blocks. Logits go through the serving path (pool, slot table,
ModelRunner) and are checked row by row against one transformers forward over the full
sequence. The index value path (not in transformers) is checked against a plain per-query
loop over the full sequence hooked onto the transformers model."""
from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch
from conftest import assert_no_kv_leak
from dspark_fixtures import (
    dspark_single_thread,  # noqa: F401 (autouse: one torch thread)
    engine,
    generate_ids,
    make_oracle_draft,
    make_random_draft,
)
from minimax_fixtures import TINY, VOCAB
from test_model_logits import Driver

from sparkserve.executor.model_runner import ModelRunner
from sparkserve.layers import sparse_indexer
from sparkserve.mem.cache_manager import KVCacheManager
from sparkserve.models.registry import load_config, load_model

VALUE_FLAGS = [1, 1, 0]     # sparse_disable_index_value: layer 1 K-only, layer 2 with index value


def rand_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(K-only dir, index-value dir, transformers model, extra value weights)."""
    from safetensors.torch import load_file, save_file
    from transformers import MiniMaxM3VLForCausalLM, MiniMaxM3VLTextConfig
    root = tmp_path_factory.mktemp("minimax_m3")
    torch.manual_seed(0)
    MiniMaxM3VLForCausalLM(MiniMaxM3VLTextConfig(**TINY)).save_pretrained(root / "k_only")
    hf = MiniMaxM3VLForCausalLM.from_pretrained(root / "k_only", dtype=torch.float32,
                                                attn_implementation="eager").eval().requires_grad_(False)
    # Index-value variant: same weights + index v/o projections on layer 2, flag per layer.
    shutil.copytree(root / "k_only", root / "value")
    g = torch.Generator().manual_seed(1)
    extra = {"model.layers.2.self_attn.indexer.v_proj.weight": torch.randn(16, 64, generator=g) * 0.15,
             "model.layers.2.self_attn.indexer.o_proj.weight": torch.randn(64, 32, generator=g) * 0.15}
    w = load_file(root / "value" / "model.safetensors")
    save_file({**w, **extra}, root / "value" / "model.safetensors", metadata={"format": "pt"})
    set_config(root / "value", sparse_disable_index_value=VALUE_FLAGS)
    return str(root / "k_only"), str(root / "value"), hf, extra


def set_config(path, **kv) -> None:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(kv)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


def driver(path: str, num_slots: int = 1024) -> Driver:
    cfg = load_config(path)
    model = load_model(path, cfg)
    cache = KVCacheManager(num_slots, 1, 8, cfg.context_length + 1, disable_radix_cache=True)
    return Driver(ModelRunner(model, model.make_pool(num_slots, 8), cache.req_to_token.table), cache)


@pytest.fixture
def selection_stats(monkeypatch):
    """Counts visible vs selected blocks over every query the indexer scores."""
    stats = {"visible": 0, "selected": 0}
    orig = sparse_indexer.select_blocks

    def recording(scores, qpos, block_size, *a, **kw):
        ids = orig(scores, qpos, block_size, *a, **kw)
        stats["visible"] += int((qpos // block_size + 1).sum()) * scores.shape[1]
        stats["selected"] += int((ids >= 0).sum())
        return ids
    monkeypatch.setattr(sparse_indexer, "select_blocks", recording)
    return stats


@torch.inference_mode()
def check_rows(drv: Driver, reference, rel_atol: float = 2e-5) -> int:
    """Every logit row we produced vs reference(tokens) over the full sequence."""
    n = 0
    for seq in drv.seqs:
        ref = reference(seq.tokens)
        scale = max(1.0, ref.abs().max().item())
        for pos, ours in seq.logits.items():
            err = (ours - ref[pos]).abs().max().item()
            assert err <= rel_atol * scale, \
                f"position {pos}/{len(seq.tokens)}: |diff| {err:.3g} (scale {scale:.3g})"
            n += 1
    return n


def hf_reference(hf):
    return lambda toks: hf(torch.tensor([toks])).logits[0].float()


def decode_schedule(drv: Driver) -> None:
    """A: prefill 40, then 14 decode steps; B: chunked prefill 13 at a time to 65, then decode
    alongside A; C: a 3-token prompt (shorter than one top-k budget) decoding alongside."""
    a, b, c = drv.new_seq(), drv.new_seq(), drv.new_seq()
    ta, tb, tc = rand_tokens(54, 1), rand_tokens(75, 2), rand_tokens(13, 3)
    drv.step([(a, ta[:40]), (b, tb[:13])])
    for i in range(13, 65, 13):
        drv.step([(a, [ta[39 + i // 13]]), (b, tb[i:i + 13])])
    drv.step([(c, tc[:3])])
    for i in range(10):
        drv.step([(a, [ta[44 + i]]), (b, [tb[65 + i]]), (c, [tc[3 + i]])])


# ---- K-only model vs transformers --------------------------------------------------------------
def test_prefill_logits_match_transformers(ckpt, selection_stats):
    """One batched EXTEND of prompts of 100, 47 and 5 tokens: every row equals transformers,
    and the indexer really drops blocks."""
    k_only, _, hf, _ = ckpt
    drv = driver(k_only)
    seqs = [drv.new_seq() for _ in range(3)]
    drv.step([(s, rand_tokens(n, 10 + n)) for s, n in zip(seqs, (100, 47, 5))])
    assert check_rows(drv, hf_reference(hf)) == 152
    assert selection_stats["selected"] < 0.5 * selection_stats["visible"], selection_stats


def test_incremental_decode_and_chunked_prefill_match_full_forward(ckpt, selection_stats):
    k_only, _, hf, _ = ckpt
    drv = driver(k_only)
    decode_schedule(drv)
    assert check_rows(drv, hf_reference(hf)) == 54 + 75 + 13
    assert selection_stats["selected"] < 0.5 * selection_stats["visible"], selection_stats


def test_select_blocks_matches_plain_loop():
    """Vectorised selection (local AND initial blocks forced, -1 padding) vs a per-query loop."""
    g = torch.Generator().manual_seed(0)
    B, H, L, bs = 2, 2, 37, 4
    qpos = torch.tensor([[3, 17, 36], [0, 8, 20]])
    scores = torch.randn(B, H, 3, L, generator=g)
    scores = scores.masked_fill(torch.arange(L)[None, None, None, :] > qpos[:, None, :, None], float("-inf"))
    for topk, local, init in [(3, 1, 0), (4, 2, 1), (2, 1, 1), (12, 1, 0)]:
        ids = sparse_indexer.select_blocks(scores, qpos, bs, topk, local, init)
        for b in range(B):
            for h in range(H):
                for q in range(3):
                    p = int(qpos[b, q])
                    nvis = p // bs + 1
                    best = {blk: scores[b, h, q, blk * bs:min(p + 1, (blk + 1) * bs)].max().item()
                            for blk in range(nvis)}
                    forced = {blk for blk in range(nvis) if blk > p // bs - local or blk < init}
                    rest = sorted(set(best) - forced, key=lambda k: -best[k])
                    want = forced | set(rest[:max(0, topk - len(forced))])
                    got = [int(i) for i in ids[b, h, q]]
                    assert set(i for i in got if i >= 0) == want and got.count(-1) == len(got) - len(want)


def test_engine_batched_equals_one_by_one(ckpt):
    """Continuous batching of different-length requests (sparse decode reads each request's own
    blocks through its slot table) gives each request's solo greedy tokens."""
    k_only = ckpt[0]
    prompts = [rand_tokens(n, 20 + n) for n in (5, 33, 61, 90)]
    sp = dict(temperature=0, max_new_tokens=12, ignore_eos=True)
    eng = engine(k_only, max_total_tokens=1024)
    batched = generate_ids(eng, prompts, sp)
    solo = [generate_ids(engine(k_only, max_total_tokens=1024, disable_radix_cache=True), [p], sp)[0]
            for p in prompts]
    assert batched == solo
    assert all(len(o) == 12 for o in batched)
    # Again on the same engine: prompts now hit the prefix cache (cached index K rows reused).
    again = eng.generate(input_ids=prompts, sampling_params=sp)
    assert [o["output_ids"] for o in again] == solo
    assert all(o["meta_info"]["cached_tokens"] >= len(p) - 1 for o, p in zip(again, prompts))
    assert_no_kv_leak(eng.scheduler.cache)


# ---- index value path --------------------------------------------------------------------------
def value_reference(hf, extra):
    """transformers (K-only selection and main attention) + a hook adding the index value
    output of layer 2, computed query by query over the full sequence with no cache."""
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import apply_rotary_pos_emb
    wv = extra["model.layers.2.self_attn.indexer.v_proj.weight"]
    wo = extra["model.layers.2.self_attn.indexer.o_proj.weight"]

    def hook(attn, args, kwargs, output):
        x = kwargs["hidden_states"]
        ix, (cos, sin) = attn.indexer, kwargs["position_embeddings"]
        T, D, Hi = x.shape[1], ix.head_dim, ix.num_heads
        q = ix.q_norm(ix.q_proj(x).view(1, T, Hi, D)).transpose(1, 2)
        k = ix.k_norm(ix.k_proj(x).view(1, T, 1, D)).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos[..., :D], sin[..., :D])
        v = x[0] @ wv.T
        out = torch.zeros(T, Hi * D)
        for t in range(T):
            for h in range(Hi):
                p = torch.softmax(k[0, 0, :t + 1] @ q[0, h, t] / math.sqrt(D), dim=0)
                out[t, h * D:(h + 1) * D] = p @ v[:t + 1]
        return (output[0] + (out @ wo.T)[None], *output[1:])

    def run(toks):
        handle = hf.model.layers[2].self_attn.register_forward_hook(hook, with_kwargs=True)
        try:
            return hf(torch.tensor([toks])).logits[0].float()
        finally:
            handle.remove()
    return run


def test_index_value_decode_matches_full_recompute(ckpt):
    _, value, hf, extra = ckpt
    drv = driver(value)
    comps = {c.name: c for c in drv.runner.kv_pool.components()}
    assert comps["index_k"].layer_ids == [1, 2] and comps["index_v"].layer_ids == [2]
    decode_schedule(drv)
    assert check_rows(drv, value_reference(hf, extra)) == 54 + 75 + 13
    # ... and the value path matters: the K-only transformers logits are far off.
    seq = drv.seqs[0]
    ref = hf_reference(hf)(seq.tokens)
    assert max((seq.logits[i] - ref[i]).abs().max().item() for i in seq.logits) > 1e-2


def test_index_value_flag_off_is_k_only_model(ckpt, tmp_path):
    """The same checkpoint (value weights still in it) with every flag set to 1: the K-only
    model, equal to transformers, and no index_v pool."""
    _, value, hf, _ = ckpt
    off = tmp_path / "off"
    shutil.copytree(value, off)
    set_config(off, sparse_disable_index_value=[1, 1, 1])
    drv = driver(str(off))
    assert "index_v" not in {c.name for c in drv.runner.kv_pool.components()}
    s = drv.new_seq()
    toks = rand_tokens(70, 5)
    drv.step([(s, toks[:50])])
    for t in toks[50:]:
        drv.step([(s, [t])])
    assert check_rows(drv, hf_reference(hf)) == 70


# ---- serving features --------------------------------------------------------------------------
@pytest.mark.parametrize("draft_kind,mode", [("random", "full"), ("random", "threshold"), ("fitted", "full")])
def test_dspark_greedy_identical_to_plain(ckpt, tmp_path, draft_kind, mode):
    """DSpark verify forwards (several query tokens per request through the sparse path) leave
    greedy output token-identical to plain decoding: a random draft (nearly all rejected) and
    one fitted to the plain outputs (multi-token accepts, rejections mid-block)."""
    _, value, _, _ = ckpt
    prompts = [rand_tokens(n, 30 + n) for n in (3, 30, 70)]
    sp = dict(temperature=0, max_new_tokens=16, ignore_eos=True)
    ref = generate_ids(engine(value), prompts, sp)
    if draft_kind == "random":
        draft = make_random_draft(value, str(tmp_path / "draft"), block_size=4)
    else:
        bigram = [0] * VOCAB
        for p, o in zip(prompts, ref):
            for a, b in zip(p[-1:] + o, o):
                bigram[a] = b
        draft = make_oracle_draft(value, str(tmp_path / "draft"), bigram, block_size=4)
    eng = engine(value, draft, mode)
    assert generate_ids(eng, prompts, sp) == ref
    hist = eng.scheduler.accept_hist
    assert sum(hist.values()) > 0 and (draft_kind == "random" or max(hist) >= 2), hist
    assert_no_kv_leak(eng.scheduler.cache)


def test_retraction_small_pool_and_components(ckpt):
    """An 80-token pool (page 4, chunked prefill 16) cannot hold the batch: requests are
    retracted and recomputed, with the tokens of a big pool; the pool describes its index K/V."""
    _, value, _, _ = ckpt
    prompts = [rand_tokens(n, 40 + n) for n in (30, 45, 25, 50)]
    sp = dict(temperature=0, max_new_tokens=20, ignore_eos=True)
    ref = generate_ids(engine(value, max_total_tokens=1024, disable_radix_cache=True), prompts, sp)
    small = engine(value, max_total_tokens=80, page_size=4, chunked_prefill_size=16)
    assert generate_ids(small, prompts, sp) == ref
    assert small.scheduler.num_retractions > 0
    assert_no_kv_leak(small.scheduler.cache)
    pool = small.scheduler.runner.kv_pool
    kinds = {c.name: (c.kind, c.layer_ids) for c in pool.components()}
    assert kinds == {"k": ("token_page", [0, 1, 2]), "v": ("token_page", [0, 1, 2]),
                     "index_k": ("token_page", [1, 2]), "index_v": ("token_page", [2])}
    model = small.scheduler.runner.model
    assert model.pool_bytes_per_token() == 4 * (2 * 3 * 2 * 16 + 2 * 16 + 16)
