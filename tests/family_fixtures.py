"""Tiny checkpoints of the families of issue #45 — Qwen2 / Qwen2.5 (q/k/v bias, no o bias), Llama 3.x
(llama3 rope scaling), Qwen3-MoE and Mixtral (4 experts, top-2) — made at test time with transformers'
own classes, and the same checkpoints as GGUF files.

Every 1-D parameter (norm weights, biases) is moved away from its init value, so a loader that
drops one shows; every value is rounded to bfloat16 (which float16 and float32 hold exactly), so
the fp32 directory, its bf16 copy and the F32 / F16 GGUF files hold the same numbers.

`write_gguf` MIRRORS what llama.cpp's convert_hf_to_gguf.py writes for these archs (checked against the
real converter by benchmarks/gguf_conformance.py: metadata outside tokenizer.* / general.* and every
tensor's name, type and bytes equal for each family and outtype; TextModel /
LlamaModel / Qwen2Model / Qwen2MoeModel: metadata keys, tensor names, LlamaModel.permute of q/k rows
and biases, generate_extra_tensors' llama3 `rope_freqs`, per-expert tensors stacked into `ffn_*_exps`,
F32 for 1-D tensors and the router under f16; Qwen3-MoE's dense layer (`mlp_only_layers`, which
llama.cpp's qwen3moe does not build) is written as a dense layer's ffn_gate/up/down); the tests do not
run the converter (it ships only in llama-cpp-python's sdist, which the tests may not download)."""
from __future__ import annotations

import json
import math
import os
import re
from typing import Any

import numpy as np
import torch
from conftest import TINY_CONFIGS, TINY_SEED

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_QWEN2 = dict(TINY_CONFIGS["llama"], num_hidden_layers=2, max_window_layers=2, use_sliding_window=False,
              sliding_window=4096)
_LLAMA3 = dict(TINY_CONFIGS["llama"], num_hidden_layers=2, max_position_embeddings=16384,
               rope_parameters=LLAMA3_ROPE)
_MOE = dict(TINY_CONFIGS["llama"], num_experts_per_tok=2)
# Gemma: soft-caps near the tiny model's score and logit sizes (so that they bite); a window of 8;
# query_pre_attn_scalar = head_dim where a GGUF file must carry it (llama.cpp derives the scale).
_GEMMA = dict(TINY_CONFIGS["llama"], sliding_window=8, query_pre_attn_scalar=16, tie_word_embeddings=True)
# Phi-3: q|k|v and gate|up fused in the checkpoint. LongRoPE as Phi-3.5 / Phi-4-mini ship it (with
# Phi-4-mini's partial rotary, 12 of 16 channels): pre-trained on 4 positions, served to 64, so
# every sequence of the tests runs past it (long factors, attention factor sqrt(1 + ln 16 / ln 4));
# served to 64 of 64 (short factors, factor 1).
_PHI3 = dict(TINY_CONFIGS["llama"], num_hidden_layers=2, max_position_embeddings=64)
_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.3, 1.9, 2.6, 3.1, 4.0],
             "long_factor": [1.2, 2.5, 4.1, 7.7, 11.0, 19.0]}
_GPT_OSS = dict(TINY_CONFIGS["llama"], num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                intermediate_size=32, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "truncate": False, "rope_theta": 150000.0,
                                 "original_max_position_embeddings": 64})
# DeepSeek-V2(-Lite): MLA with a decoupled 8-channel rope, YaRN with mscale (V2-Lite's: mscale equal to
# mscale_all_dim, cos/sin unscaled, softmax scale times mscale_all_dim's mscale squared); layer 0 dense,
# then 4 routed experts top-2 (softmax, greedy, x routed_scaling_factor) + 1 shared expert.
_DEEPSEEK_V2 = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, vocab_size=320,
    max_position_embeddings=256, initializer_range=0.15, rms_norm_eps=1e-6, bos_token_id=None,
    eos_token_id=None, pad_token_id=None, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
    qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
    moe_intermediate_size=32, first_k_dense_replace=1, routed_scaling_factor=1.5, topk_method="greedy",
    n_group=1, topk_group=1, norm_topk_prob=False,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 64})
# OLMo 3: YaRN on the full layers only; the windowed ones rotate unscaled by a base of their own
OLMO3_ROPE = {"full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 500000.0,
                                 "original_max_position_embeddings": 64},
              "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
# name -> (HF model_type, config); Qwen2.5-0.5B and Llama 3.2 tie the LM head, 7B / 3.1 8B do not.
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2": ("qwen2", dict(_QWEN2, tie_word_embeddings=False)),
    "qwen2_tied": ("qwen2", dict(_QWEN2, tie_word_embeddings=True)),
    # As an old-style config (no layer_types): a window of 8 from layer 1 up (max_window_layers).
    "qwen2_window": ("qwen2", dict(_QWEN2, tie_word_embeddings=True, use_sliding_window=True,
                                   sliding_window=8, max_window_layers=1)),
    "llama3": ("llama", dict(_LLAMA3, tie_word_embeddings=False)),
    "llama3_tied": ("llama", dict(_LLAMA3, tie_word_embeddings=True)),
    # YaRN as Qwen2.5 / Qwen3 configs add it: GGUF metadata qwen2.rope.scaling.type / .factor / orig ctx
    "qwen2_yarn": ("qwen2", dict(_QWEN2, tie_word_embeddings=True, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64})),
    # linear scaling: GGUF metadata llama.rope.scaling.type / .factor
    "llama_linear": ("llama", dict(TINY_CONFIGS["llama"], num_hidden_layers=2, rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})),
    # MoE: softmax top-2 of 4 experts, renormalised; Qwen3-MoE's layer 1 dense (mlp_only_layers)
    "qwen3_moe": ("qwen3_moe", dict(_MOE, num_hidden_layers=3, num_experts=4, moe_intermediate_size=32,
                                    mlp_only_layers=[1], norm_topk_prob=True, tie_word_embeddings=False)),
    # norm_topk_prob false: top-2 softmax weights as they are (the router rule softmax_topk)
    "qwen3_moe_raw": ("qwen3_moe", dict(_MOE, num_hidden_layers=2, num_experts=4, moe_intermediate_size=32,
                                        norm_topk_prob=False, tie_word_embeddings=True)),
    "mixtral": ("mixtral", dict(_MOE, num_hidden_layers=2, num_local_experts=4, sliding_window=None,
                                tie_word_embeddings=False)),
    "phi3": ("phi3", dict(_PHI3, tie_word_embeddings=False)),
    "phi3_window": ("phi3", dict(_PHI3, sliding_window=8, tie_word_embeddings=False)),
    "phi3_longrope": ("phi3", dict(_PHI3, partial_rotary_factor=0.75, original_max_position_embeddings=4,
                                   rope_parameters=dict(_LONGROPE, partial_rotary_factor=0.75,
                                                        original_max_position_embeddings=4),
                                   tie_word_embeddings=True)),
    "phi3_shortrope": ("phi3", dict(_PHI3, partial_rotary_factor=0.75, original_max_position_embeddings=64,
                                    rope_parameters=dict(_LONGROPE, partial_rotary_factor=0.75,
                                                         original_max_position_embeddings=64))),
    # SmolLM3: layer 3 (every 4th) without rope; tied
    "smollm3": ("smollm3", dict(TINY_CONFIGS["llama"], num_hidden_layers=4, tie_word_embeddings=True)),
    # Granite 3: the four multipliers off 1
    "granite": ("granite", dict(TINY_CONFIGS["llama"], num_hidden_layers=2, embedding_multiplier=6.0,
                                residual_multiplier=0.4, attention_multiplier=0.15, logits_scaling=3.0,
                                tie_word_embeddings=True)),
    # GPT-OSS: sinks, q/k/v/o biases, a window of 8 then full, YaRN (not truncated), 4 experts top-2
    # with biases and the clamped SwiGLU (limit 1.5: the tiny model's values reach it)
    "gpt_oss": ("gpt_oss", dict(_GPT_OSS, swiglu_limit=1.5)),
    # as llama.cpp runs GPT-OSS (its swiglu limit is the released models' 7, not in the GGUF file)
    "gpt_oss_gguf": ("gpt_oss", _GPT_OSS),
    # OLMo2: norms after each branch only, q/k norms over the whole projection
    "olmo2": ("olmo2", dict(TINY_CONFIGS["llama"], num_hidden_layers=2, tie_word_embeddings=False)),
    # OLMo 3: OLMo2's block, a window of 8 on 3 layers of 4 (OLMO3_ROPE)
    "olmo3": ("olmo3", dict(TINY_CONFIGS["llama"], num_hidden_layers=4, sliding_window=8,
                            rope_parameters=OLMO3_ROPE, tie_word_embeddings=False)),
    # Gemma 2: sliding, full, sliding; soft-capped attention scores and logits
    "gemma2": ("gemma2", dict(_GEMMA, attn_logit_softcapping=1.0, final_logit_softcapping=1.0)),
    # Gemma 2 27B's kind of attention scale (query_pre_attn_scalar != head_dim); HF only
    "gemma2_scalar": ("gemma2", dict(_GEMMA, num_hidden_layers=2, query_pre_attn_scalar=24,
                                     attn_logit_softcapping=None, final_logit_softcapping=None)),
    # Gemma 3: 5 sliding layers (local rope base 1e4) then a full one (base 1e6, linear x8), q/k norms
    "gemma3": ("gemma3_text", dict(_GEMMA, num_hidden_layers=6, rope_parameters=GEMMA3_ROPE)),
    # a local rope base of its own (GGUF rope.freq_base_swa, which newer converters write)
    "gemma3_local_base": ("gemma3_text", dict(_GEMMA, num_hidden_layers=6, rope_parameters=dict(
        GEMMA3_ROPE, sliding_attention={"rope_type": "default", "rope_theta": 40.0}))),
    "deepseek_v2": ("deepseek_v2", dict(_DEEPSEEK_V2, tie_word_embeddings=False)),
    # V2 (not Lite)'s kind: q through a low-rank q_a / q_b, group-limited routing (2 groups, best 1),
    # mscale != mscale_all_dim (cos/sin scaled too); tied
    "deepseek_v2_qlora": ("deepseek_v2", dict(
        _DEEPSEEK_V2, q_lora_rank=24, topk_method="group_limited_greedy", n_group=2, topk_group=1,
        tie_word_embeddings=True, rope_parameters=dict(_DEEPSEEK_V2["rope_parameters"], mscale=1.0,
                                                       mscale_all_dim=0.5))),
    # what a GGUF file can say (mscale as mscale_all_dim; group-limited routing as expert_group_count /
    # expert_group_used_count) with q_lora and a tied head
    "deepseek_v2_qlora_gguf": ("deepseek_v2", dict(
        _DEEPSEEK_V2, q_lora_rank=24, tie_word_embeddings=True, topk_method="group_limited_greedy", n_group=2,
        topk_group=1)),
}
MOE_FAMILIES = {"qwen3_moe", "qwen3_moe_raw", "mixtral", "gpt_oss", "gpt_oss_gguf", "deepseek_v2",
                "deepseek_v2_qlora", "deepseek_v2_qlora_gguf"}
# Families whose native step also runs fp32 weights (DeepSeek-V2's own: models/deepseek_v2_native.py);
# the Llama-family step needs block weights (a bf16 copy, an F16 GGUF).
FP32_NATIVE_FAMILIES = {name for name in MOE_FAMILIES if name.startswith("deepseek_v2")}


def make_family_checkpoint(name: str, path: str, bf16_copy: str | None = None) -> str:
    """The fp32 HF directory at `path` (and a bf16 copy of it at `bf16_copy`: BF16 blocks, so the
    native step runs it)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    model_type, kw = FAMILIES[name]
    torch.manual_seed(TINY_SEED)
    cfg = AutoConfig.for_model(model_type, **kw)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(TINY_SEED + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 1 or pname.endswith("bias"):      # norms start at 1, biases at 0: move both
                p.add_(0.3 * torch.randn(p.shape, generator=g) + (0.1 if pname.endswith("bias") else 0.0))
            p.copy_(p.to(torch.bfloat16).float())
    model.save_pretrained(path)
    if bf16_copy:
        model.to(torch.bfloat16).save_pretrained(bf16_copy)
    if name == "qwen2_window":    # real Qwen2 configs predate layer_types
        for d in filter(None, (path, bf16_copy)):
            _drop_layer_types(d)
    return path


def _drop_layer_types(path: str) -> None:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("layer_types", None)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


# HF name fragments -> GGUF (gguf-py tensor_mapping.py, resolved through the llama / qwen2 tensor lists)
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp"}
# per-expert tensors (Qwen2MoeModel / LlamaModel.modify_tensors stack them) -> the stacked GGUF name
_EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
            "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}
# Gemma 2 / 3: the attention output is normed, and the MLP before and after (gguf-py's gemma2/gemma3 lists)
_GEMMA_LAYER = dict(_LAYER, post_attention_layernorm="post_attention_norm",
                    pre_feedforward_layernorm="ffn_norm", post_feedforward_layernorm="post_ffw_norm")
_PHI3_LAYER = dict(_LAYER, **{"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"})
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


# gguf-py's deepseek2 list (kv_b_proj is written split: _deepseek2_kv_b)
_DEEPSEEK2_LAYER = dict(_LAYER, **{
    "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b", "self_attn.kv_b_proj": "attn_kv_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa", "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp"})


def _deepseek2_kv_b(name: str, t: np.ndarray, hp: dict[str, Any]) -> list[tuple[str, np.ndarray]]:
    """DeepseekV2Model.modify_tensors: kv_b_proj per head into k_b (transposed) and v_b."""
    layer = name.split(".")[2]
    nope, v = hp["qk_nope_head_dim"], hp["v_head_dim"]
    kv_b = t.reshape(hp["num_attention_heads"], nope + v, t.shape[-1])
    return [(f"blk.{layer}.attn_k_b.weight", np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1))),
            (f"blk.{layer}.attn_v_b.weight", np.ascontiguousarray(kv_b[:, nope:]))]


def _deepseek2_parameters(w, hp: dict[str, Any], rope: dict[str, Any], old: bool) -> None:
    """DeepseekV2Model.set_gguf_parameters (after TextModel's, with head_count_kv 1); `old`: as
    converters before the MLA split wrote it (a head's key / value length, no *_mla keys)."""
    w.add_leading_dense_block_count(hp["first_k_dense_replace"])
    w.add_vocab_size(hp["vocab_size"])
    if hp.get("q_lora_rank") is not None:
        w.add_q_lora_rank(hp["q_lora_rank"])
    w.add_kv_lora_rank(hp["kv_lora_rank"])
    if old:
        w.add_key_length(hp["qk_nope_head_dim"] + hp["qk_rope_head_dim"])
        w.add_value_length(hp["v_head_dim"])
    else:
        w.add_key_length(hp["kv_lora_rank"] + hp["qk_rope_head_dim"])
        w.add_value_length(hp["kv_lora_rank"])
        w.add_key_length_mla(hp["qk_nope_head_dim"] + hp["qk_rope_head_dim"])
        w.add_value_length_mla(hp["v_head_dim"])
    w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    w.add_expert_count(hp["n_routed_experts"])
    w.add_expert_shared_count(hp["n_shared_experts"])
    w.add_expert_weights_scale(hp["routed_scaling_factor"])
    if hp.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(hp["qk_rope_head_dim"])
    if rope.get("mscale_all_dim") is not None:
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


_GPT_OSS_LAYER = dict(_LAYER, post_attention_layernorm="post_attention_norm",
                      **{"mlp.router": "ffn_gate_inp"})


def _gpt_oss_tensors(name: str, t: np.ndarray) -> list[tuple[str, np.ndarray]] | None:
    """GptOssModel.modify_tensors for unquantized experts ([E, in, out], gate and up interleaved:
    de-interleaved and transposed into ffn_gate_exps / ffn_up_exps) and the sinks' GGUF name."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.(self_attn\.sinks|mlp\.experts\.(gate_up_proj|down_proj)"
                     r"(_bias)?)", name)
    if m is None:
        return None
    p = f"blk.{m[1]}."
    if m[2] == "self_attn.sinks":
        return [(p + "attn_sinks.weight", t)]
    kind = "bias" if m[4] else "weight"
    if not m[4]:
        t = np.ascontiguousarray(np.swapaxes(t, -1, -2))
    if m[3] == "down_proj":
        return [(p + f"ffn_down_exps.{kind}", t)]
    return [(p + f"ffn_gate_exps.{kind}", np.ascontiguousarray(t[:, 0::2])),
            (p + f"ffn_up_exps.{kind}", np.ascontiguousarray(t[:, 1::2]))]


def _gguf_name(name: str, layer_names: dict[str, str] = _LAYER) -> str:
    if name in _TOP:
        return _TOP[name]
    _, _, layer, rest = name.split(".", 3)
    base, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{layer_names[base]}.{kind}"


def _permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_freqs(hp: dict[str, Any], rope: dict[str, Any]) -> np.ndarray:
    """LlamaModel.generate_extra_tensors: llama3 scaling as per-frequency divisors (note: the
    converter takes original_max_position_embeddings from the top level, default 8192)."""
    base = rope.get("rope_theta", hp.get("rope_theta", 10000.0))
    dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context_len = hp.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_context_len / low, old_context_len / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


def write_gguf(hf_dir: str, out: str, ftype: str = "f32", per_expert: bool = False,
               old_mla: bool = False, quant_types: dict[str, str] | None = None) -> str:
    """The HF checkpoint at `hf_dir` as convert_hf_to_gguf.py --outtype f32 / f16 / q8_0 writes it;
    `per_expert`: experts as older converters wrote Mixtral, one `blk.N.ffn_gate.E.weight` each;
    `old_mla`: DeepSeek-V2 as converters before the MLA split wrote it (one `attn_kv_b`); `quant_types`:
    GGUF name suffix -> the gguf-py quant type its tensors take instead (as llama-quantize mixes them:
    a Q4_K_M file's `attn_k_b.weight`, whose rows are not whole 256-blocks, falls back to "Q5_0")."""
    import gguf
    from safetensors.torch import load_file
    with open(os.path.join(hf_dir, "config.json")) as f:
        hp = json.load(f)
    if hp["model_type"] == "kimi_linear":
        return _write_kimi_gguf(hf_dir, out, ftype)
    if hp["model_type"] == "minimax_m2":
        from minimax_m2_fixtures import write_minimax_m2_gguf
        return write_minimax_m2_gguf(hf_dir, out, ftype)
    if "sparse_attention_config" in hp:      # MiniMax-M3 in MiniMax's own layout
        from minimax_fixtures import write_minimax_m3_gguf
        return write_minimax_m3_gguf(hf_dir, out, ftype)
    arch = {"llama": "llama", "qwen2": "qwen2", "qwen3_moe": "qwen3moe", "mixtral": "llama",
            "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3", "smollm3": "smollm3",
            "granite": "granite", "olmo2": "olmo2", "olmo3": "olmo2", "gpt_oss": "gpt-oss",
            "deepseek_v2": "deepseek2"}[hp["model_type"]]
    gemma = arch.startswith("gemma")
    rope = hp.get("rope_parameters") or hp.get("rope_scaling") or {}
    rope = rope.get("full_attention", rope)      # Gemma 3, OLMo 3: the global layers' (+ freq_base_swa)
    n_head, n_kv = hp["num_attention_heads"], hp.get("num_key_value_heads")
    if arch == "deepseek2":     # MLA written as MQA
        n_kv = 1
    w = gguf.GGUFWriter(out, arch)
    # TextModel.set_gguf_parameters
    w.add_block_count(hp["num_hidden_layers"])
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(n_head)
    if n_kv is not None:
        w.add_head_count_kv(n_kv)
    kind = rope.get("rope_type")
    if kind == "linear" and rope.get("factor") is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif kind == "yarn" and rope.get("factor") is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for key, add in (("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):
            if rope.get(key) is not None:
                add(rope[key])
    if (theta := rope.get("rope_theta", hp.get("rope_theta"))) is not None and arch != "gemma2":
        w.add_rope_freq_base(theta)     # (Gemma2Model writes its own parameters, no rope base)
    local = (hp.get("rope_parameters") or {}).get("sliding_attention", {}).get("rope_theta")
    if local is not None:       # TextModel: rope_parameters' sliding_attention base
        w.add_rope_freq_base_swa(local)
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    # TextModel's head_dim (DeepSeek's own configs have none; GraniteModel drops it; Phi3MiniModel
    # writes its own parameters)
    if hp.get("head_dim") is not None and arch not in ("deepseek2", "granite", "phi3"):
        w.add_key_length(hp["head_dim"])
        w.add_value_length(hp["head_dim"])
    if (n_experts := hp.get("num_local_experts", hp.get("num_experts"))) is not None:
        w.add_expert_count(n_experts)
    if arch == "deepseek2":
        _deepseek2_parameters(w, hp, rope, old_mla)
        n_experts = hp["n_routed_experts"]
    if (n_used := hp.get("num_experts_per_tok")) is not None:
        w.add_expert_used_count(n_used)
    if hp.get("n_group") is not None:           # TextModel: DeepSeek's group-limited routing
        w.add_expert_group_count(hp["n_group"])
    if hp.get("topk_group") is not None:
        w.add_expert_group_used_count(hp["topk_group"])
    if arch == "qwen3moe":      # Qwen2MoeModel.set_gguf_parameters
        w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    if arch == "gpt-oss":       # GptOssModel.set_gguf_parameters
        w.add_expert_feed_forward_length(hp["intermediate_size"])
        w.add_sliding_window(hp["sliding_window"])
    if arch == "phi3":          # Phi3MiniModel.set_gguf_parameters / generate_extra_tensors
        orig = hp.get("original_max_position_embeddings") or hp["max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(orig)
        head = hp["hidden_size"] // n_head
        w.add_rope_dimension_count(int(hp.get("partial_rotary_factor", 1.0) * hp["hidden_size"]) // n_head)
        w.add_sliding_window(hp.get("sliding_window") or 0)
        if kind == "longrope":
            scale = hp["max_position_embeddings"] / orig
            attn_factor = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0
            w.add_rope_scaling_attn_factors(attn_factor)
            w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
            w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
        assert head == hp["head_dim"]
    if arch == "granite":       # GraniteModel.set_gguf_parameters
        w.add_embedding_scale(hp["embedding_multiplier"])
        w.add_residual_scale(hp["residual_multiplier"])
        w.add_attention_scale(hp["attention_multiplier"])
        w.add_logit_scale(hp["logits_scaling"])
    if gemma:                   # Gemma2Model / Gemma3Model.set_gguf_parameters
        w.add_sliding_window(hp["sliding_window"])
    if arch == "olmo2" and "sliding_window" in hp:      # Olmo2Model (OLMo 3's checkpoints): every 4th full
        w.add_sliding_window(hp["sliding_window"])
        types = hp.get("layer_types")
        w.add_sliding_window_pattern([t == "sliding_attention" for t in types] if types else
                                     [(i + 1) % 4 != 0 for i in range(hp["num_hidden_layers"])])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(hp["attn_logit_softcapping"])
        w.add_final_logit_softcapping(hp["final_logit_softcapping"])
    w.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                     "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                     "mxfp4": gguf.LlamaFileType.MOSTLY_MXFP4_MOE}[ftype])

    def add(gname: str, t: np.ndarray) -> None:
        """F32 norms, router and biases (and 1-D tensors) whatever the outtype; the other weights
        in it ("mxfp4": GPT-OSS's experts MXFP4, the rest F32)."""
        forced = next((k for suffix, k in (quant_types or {}).items() if gname.endswith(suffix)), None)
        if forced is not None:
            qtype = gguf.GGMLQuantizationType[forced]
            w.add_tensor(gname, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
        elif ftype == "mxfp4" and gname.endswith("_exps.weight"):
            w.add_tensor(gname, gguf.quants.quantize(t, gguf.GGMLQuantizationType.MXFP4),
                         raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        elif (ftype in ("f32", "mxfp4") or t.ndim == 1 or gname.endswith(".bias")
              or gname.endswith(("_norm.weight", "ffn_gate_inp.weight"))):
            w.add_tensor(gname, t)
        elif ftype == "f16" or t.shape[-1] % 32:      # the converter's fallback where Q8_0 cannot go
            w.add_tensor(gname, t.astype(np.float16))
        else:
            q8 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(gname, gguf.quants.quantize(t, q8), raw_dtype=q8)
    if arch in ("llama", "smollm3", "granite"):      # LlamaModel.set_gguf_parameters
        w.add_vocab_size(hp["vocab_size"])
        w.add_rope_dimension_count(hp.get("head_dim") or hp["hidden_size"] // n_head)
    # a stand-in vocabulary (_set_vocab_gpt2 writes one entry per id up to vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch in ("qwen2", "qwen3moe") else "llama-bpe")
    w.add_token_list([f"<t{i}>" for i in range(hp["vocab_size"])])
    w.add_token_types([gguf.TokenType.NORMAL] * hp["vocab_size"])
    w.add_token_merges([])
    # prepare_tensors: generate_extra_tensors first, then the checkpoint's tensors
    if arch == "llama" and kind == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_rope_freqs(hp, rope))
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, t in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        t = t.float().numpy()
        if gemma and name == "lm_head.weight":    # tied: the converters skip it
            continue
        if gemma and name.endswith("norm.weight"):   # Gemma's 1 + w, folded in by the converters
            t = t + 1
        m = re.fullmatch(r"model\.layers\.(\d+)\.\w+\.experts\.(\d+)\.(\w+)\.weight", name)
        if m and per_expert:
            add(f"blk.{m[1]}.{_EXPERTS[m[3]].removesuffix('_exps')}.{m[2]}.weight", t)
            continue
        if m:       # stacked once every expert is in, as the converter does
            group = experts.setdefault((m[1], _EXPERTS[m[3]]), {})
            group[int(m[2])] = t
            if len(group) == n_experts:
                add(f"blk.{m[1]}.{_EXPERTS[m[3]]}.weight", np.stack([group[e] for e in range(n_experts)]))
            continue
        if arch == "deepseek2" and name.endswith("kv_b_proj.weight") and not old_mla:
            for gname, part in _deepseek2_kv_b(name, t, hp):
                add(gname, part)
            continue
        if arch == "gpt-oss" and (gpt_oss := _gpt_oss_tensors(name, t)) is not None:
            for gname, part in gpt_oss:
                add(gname, part)
            continue
        if arch in ("llama", "smollm3", "granite"):      # LlamaModel.modify_tensors (undo_permute)
            if name.endswith(("q_proj.weight", "q_proj.bias")):
                t = _permute(t, n_head, n_head)
            if name.endswith(("k_proj.weight", "k_proj.bias")):
                t = _permute(t, n_head, n_kv)
        names = (_GEMMA_LAYER if gemma or arch == "olmo2" else _PHI3_LAYER if arch == "phi3" else
                 _GPT_OSS_LAYER if arch == "gpt-oss" else _DEEPSEEK2_LAYER if arch == "deepseek2" else _LAYER)
        add(_gguf_name(name, names), t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


# KimiLinearModel's tensor names (gguf-py's kimi-linear list) beyond the DeepSeek-V2 ones
_KIMI_LAYER = dict(_DEEPSEEK2_LAYER, **{
    "self_attn.b_proj": "ssm_beta", "self_attn.f_a_proj": "ssm_f_a", "self_attn.f_b_proj": "ssm_f_b",
    "self_attn.g_a_proj": "ssm_g_a", "self_attn.g_b_proj": "ssm_g_b", "self_attn.q_conv1d": "ssm_conv1d_q",
    "self_attn.k_conv1d": "ssm_conv1d_k", "self_attn.v_conv1d": "ssm_conv1d_v",
    "self_attn.o_norm": "ssm_norm",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp"})
_KIMI_WHOLE = {"self_attn.A_log": "ssm_a", "self_attn.dt_bias": "ssm_dt.bias",
               "mlp.gate.e_score_correction_bias": "exp_probs_b.bias"}


def _write_kimi_gguf(hf_dir: str, out: str, ftype: str) -> str:
    """A Kimi-Linear checkpoint in the original format (kimi_fixtures.as_original_checkpoint) as
    convert_hf_to_gguf.py KimiLinearModel writes it: head_count_kv per layer (0: KDA, 1: MLA as MQA),
    the KDA and MLA sizes, TextModel's expert keys (no group count: the converter reads `n_group`,
    which Kimi calls num_expert_group), -exp(A_log) as `ssm_a`, dt_bias as `ssm_dt.bias`, the convs as
    [1, d_inner, 1, d_conv], experts stacked, kv_b split as DeepSeek-V2's; F32 for 1-D tensors, norms,
    the router, the convs and every tensor not named `.weight`."""
    import gguf
    from gguf_fixture_tensors import checkpoint_arrays, stacked_experts, tensor_adder
    from transformers import AutoConfig
    hp = AutoConfig.from_pretrained(hf_dir).to_dict()       # as the converter's load_hparams
    with open(os.path.join(hf_dir, "config.json")) as f:
        hp.update(json.load(f))
    lin, n = hp["linear_attn_config"], hp["num_hidden_layers"]
    w = gguf.GGUFWriter(out, "kimi-linear")
    w.add_block_count(n)
    w.add_context_length(hp.get("max_position_embeddings") or hp["model_max_length"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv([1 if i + 1 in lin["full_attn_layers"] else 0 for i in range(n)])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_expert_count(hp["num_experts"])
    w.add_expert_used_count(hp["num_experts_per_token"])
    if hp.get("topk_group") is not None:
        w.add_expert_group_used_count(hp["topk_group"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if hp.get("head_dim") is not None:
        w.add_value_length(hp["head_dim"])
    w.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                     "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[ftype])
    w.add_vocab_size(hp["vocab_size"])
    w.add_ssm_conv_kernel(lin["short_conv_kernel_size"])
    w.add_kda_head_dim(lin["head_dim"])
    if hp.get("q_lora_rank") is not None:
        w.add_q_lora_rank(hp["q_lora_rank"])
    w.add_kv_lora_rank(hp["kv_lora_rank"])
    w.add_rope_dimension_count(hp["qk_rope_head_dim"])
    w.add_key_length(hp["kv_lora_rank"] + hp["qk_rope_head_dim"])
    w.add_key_length_mla(hp["qk_nope_head_dim"] + hp["qk_rope_head_dim"])
    w.add_value_length_mla(hp["v_head_dim"])
    w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    w.add_expert_shared_count(hp["num_shared_experts"])
    w.add_leading_dense_block_count(hp["first_k_dense_replace"])
    w.add_expert_weights_scale(hp["routed_scaling_factor"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-4o")
    w.add_token_list([f"<t{i}>" for i in range(hp["vocab_size"])])
    w.add_token_types([gguf.TokenType.NORMAL] * hp["vocab_size"])
    w.add_token_merges([])

    add = tensor_adder(w, ftype, lambda gname, t: t.ndim <= 1 or ".ssm_conv1d_" in gname
                       or gname.endswith(("_norm.weight", "ffn_gate_inp.weight"))
                       or not gname.endswith(".weight"))
    for name, t in stacked_experts(checkpoint_arrays(hf_dir), hp["num_experts"], _EXPERTS):
        if name.startswith("blk."):
            add(name, t)
            continue
        name = name.replace(".block_sparse_moe.", ".mlp.")
        if name.endswith("kv_b_proj.weight"):
            heads = dict(hp, num_attention_heads=hp["num_key_value_heads"])
            for gname, part in _deepseek2_kv_b(name, t, heads):
                add(gname, part)
            continue
        if name.endswith("_conv1d.weight"):
            t = t.reshape(1, t.shape[0], 1, t.shape[-1])
        layer = re.fullmatch(r"model\.layers\.(\d+)\.(.*)", name)
        if layer and layer[2] in _KIMI_WHOLE:
            if layer[2].endswith("A_log"):      # in torch, as the converter (numpy's exp rounds apart)
                t = (-torch.exp(torch.from_numpy(t))).numpy()
            add(f"blk.{layer[1]}.{_KIMI_WHOLE[layer[2]]}", t)
            continue
        add(_gguf_name(name, _KIMI_LAYER), t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
