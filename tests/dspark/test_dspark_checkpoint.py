"""DeepSpec-format DSpark checkpoints written here by hand (config.json + safetensors under
DeepSpec's tensor names) load into the right places, and the draft forward equals a reference
written below from the raw tensors: context K/V = k/v_proj of hidden_norm(fc(concat taps)) with
k_norm and RoPE at the true positions, one non-causal attention over [context; block], the
serial Markov head and the confidence head. Also the speculators layout, and the refusals."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
from dspark_fixtures import (
    assert_no_kv_leak,
    dspark_single_thread,  # noqa: F401 (autouse)
    engine,
    generate_ids,
    make_target,
)
from safetensors.torch import save_file

from sparkserve import kernels

TAPS = [0, 2]            # target has 4 layers: valid ids 0..2 (3 is the output layer)
N_LAYERS = 2
GAMMA = 4
MASK = 5
RANK = 8
THETA = 500.0            # distinct from the target's: the draft must use its own config
EPS = 1e-6


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_target(str(tmp_path_factory.mktemp("dspark_ckpt") / "qwen3"), "qwen3")


@pytest.fixture(scope="module")
def target_cfg(target_dir):
    with open(os.path.join(target_dir, "config.json")) as f:
        return json.load(f)


def target_model(target_dir):
    from sparkserve.models.registry import load_model
    return load_model(target_dir)


def write_checkpoint(path, tcfg: dict, *, markov: str = "vanilla", shared: bool = True, conf: bool = True,
                     conf_markov: bool = True, prefix: str = "", seed: int = 0, layout: str = "deepspec",
                     drop: tuple[str, ...] = (), extra: dict | None = None, cfg_over: dict | None = None,
                     dtype: torch.dtype = torch.float32):
    """A DSpark draft in DeepSpec's layout; returns {DeepSpec name: tensor} as written (in fp32)."""
    d, I, V = tcfg["hidden_size"], tcfg["intermediate_size"], tcfg["vocab_size"]
    H, Hkv, D = tcfg["num_attention_heads"], tcfg["num_key_value_heads"], tcfg["head_dim"]
    g = torch.Generator().manual_seed(seed)

    def w(*shape, std=0.3):
        return torch.randn(*shape, generator=g) * std

    def nw(n):                       # norm weights near 1, all different (catches mix-ups)
        return 1.0 + 0.2 * torch.randn(n, generator=g)

    t = {"fc.weight": w(d, len(TAPS) * d, std=0.15), "hidden_norm.weight": nw(d), "norm.weight": nw(d)}
    for i in range(N_LAYERS):
        p = f"layers.{i}."
        t |= {p + "self_attn.q_proj.weight": w(H * D, d), p + "self_attn.k_proj.weight": w(Hkv * D, d),
              p + "self_attn.v_proj.weight": w(Hkv * D, d), p + "self_attn.o_proj.weight": w(d, H * D,
                                                                                             std=0.1),
              p + "self_attn.q_norm.weight": nw(D), p + "self_attn.k_norm.weight": nw(D),
              p + "mlp.gate_proj.weight": w(I, d), p + "mlp.up_proj.weight": w(I, d),
              p + "mlp.down_proj.weight": w(d, I, std=0.1),
              p + "input_layernorm.weight": nw(d), p + "post_attention_layernorm.weight": nw(d)}
    t["markov_head.markov_w1.weight"] = w(V, RANK, std=1.0)
    t["markov_head.markov_w2.weight"] = w(V, RANK, std=1.0)
    if markov == "gated":
        t["markov_head.gate_proj.weight"] = w(RANK, d + RANK)
        t["markov_head.gate_proj.bias"] = w(RANK)
    if conf:
        t["confidence_head.proj.weight"] = w(1, d + (RANK if conf_markov else 0))
        t["confidence_head.proj.bias"] = w(1)
    if shared:
        t["embed_tokens.weight"] = w(V, d, std=1.0)
        t["lm_head.weight"] = w(V, d)
    for k in drop:
        del t[k]
    t |= extra or {}
    os.makedirs(path, exist_ok=True)
    t = {k: v.to(dtype).float() for k, v in t.items()}
    save_file({prefix + k: v.to(dtype).contiguous() for k, v in t.items()},
              os.path.join(path, "model.safetensors"))
    if layout == "deepspec":
        cfg = {k: v for k, v in tcfg.items() if k not in ("rope_parameters", "rope_scaling")}
        cfg |= {"architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "num_hidden_layers": N_LAYERS,
                "num_target_layers": tcfg["num_hidden_layers"], "block_size": GAMMA,
                "layer_types": ["full_attention"] * N_LAYERS, "mask_token_id": MASK, "target_layer_ids": TAPS,
                "num_anchors": 512, "enable_confidence_head": conf,
                "confidence_head_with_markov": conf_markov,
                "markov_rank": RANK, "markov_head_type": markov, "tie_word_embeddings": False,
                "rope_theta": THETA}
    else:                            # speculators layout: slot j predicts anchor + j
        inner = {k: tcfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                      "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps",
                                      "max_position_embeddings")}
        inner |= {"num_hidden_layers": N_LAYERS, "rope_theta": THETA, "model_type": "qwen3"}
        cfg = {"speculators_model_type": "dspark", "architectures": ["DSparkSpeculator"],
               "transformer_layer_config": inner, "aux_hidden_state_layer_ids": TAPS,
               "sample_from_anchor": True, "block_size": GAMMA, "mask_token_id": MASK, "markov_rank": RANK,
               "markov_head_type": markov, "enable_confidence_head": conf,
               "confidence_head_with_markov": conf_markov}
    cfg |= cfg_over or {}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return t


CASES = {
    "vanilla_shared": dict(markov="vanilla", shared=True),
    "gated_no_shared_conf_plain": dict(markov="gated", shared=False, conf_markov=False),
    "vanilla_no_conf_prefixed": dict(markov="vanilla", shared=False, conf=False, prefix="model."),
    "speculators_gated": dict(markov="gated", shared=True, layout="speculators"),
}


# ---- loading: every tensor lands where expected ---------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
def test_every_tensor_lands_in_place(target_dir, target_cfg, tmp_path, case):
    from sparkserve.models.dspark_draft import load_dspark_draft
    kw = CASES[case]
    t = write_checkpoint(str(tmp_path), target_cfg, **kw)
    target = target_model(target_dir)
    draft = load_dspark_draft(str(tmp_path), target)
    c = draft.config
    assert (c.block_size, c.mask_token_id, c.markov_rank, c.target_layer_ids) == (GAMMA, MASK, RANK, TAPS)
    assert c.markov_head_type == kw["markov"] and c.rope_theta == THETA and c.num_hidden_layers == N_LAYERS
    assert c.sample_from_anchor == (kw.get("layout") == "speculators")
    assert target.aux_layer_ids == TAPS
    Hkv, D, I = target_cfg["num_key_value_heads"], target_cfg["head_dim"], target_cfg["intermediate_size"]
    got = {"fc.weight": draft.fc.weight, "hidden_norm.weight": draft.hidden_norm.weight,
           "norm.weight": draft.norm.weight,
           "markov_head.markov_w1.weight": draft.markov_head.markov_w1.weight,
           "markov_head.markov_w2.weight": draft.markov_head.markov_w2.weight}
    for i, L in enumerate(draft.layers):
        p, a = f"layers.{i}.", L.self_attn
        got |= {p + "self_attn.q_proj.weight": a.q_proj.weight,
                p + "self_attn.k_proj.weight": a.kv_proj.weight[:Hkv * D],
                p + "self_attn.v_proj.weight": a.kv_proj.weight[Hkv * D:],
                p + "self_attn.o_proj.weight": a.o_proj.weight,
                p + "self_attn.q_norm.weight": a.q_norm.weight,
                p + "self_attn.k_norm.weight": a.k_norm.weight,
                p + "mlp.gate_proj.weight": L.gate_up_proj.weight[:I],
                p + "mlp.up_proj.weight": L.gate_up_proj.weight[I:],
                p + "mlp.down_proj.weight": L.down_proj.weight,
                p + "input_layernorm.weight": L.input_layernorm.weight,
                p + "post_attention_layernorm.weight": L.post_attention_layernorm.weight}
    if kw["markov"] == "gated":
        got |= {"markov_head.gate_proj.weight": draft.markov_head.gate_proj.weight,
                "markov_head.gate_proj.bias": draft.markov_head.gate_proj.bias}
    else:
        assert draft.markov_head.gate_proj is None
    if kw.get("conf", True):
        got |= {"confidence_head.proj.weight": draft.confidence_head.proj.weight,
                "confidence_head.proj.bias": draft.confidence_head.proj.bias}
        assert draft.confidence_head.with_markov == kw.get("conf_markov", True)
    else:
        assert draft.confidence_head is None
    if kw["shared"]:
        got |= {"embed_tokens.weight": draft.embed_tokens.weight, "lm_head.weight": draft.lm_head.weight}
        assert draft.embed_tokens is not target.model.embed_tokens
    else:                         # absent from the checkpoint: the target's modules, shared
        assert draft.embed_tokens is target.model.embed_tokens and draft.lm_head is target.lm_head
    assert set(got) == set(t), set(got) ^ set(t)
    for name, tensor in t.items():
        assert torch.equal(got[name], tensor), name


# ---- the draft forward against a reference written from the raw tensors ---------------------
def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def _rope(x, pos):
    """HF rotate_half RoPE; x [T, heads, D]."""
    D = x.shape[-1]
    inv = 1.0 / THETA ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    f = pos.double()[:, None] * inv[None]
    cos, sin = torch.cat([f, f], -1).cos().float()[:, None], torch.cat([f, f], -1).sin().float()[:, None]
    x1, x2 = x[..., :D // 2], x[..., D // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_block(t, tcfg, embed, lm_head, taps, anchor: int, shift: int, markov: str, conf: bool,
                    conf_markov: bool):
    """One request: context taps [L, d] each at positions 0..L-1, block [anchor, mask x (G-1)] at
    L..L+G-1. Returns (normed hidden [G, d], greedy drafts, confidences) per DeepSpec's rules."""
    H, Hkv, D = tcfg["num_attention_heads"], tcfg["num_key_value_heads"], tcfg["head_dim"]
    L = taps[0].shape[0]
    ctx = _rms(torch.cat(taps, -1) @ t["fc.weight"].T, t["hidden_norm.weight"])
    x = embed[torch.tensor([anchor] + [MASK] * (GAMMA - 1))]
    pc, pb = torch.arange(L), torch.arange(L, L + GAMMA)
    for i in range(N_LAYERS):
        p = f"layers.{i}.self_attn."
        kn, qn = t[p + "k_norm.weight"], t[p + "q_norm.weight"]
        ck = _rope(_rms((ctx @ t[p + "k_proj.weight"].T).view(L, Hkv, D), kn), pc)
        cv = (ctx @ t[p + "v_proj.weight"].T).view(L, Hkv, D)
        h = _rms(x, t[f"layers.{i}.input_layernorm.weight"])
        q = _rope(_rms((h @ t[p + "q_proj.weight"].T).view(GAMMA, H, D), qn), pb)
        k = _rope(_rms((h @ t[p + "k_proj.weight"].T).view(GAMMA, Hkv, D), kn), pb)
        v = (h @ t[p + "v_proj.weight"].T).view(GAMMA, Hkv, D)
        K = torch.cat([ck, k]).repeat_interleave(H // Hkv, dim=1)        # [L+G, H, D]
        Vv = torch.cat([cv, v]).repeat_interleave(H // Hkv, dim=1)
        att = torch.einsum("qhd,khd->hqk", q, K) / math.sqrt(D)          # no mask: non-causal
        o = torch.einsum("hqk,khd->qhd", att.softmax(-1), Vv).reshape(GAMMA, H * D)
        x = x + o @ t[p + "o_proj.weight"].T
        h2 = _rms(x, t[f"layers.{i}.post_attention_layernorm.weight"])
        gate, up = t[f"layers.{i}.mlp.gate_proj.weight"], t[f"layers.{i}.mlp.up_proj.weight"]
        m = torch.nn.functional.silu(h2 @ gate.T) * (h2 @ up.T)
        x = x + m @ t[f"layers.{i}.mlp.down_proj.weight"].T
    hidden = _rms(x, t["norm.weight"])
    W1, W2 = t["markov_head.markov_w1.weight"], t["markov_head.markov_w2.weight"]
    prev, drafts, confs = anchor, [], []
    for k in range(shift, GAMMA):
        hk, e = hidden[k], W1[prev]
        if markov == "gated":
            gate = t["markov_head.gate_proj.weight"] @ torch.cat([hk, e]) + t["markov_head.gate_proj.bias"]
            e_used = torch.sigmoid(gate) * e
        else:
            e_used = e
        logits = lm_head @ hk + W2 @ e_used
        if conf:
            inp = torch.cat([hk, e]) if conf_markov else hk
            score = t["confidence_head.proj.weight"] @ inp + t["confidence_head.proj.bias"]
            confs.append(float(torch.sigmoid(score)))
        prev = int(logits.argmax())
        drafts.append(prev)
    return hidden, drafts, confs


@pytest.mark.parametrize("case", list(CASES))
@torch.inference_mode()
def test_draft_forward_matches_reference(target_dir, target_cfg, tmp_path, case):
    """Two requests with different context lengths in one batch (the padded-context mask path),
    context rows at scattered slots; block_hidden, and the worker's proposals (serial Markov loop,
    greedy) and confidences, equal the reference per request."""
    from sparkserve.core.req import Req
    from sparkserve.core.sampling_state import RequestSamplingState
    from sparkserve.models.dspark_draft import load_dspark_draft
    from sparkserve.sampling_params import SamplingParams
    from sparkserve.speculative.dspark_worker import DSparkWorker
    from sparkserve.speculative.planner import VerifyPlanner
    kw = CASES[case]
    t = write_checkpoint(str(tmp_path), target_cfg, **kw)
    target = target_model(target_dir)
    draft = load_dspark_draft(str(tmp_path), target)
    pool = draft.new_kv_pool(64)
    table, rows, ctx_lens, anchors, perm, refs = two_requests(draft, pool, t, target, target_cfg, kw)
    hidden = draft.block_hidden(torch.tensor(anchors), torch.tensor(ctx_lens), table[rows, :max(ctx_lens)],
                                ctx_lens, pool)
    shift = 1 if kw.get("layout") == "speculators" else 0
    for b, (ref_hidden, _, _) in enumerate(refs):
        assert torch.allclose(hidden[b], ref_hidden, atol=1e-4, rtol=1e-4), \
            (b, (hidden[b] - ref_hidden).abs().max())

    worker = DSparkWorker(draft, pool, VerifyPlanner("full"), table)
    params = SamplingParams(temperature=0.0, max_new_tokens=100)
    reqs = []
    for i, (r, n, a) in enumerate(zip(rows, ctx_lens, anchors)):
        req = Req(f"r{i}", [1] * n, params, RequestSamplingState(params))
        req.output_ids, req.row, req.kv_len = [a], r, n
        reqs.append(req)
    props = worker.propose(reqs)
    assert worker.num_drafts == GAMMA - shift
    for p, (_, drafts, confs) in zip(props, refs):
        assert p.tokens == drafts
        assert p.verify_len == GAMMA - shift
        if kw.get("conf", True):
            assert torch.allclose(p.confidence, torch.tensor(confs), atol=1e-5)
        else:
            assert p.confidence is None
    # The block attends to the injected context: other context rows change the block.
    pool.k[0][perm[0]] += 1.0
    moved = draft.block_hidden(torch.tensor(anchors), torch.tensor(ctx_lens), table[rows, :max(ctx_lens)],
                               ctx_lens, pool)
    owner = 0 if perm[0] in table[rows[0], :ctx_lens[0]] else 1
    assert not torch.allclose(moved[owner], hidden[owner]) and torch.allclose(moved[1 - owner],
                                                                              hidden[1 - owner])


def two_requests(draft, pool, t, target, target_cfg, kw):
    """Context of two requests (5 and 9 tokens) injected at scattered slots of `pool`; returns
    the slot table, its rows used, context lengths, anchors, the slots, and the reference blocks."""
    embed = t["embed_tokens.weight"] if kw["shared"] else target.model.embed_tokens.weight
    lm_head = t["lm_head.weight"] if kw["shared"] else target.lm_head.weight
    g = torch.Generator().manual_seed(3)
    ctx_lens, anchors = [5, 9], [17, 201]
    perm = (torch.randperm(63, generator=g) + 1)[:sum(ctx_lens)]
    table = torch.zeros(3, 32, dtype=torch.long)
    rows = [2, 0]
    taps_per_req, off = [], 0
    for r, n in zip(rows, ctx_lens):
        taps = [torch.randn(n, target_cfg["hidden_size"], generator=g) for _ in TAPS]
        slots = perm[off:off + n]
        off += n
        table[r, :n] = slots
        draft.inject(taps, torch.arange(n), slots, pool)
        taps_per_req.append(taps)
    shift = 1 if kw.get("layout") == "speculators" else 0
    refs = [reference_block(t, target_cfg, embed, lm_head, taps, a, shift, kw["markov"], kw.get("conf", True),
                            kw.get("conf_markov", True)) for taps, a in zip(taps_per_req, anchors)]
    return table, rows, ctx_lens, anchors, perm, refs


def native_calls(monkeypatch, method: str) -> list[int]:
    """Records each call of NativeDraftStep.<method> (the native path really ran)."""
    from sparkserve.models.dspark_native import NativeDraftStep
    calls, real = [], getattr(NativeDraftStep, method)
    monkeypatch.setattr(NativeDraftStep, method, lambda self, *a: calls.append(1) or real(self, *a))
    return calls


@pytest.mark.parametrize("case", ["vanilla_shared", "speculators_gated"])
@torch.inference_mode()
def test_native_block_pass_matches_reference(target_dir, target_cfg, tmp_path, case, monkeypatch):
    """An fp16 checkpoint (its layers kept as F16 blocks): the native block pass, with the blocks'
    own K/V in spare pool rows, equals the reference and the Python path, and leaves the context
    rows alone; a gap in the context (slot 0, masked by the Python path) falls back to Python."""
    from sparkserve.models.dspark_draft import load_dspark_draft
    kw = CASES[case]
    t = write_checkpoint(str(tmp_path), target_cfg, dtype=torch.float16, **kw)
    target = target_model(target_dir)
    draft = load_dspark_draft(str(tmp_path), target)
    draft.enable_native_step(True)
    calls = native_calls(monkeypatch, "block_hidden")
    pool = draft.new_kv_pool(64, block_rows=2 * GAMMA)
    spare = torch.arange(65, 65 + 2 * GAMMA)
    table, rows, ctx_lens, anchors, perm, refs = two_requests(draft, pool, t, target, target_cfg, kw)
    before = [k.clone() for k in pool.k]
    args = (torch.tensor(anchors), torch.tensor(ctx_lens), table[rows, :max(ctx_lens)], ctx_lens, pool)
    native = draft.block_hidden(*args, spare)
    assert calls == [1]
    python = draft.block_hidden(*args)
    assert calls == [1]
    for b, (ref_hidden, _, _) in enumerate(refs):
        assert torch.allclose(native[b], ref_hidden, atol=1e-4, rtol=1e-4), \
            (b, (native[b] - ref_hidden).abs().max())
    assert (native - python).abs().max() < 1e-5
    for k, k0 in zip(pool.k, before):
        assert torch.equal(k[:65], k0[:65])
    assert not torch.equal(pool.k[0][65:], before[0][65:])       # the block rows went to the spare rows
    assert draft.block_hidden(*args, spare[:GAMMA]).shape == native.shape and calls == [1]   # too few rows
    gap = table[rows, :max(ctx_lens)].clone()
    gap[1, 3] = 0                                                  # a slot the target gave up
    masked = draft.block_hidden(args[0], args[1], gap, ctx_lens, pool, spare)
    assert calls == [1]
    assert torch.allclose(masked[0], python[0], atol=1e-6) and not torch.allclose(masked[1], python[1])


@torch.inference_mode()
def test_int8_draft_runs_q8_0_blocks(target_dir, target_cfg, tmp_path, monkeypatch):
    """Under --activation-quant int8 the draft's own projections hold Q8_0 blocks of their weights,
    whose values the fp32 weights then take (or which they give up, where int8 takes every row
    count), and quantize their inputs to int8; the LM head it shares with the target keeps the
    target's. The native block pass equals the Python path, and both stay near the exact reference."""
    from sparkserve.kernels import Q8_0
    from sparkserve.models.dspark_draft import load_dspark_draft
    kw = CASES["vanilla_no_conf_prefixed"]                  # lm_head: the target's
    t = write_checkpoint(str(tmp_path), target_cfg, dtype=torch.float16, **kw)
    target = target_model(target_dir)
    draft = load_dspark_draft(str(tmp_path), target, activation_quant="int8")
    attn = draft.layers[0].self_attn
    for lin in (draft.fc, attn.q_proj, attn.kv_proj, draft.layers[1].down_proj):
        blocks = lin.inference_blocks()                  # held packed for the int8 kernels
        assert blocks.gguf_type == Q8_0 and blocks.is_packed and lin.activation_quant == "int8"
        assert lin.weight.is_meta == kernels.int8_beats_gemm()
        assert torch.equal(lin.dense_weight(), lin.inference_blocks().dequantize())
    assert draft.lm_head is target.lm_head and target.lm_head.activation_quant == "none"
    draft.enable_native_step(True)
    calls = native_calls(monkeypatch, "block_hidden")
    pool = draft.new_kv_pool(64, block_rows=2 * GAMMA)
    table, rows, ctx_lens, anchors, perm, refs = two_requests(draft, pool, t, target, target_cfg, kw)
    args = (torch.tensor(anchors), torch.tensor(ctx_lens), table[rows, :max(ctx_lens)], ctx_lens, pool)
    native = draft.block_hidden(*args, torch.arange(65, 65 + 2 * GAMMA))
    python = draft.block_hidden(*args)
    assert calls == [1]
    assert (native - python).abs().max() < 1e-4, (native - python).abs().max()
    for b, (ref_hidden, _, _) in enumerate(refs):      # int8 rounding through two random layers
        err = (native[b] - ref_hidden).norm() / ref_hidden.norm()
        assert 0 < err < 0.1, (b, err)


@pytest.mark.parametrize("quant", ["none", "int8"])
@torch.inference_mode()
def test_native_inject_equals_python_inject(target_dir, target_cfg, tmp_path, monkeypatch, quant):
    """Committed rows injected as draft context in one native call (fc, hidden norm, each layer's
    k|v rows of q|k|v with k norm and rotary) write the Python path's K/V at
    scattered slots and positions, and no other slot; an fp32 checkpoint injects from Python."""
    from sparkserve.models.dspark_draft import load_dspark_draft
    write_checkpoint(str(tmp_path), target_cfg, dtype=torch.float16, **CASES["vanilla_shared"])
    draft = load_dspark_draft(str(tmp_path), target_model(target_dir), activation_quant=quant)
    calls = native_calls(monkeypatch, "inject")
    g = torch.Generator().manual_seed(7)
    taps = [torch.randn(5, target_cfg["hidden_size"], generator=g) for _ in TAPS]
    positions, slots = torch.tensor([0, 3, 4, 11, 40]), torch.tensor([9, 2, 33, 17, 60])
    pools = []
    for native in (False, True):
        draft.enable_native_step(native)
        pools.append(draft.new_kv_pool(64))
        draft.inject(taps, positions, slots, pools[-1])
    assert calls == [1]
    untouched = torch.ones(65, dtype=torch.bool)
    untouched[slots] = False
    for python, native in zip(pools[0].k + pools[0].v, pools[1].k + pools[1].v):
        assert (native[slots] != 0).all() and (native[untouched] == 0).all()
        assert torch.allclose(native, python, atol=1e-5), (native - python).abs().max()
    write_checkpoint(str(tmp_path), target_cfg, **CASES["vanilla_shared"])
    fp32 = load_dspark_draft(str(tmp_path), target_model(target_dir))
    fp32.enable_native_step(True)
    fp32.inject(taps, positions, slots, fp32.new_kv_pool(64))
    assert calls == [1]


@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("draft_vocab", [None, 100])
@torch.inference_mode()
def test_native_markov_loop_equals_python_loop(target_dir, draft_vocab, threads, monkeypatch):
    """Greedy requests' Markov loop in one native call (kernels/markov_greedy.cpp) picks the Python
    loop's tokens and returns its previous-token codes, for three requests at once, over the
    target's vocab and over a reduced one of 100 ids (not a whole number of the kernel's tiles);
    with more threads than requests, each slot's vocab split over the threads."""
    from sparkserve.core.req import Req
    from sparkserve.core.sampling_state import RequestSamplingState
    from sparkserve.models.dspark_draft import dspark_config_dict, init_dspark_draft
    from sparkserve.sampling_params import SamplingParams
    from sparkserve.speculative.dspark_worker import DSparkWorker
    from sparkserve.speculative.planner import VerifyPlanner
    target = target_model(target_dir)
    g = torch.Generator().manual_seed(5)
    vocab = (torch.randperm(target.config.vocab_size, generator=g)[:draft_vocab]
             if draft_vocab else None)
    with torch.inference_mode(False):
        draft = init_dspark_draft(dspark_config_dict(target.config, block_size=GAMMA, markov_rank=RANK,
                                                     draft_vocab_size=draft_vocab), target, vocab=vocab)
    draft.markov_head.markov_w2.weight.data.mul_(100)      # Markov biases as large as the logits
    worker = DSparkWorker(draft, draft.new_kv_pool(8), VerifyPlanner("full"), torch.zeros(1, 1))
    params = SamplingParams(temperature=0.0, max_new_tokens=100)
    reqs = [Req(f"r{i}", [1], params, RequestSamplingState(params)) for i in range(3)]
    V, d = draft.config.out_vocab, draft.config.hidden_size
    base, hidden = torch.randn(3, GAMMA, V, generator=g) * 3, torch.randn(3, GAMMA, d, generator=g)
    anchors = torch.randint(0, target.config.vocab_size, (3,), generator=g)
    tokens, embs, q = worker._markov_loop(reqs, anchors, hidden, base)
    calls = native_calls(monkeypatch, "markov_greedy")
    draft.enable_native_step(True)
    torch.set_num_threads(threads)
    try:
        native_tokens, native_embs, native_q = worker._markov_loop(reqs, anchors, hidden, base)
    finally:
        torch.set_num_threads(1)
    assert calls == [1] and native_tokens.shape == (3, GAMMA) and native_q == q == [None] * 3
    assert torch.equal(native_tokens, tokens) and torch.equal(native_embs, embs)
    assert len(set(tokens.flatten().tolist())) > GAMMA          # the slots did not all pick one id


# ---- serving the hand-written checkpoints ---------------------------------------------------
@pytest.mark.parametrize("case", ["gated_no_shared_conf_plain", "speculators_gated"])
def test_handwritten_checkpoint_serves_greedy_identically(target_dir, target_cfg, tmp_path, case):
    write_checkpoint(str(tmp_path), target_cfg, **CASES[case])
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 11, 26)]
    params = [dict(temperature=0, max_new_tokens=m) for m in (14, 9, 17)]
    ref = generate_ids(engine(target_dir), prompts, params)
    for mode in ("full", "threshold"):
        eng = engine(target_dir, str(tmp_path), mode)
        assert eng.scheduler.spec.num_drafts == GAMMA - (CASES[case].get("layout") == "speculators")
        assert generate_ids(eng, prompts, params) == ref
        assert sum(eng.scheduler.accept_hist.values()) > 0
        assert_no_kv_leak(eng)


# ---- refusals ---------------------------------------------------------------------------------
BAD = {
    "duplicate target_layer_ids": dict(cfg_over={"target_layer_ids": [2, 2]}),
    "the last target layer": dict(cfg_over={"target_layer_ids": [0, 3]}),
    "target layer out of range": dict(cfg_over={"target_layer_ids": [0, 9]}),
    "missing tensor": dict(drop=("layers.1.mlp.up_proj.weight",)),
    "missing hidden_norm": dict(drop=("hidden_norm.weight",)),
    "missing confidence head": dict(drop=("confidence_head.proj.bias",)),
    "unknown tensor": dict(extra={"markov_head.joint_proj.weight": torch.zeros(3 * RANK, 2 * RANK + 64)}),
    "wrong shape": dict(extra={"fc.weight": torch.zeros(64, 64)}),
    "vocab mismatch": dict(cfg_over={"vocab_size": 300}),
    "hidden size mismatch": dict(cfg_over={"hidden_size": 32}),
    "unknown markov_head_type": dict(cfg_over={"markov_head_type": "rnn"}),
    "not a DSpark config": dict(cfg_over={"block_size": None}),
}


@pytest.mark.parametrize("what", list(BAD))
def test_bad_checkpoint_raises_value_error(target_dir, target_cfg, tmp_path, what):
    from sparkserve.models.dspark_draft import load_dspark_draft
    write_checkpoint(str(tmp_path), target_cfg, shared=False, **BAD[what])
    with pytest.raises(ValueError):
        load_dspark_draft(str(tmp_path), target_model(target_dir))


def test_bad_draft_fails_engine_start(target_dir, target_cfg, tmp_path):
    write_checkpoint(str(tmp_path / "dup"), target_cfg, cfg_over={"target_layer_ids": [1, 1]})
    with pytest.raises(ValueError, match="unique"):
        engine(target_dir, str(tmp_path / "dup"))
    # Embedding / LM head absent and no target to share them from.
    from sparkserve.models.dspark_draft import load_dspark_draft
    write_checkpoint(str(tmp_path / "noshared"), target_cfg, shared=False)
    with pytest.raises(ValueError, match="embed_tokens|lm_head"):
        load_dspark_draft(str(tmp_path / "noshared"), None)
    # threshold / adaptive verify need a confidence head.
    write_checkpoint(str(tmp_path / "noconf"), target_cfg, conf=False)
    with pytest.raises(ValueError, match="confidence head"):
        engine(target_dir, str(tmp_path / "noconf"), "threshold")
    # a malformed step-cost table
    bad = tmp_path / "sps.json"
    bad.write_text('{"tokens": [1], "seconds": [0.1]}')
    with pytest.raises(ValueError):
        engine(target_dir, str(tmp_path / "noshared"), "adaptive",
               speculative_dspark_sps_table_path=str(bad))


def test_server_args_refusals(target_dir, tmp_path):
    from sparkserve.args import ServerArgs
    base = dict(model_path=target_dir)
    spec = dict(base, speculative_algorithm="DSPARK", speculative_draft_model_path=str(tmp_path))
    with pytest.raises(ValueError, match="speculative-algorithm"):
        ServerArgs(**base, speculative_draft_model_path=str(tmp_path)).validate()
    with pytest.raises(ValueError, match="confidence-threshold"):
        ServerArgs(**spec, speculative_dspark_verify_mode="threshold").validate()
    with pytest.raises(ValueError, match="confidence-threshold"):
        ServerArgs(**spec, speculative_dspark_confidence_threshold=1.5).validate()
    with pytest.raises(ValueError, match="verify-mode"):
        ServerArgs(**spec, speculative_dspark_verify_mode="sometimes").validate()
    with pytest.raises(ValueError, match="DSPARK"):
        ServerArgs(**dict(spec, speculative_algorithm="EAGLE")).validate()
    with pytest.raises(ValueError, match="block-size"):
        ServerArgs(**spec, speculative_dspark_block_size=0).validate()
    # the draft is checked before any model loads: a directory without a checkpoint is refused
    with pytest.raises(ValueError, match="speculative-draft-model-path .*no config.json"):
        ServerArgs(**spec).validate()
    (tmp_path / "config.json").write_text("{}")
    ok = ServerArgs(**dict(spec, speculative_algorithm="dspark"), speculative_dspark_verify_mode="threshold",
                    speculative_dspark_confidence_threshold=0.5).validate()
    assert ok.speculative_algorithm == "DSPARK"
    # the Engine goes through the same validation
    from sparkserve import Engine
    with pytest.raises(ValueError, match="speculative-algorithm"):
        Engine(target_dir, max_total_tokens=256, speculative_draft_model_path=str(tmp_path))
