"""GGUF checkpoints: config from metadata, tensors under HF names.
llama.cpp stores llama q/k rows permuted for its rope (not qwen2/qwen3's); we undo that so one
model code path serves GGUF and HF checkpoints alike. Llama 3.1+'s rope scaling comes as the
`rope_freqs.weight` tensor, read into the config (`_rope_scaling`).

2-D weights in a format the block kernels read (Q4_0, Q4_1, Q8_0, BF16, F16) come as their raw blocks,
permuted the same way, on an unread (meta) tensor (`loader.weights.with_blocks`): the Linear layers
compute from the blocks, and the loader dequantizes them only where a module keeps fp32 values.
For a model served with int8 activations, other quantized 2-D weights (Q4_K, Q6_K, Q5_0, ...) come
as blocks the int8 kernels read (loader/gguf_int8.py). Other tensors (norms, and every other type
when the activations stay fp32) come dequantized to fp32 by gguf-py."""
from __future__ import annotations

import dataclasses
import logging
import re
from collections import Counter
from typing import Any, Iterator

import gguf
import numpy as np
import torch

from sparkserve.config import ModelConfig, _arch_from_model_type
from sparkserve.kernels.blocks import Q6_S, Q8_0, BlockWeight
from sparkserve.loader.gguf_file import GGUFFile, close_gguf, gguf_metadata, open_gguf
from sparkserve.loader.gguf_int8 import group_form, int8_blocks, int8_form, type_name
from sparkserve.loader.weights import with_blocks

log = logging.getLogger(__name__)

_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
          "mistral": "MistralForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM", "gemma2": "Gemma2ForCausalLM",
          "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM", "smollm3": "SmolLM3ForCausalLM",
          "granite": "GraniteForCausalLM", "olmo2": "Olmo2ForCausalLM", "gpt-oss": "GptOssForCausalLM",
          "deepseek2": "DeepseekV2ForCausalLM", "kimi-linear": "KimiLinearForCausalLM",
          "minimax-m2": "MiniMaxM2ForCausalLM", "minimax-m3": "MiniMaxM3VLForCausalLM"}
# Architectures llama.cpp converts that are not decoder-only language models: why each is refused.
_NOT_DECODERS = {"t5": "an encoder-decoder model; sparkserve serves decoder-only language models",
                 "t5encoder": "an encoder; sparkserve serves decoder-only language models"}
# GGUF arch -> HF model_type where they differ; llama.cpp writes Mixtral as arch llama with experts.
_MODEL_TYPES = {"qwen3moe": "qwen3_moe", "gemma3": "gemma3_text", "gpt-oss": "gpt_oss",
                "deepseek2": "deepseek_v2", "kimi-linear": "kimi_linear", "minimax-m2": "minimax_m2"}
# Gemma 2 / 3 as llama.cpp builds them: its sliding-window layers' rope base (not in the file) and
# the layer count of the 27B models, whose attention scale is 1/sqrt(hidden / heads), not of head_dim.
_GEMMA_LOCAL_ROPE_BASE = 10000.0
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# Archs whose q/k rows (weights and biases) llama.cpp's converter permutes for its NORM rope
# (`LlamaModel.permute`); qwen2/qwen3 use NEOX rope and are stored as HF has them.
_PERMUTED = {"llama", "smollm3", "granite"}
# Granite's multipliers: GGUF key -> HF config key
_GRANITE_SCALES = {"embedding_scale": "embedding_multiplier", "residual_scale": "residual_multiplier",
                   "attention.scale": "attention_multiplier", "logit_scale": "logits_scaling"}
# Tensors that are not weights: llama.cpp's converter writes Llama 3.1+'s llama3 rope scaling as
# per-frequency divisors (`rope_freqs.weight`, head_dim / 2 values); gguf_config reads them.
_ROPE_FREQS = "rope_freqs.weight"
# Phi-3's LongRoPE: per-frequency factors for contexts past the pre-training length and within it.
_ROPE_FACTORS = {"long_factor": "rope_factors_long.weight", "short_factor": "rope_factors_short.weight"}
_NOT_WEIGHTS = {_ROPE_FREQS, *_ROPE_FACTORS.values()}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # MoE: the router and the experts stacked [n_expert, rows, cols] (Mixtral, Qwen3-MoE)
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj",
}
# Gemma 2 / 3 norm the attention output and both sides of the MLP (OLMo2 the outputs only): there
# `ffn_norm` is the MLP's input norm.
_GEMMA_LAYER_NAMES = dict(_LAYER_NAMES, ffn_norm="pre_feedforward_layernorm",
                          post_attention_norm="post_attention_layernorm",
                          post_ffw_norm="post_feedforward_layernorm")
# Phi-3 keeps q|k|v in one tensor, gate|up in `ffn_up` (LlamaForCausalLM._fused_parts splits them).
_PHI3_LAYER_NAMES = dict(_LAYER_NAMES, attn_qkv="self_attn.qkv_proj", ffn_up="mlp.gate_up_proj")
# GPT-OSS: `post_attention_norm` is the MLP's input norm (Llama's post_attention_layernorm); sinks.
_GPT_OSS_LAYER_NAMES = dict(_LAYER_NAMES, post_attention_norm="post_attention_layernorm",
                            attn_sinks="self_attn.sinks")
# DeepSeek-V2 (MLA): kv_b_proj whole (older converters) or split per head into k_b (transposed) and
# v_b, which models/deepseek_v2.py joins back; shared experts.
_DEEPSEEK2_LAYER_NAMES = dict(
    _LAYER_NAMES, attn_q_a="self_attn.q_a_proj", attn_q_a_norm="self_attn.q_a_layernorm",
    attn_q_b="self_attn.q_b_proj", attn_kv_a_mqa="self_attn.kv_a_proj_with_mqa",
    attn_kv_a_norm="self_attn.kv_a_layernorm", attn_kv_b="self_attn.kv_b_proj", attn_k_b="self_attn.k_b_proj",
    attn_v_b="self_attn.v_b_proj", ffn_gate_shexp="mlp.shared_experts.gate_proj",
    ffn_up_shexp="mlp.shared_experts.up_proj", ffn_down_shexp="mlp.shared_experts.down_proj")
# Kimi-Linear (convert_hf_to_gguf.py KimiLinearModel): KDA layers' `ssm_*` tensors (`ssm_a` holds
# -exp(A_log), read back as A_log), MLA's as DeepSeek-V2's (kv_b split), the routing bias; a key
# "part.kind" (or a bare part) names the whole HF name where it is not "<role>.<kind>".
_KIMI_LAYER_NAMES = dict(
    _DEEPSEEK2_LAYER_NAMES, ssm_beta="self_attn.b_proj", ssm_f_a="self_attn.f_a_proj",
    ssm_f_b="self_attn.f_b_proj", ssm_g_a="self_attn.g_a_proj", ssm_g_b="self_attn.g_b_proj",
    ssm_conv1d_q="self_attn.q_conv1d", ssm_conv1d_k="self_attn.k_conv1d", ssm_conv1d_v="self_attn.v_conv1d",
    ssm_norm="self_attn.o_norm", **{"ssm_a": "self_attn.A_log", "ssm_dt.bias": "self_attn.dt_bias",
                                    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias"})
# MiniMax-M2: the routing bias (the router's in this model; beside it in the checkpoint)
_MINIMAX_M2_LAYER_NAMES = dict(_LAYER_NAMES, **{"exp_probs_b.bias": "mlp.gate.e_score_correction_bias"})
# MiniMax-M3: M2's, a shared expert, the lightning indexer's projections and norms (`indexer.*`)
_MINIMAX_M3_LAYER_NAMES = dict(
    _MINIMAX_M2_LAYER_NAMES, ffn_gate_shexp="mlp.shared_experts.gate_proj",
    ffn_up_shexp="mlp.shared_experts.up_proj", ffn_down_shexp="mlp.shared_experts.down_proj",
    **{f"indexer.{p}": f"self_attn.indexer.{p}" for p in ("q_proj", "k_proj", "q_norm", "k_norm")})
_LAYER_NAMES_OF = {"kimi-linear": _KIMI_LAYER_NAMES, "minimax-m2": _MINIMAX_M2_LAYER_NAMES,
                   "minimax-m3": _MINIMAX_M3_LAYER_NAMES,
                   "gemma2": _GEMMA_LAYER_NAMES, "gemma3": _GEMMA_LAYER_NAMES, "olmo2": _GEMMA_LAYER_NAMES,
                   "phi3": _PHI3_LAYER_NAMES, "gpt-oss": _GPT_OSS_LAYER_NAMES,
                   "deepseek2": _DEEPSEEK2_LAYER_NAMES}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def gguf_config(path: str) -> ModelConfig:
    meta = gguf_metadata(path)
    arch = meta["general.architecture"]
    if arch not in _ARCHS:
        why = f" ({_NOT_DECODERS[arch]})" if arch in _NOT_DECODERS else ""
        raise ValueError(f"GGUF architecture {arch!r}{why} is not supported (supported: {sorted(_ARCHS)})")

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    reader = open_gguf(path)
    names = {t.name for t in reader.tensors}
    n_heads = get("attention.head_count")
    hidden = get("embedding_length")
    if arch == "kimi-linear":
        return ModelConfig.from_hf_dict(_kimi_config(get, meta, names))
    if arch == "minimax-m3":
        return ModelConfig.from_hf_dict(_minimax_m3_config(get, meta, names))
    vocab = get("vocab_size") or len(meta["tokenizer.ggml.tokens"])
    window = get("attention.sliding_window")
    head_dim = get("attention.key_length", hidden // n_heads)
    rope_dims = get("rope.dimension_count", head_dim)
    if arch == "deepseek2":      # MLA: key_length is the latent's (kv_lora_rank + rope), not a head's
        head_dim = rope_dims
    if rope_dims != head_dim and arch in _PERMUTED:
        raise ValueError(f"GGUF {arch}.rope.dimension_count = {rope_dims}: partial rotary is not supported "
                         f"for {arch} (supported: the whole head, {head_dim})")
    n_layers, n_experts = get("block_count"), get("expert_count", 0)
    model_type = "mixtral" if arch == "llama" and n_experts else _MODEL_TYPES.get(arch, arch)
    if arch == "olmo2" and window:      # the converter writes OLMo 3 as olmo2 with a window
        model_type = "olmo3"
    hf: dict[str, Any] = {
        "architectures": [_arch_from_model_type(model_type)],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": get("attention.head_count_kv", n_heads),
        "head_dim": head_dim,
        "vocab_size": vocab,
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": get("rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(reader, get, arch, head_dim),
        "max_position_embeddings": get("context_length", 4096),
        "tie_word_embeddings": "output.weight" not in names,
        "sliding_window": None if arch == "phi3" else window,   # llama.cpp runs Phi-3 without its window
        "partial_rotary_factor": rope_dims / head_dim,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    if arch in _GEMMA_27B_LAYERS:
        hf.update(_gemma_fields(arch, get, n_layers, hidden, n_heads, head_dim))
    if model_type == "olmo3":
        hf.update(_olmo3_fields(get, n_layers, hf["rope_theta"], hf["rope_scaling"]))
    if arch == "gpt-oss":       # llama.cpp: a window on every other layer from layer 0
        hf["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
        if hf["rope_scaling"] is not None:
            hf["rope_scaling"]["truncate"] = False     # as the model's config (its YaRN ramp is not rounded)
    if arch == "granite":
        hf.update({key: v for gguf_key, key in _GRANITE_SCALES.items() if (v := get(gguf_key)) is not None})
    if n_experts:       # llama.cpp renormalises the top-k of both (norm_w) unless the file says not
        hf.update(num_experts=n_experts, num_experts_per_tok=get("expert_used_count"),
                  moe_intermediate_size=get("expert_feed_forward_length", get("feed_forward_length")),
                  norm_topk_prob=get("expert_weights_norm", True),
                  mlp_only_layers=[i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" not in names])
    if arch == "minimax-m2" and get("expert_gating_func") != 2:     # llama.cpp routes by the key
        raise ValueError(f"GGUF minimax-m2.expert_gating_func = {get('expert_gating_func')} is not supported "
                         "(supported: 2, sigmoid)")
    if arch == "deepseek2":     # after the generic MoE keys, which it replaces with its own
        hf.update(_deepseek2_fields(get, n_heads, rope_dims, "blk.0.attn_q.weight" not in names))
    # Which projections carry a bias is what the file holds (as llama.cpp's optional tensors).
    return dataclasses.replace(ModelConfig.from_hf_dict(hf), qkv_bias="blk.0.attn_q.bias" in names,
                               o_bias="blk.0.attn_output.bias" in names)


def _kimi_config(get, meta: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """A kimi-linear GGUF's config.json, as moonshotai's checkpoints write it (models/kimi_linear.py
    KimiArgs reads it): KDA layers are those whose head_count_kv is 0; MLA sizes as DeepSeek-V2's
    (`key_length_mla` / `value_length_mla`); the converter writes no expert group count (one
    group, as llama.cpp then routes) and llama.cpp renormalises the top-k."""
    if get("expert_gating_func", 2) != 2:
        raise ValueError(f"GGUF kimi-linear.expert_gating_func = {get('expert_gating_func')} is not "
                         "supported (supported: 2, sigmoid)")
    kv, n = get("attention.head_count_kv"), get("block_count")
    kv = kv if isinstance(kv, list) else [kv] * n
    rope = get("rope.dimension_count")
    return {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
        "hidden_size": get("embedding_length"), "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": n, "num_attention_heads": get("attention.head_count"),
        "num_key_value_heads": get("attention.head_count"), "vocab_size": get("vocab_size"),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "max_position_embeddings": get("context_length", 4096),
        "tie_word_embeddings": "output.weight" not in names,
        "linear_attn_config": {"full_attn_layers": [i + 1 for i in range(n) if kv[i]],
                               "kda_layers": [i + 1 for i in range(n) if not kv[i]],
                               "num_heads": get("attention.head_count"), "head_dim": get("kda.head_dim"),
                               "short_conv_kernel_size": get("ssm.conv_kernel")},
        "q_lora_rank": get("attention.q_lora_rank") if any(".attn_q_a." in x for x in names) else None,
        "kv_lora_rank": get("attention.kv_lora_rank"), "qk_rope_head_dim": rope,
        "qk_nope_head_dim": get("attention.key_length_mla") - rope,
        "v_head_dim": get("attention.value_length_mla"),
        "num_experts": get("expert_count"), "num_experts_per_token": get("expert_used_count"),
        "num_shared_experts": get("expert_shared_count", 0),
        "moe_intermediate_size": get("expert_feed_forward_length"),
        "first_k_dense_replace": get("leading_dense_block_count", 0),
        "routed_scaling_factor": get("expert_weights_scale", 1.0),
        "num_expert_group": max(1, get("expert_group_count", 1)),
        "topk_group": max(1, get("expert_group_used_count", 1)),
        "moe_renormalize": True, "moe_router_activation_func": "sigmoid", "mla_use_nope": True,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }


def _minimax_m3_config(get, meta: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """A minimax-m3 GGUF's config.json in transformers' MiniMaxM3VLTextConfig names (models/minimax_m3.py
    M3Spec reads them), as llama.cpp builds the model: the leading dense blocks run full attention and
    a dense MLP, every later block sparse attention (the indexer's K only, no initial blocks) and the
    MoE; sigmoid routing, renormalised, times expert_weights_scale; the shared expert n_ff_exp wide per
    shared expert. Norm weights come with Gemma's 1 + w folded in (ModelConfig.norm_offset)."""
    if get("expert_gating_func") != 2 or not get("expert_weights_norm", False):
        raise ValueError(f"GGUF minimax-m3.expert_gating_func = {get('expert_gating_func')} / "
                         f"expert_weights_norm = {get('expert_weights_norm')} is not supported "
                         "(supported: 2, sigmoid; true)")
    n, lead, head_dim = get("block_count"), get("leading_dense_block_count", 0), get("attention.key_length")
    ff_exp = get("expert_feed_forward_length")
    return {
        "architectures": ["MiniMaxM3VLForCausalLM"], "model_type": "minimax_m3_vl_text",
        "hidden_size": get("embedding_length"), "num_hidden_layers": n,
        "num_attention_heads": get("attention.head_count"),
        "num_key_value_heads": get("attention.head_count_kv"),
        "head_dim": head_dim, "vocab_size": get("vocab_size") or len(meta["tokenizer.ggml.tokens"]),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "max_position_embeddings": get("context_length", 4096),
        "tie_word_embeddings": "output.weight" not in names,
        "rope_parameters": {"rope_type": "default", "rope_theta": get("rope.freq_base", 10000.0),
                            "partial_rotary_factor": get("rope.dimension_count", head_dim) / head_dim},
        "intermediate_size": ff_exp, "dense_intermediate_size": get("feed_forward_length"),
        "shared_intermediate_size": ff_exp * get("expert_shared_count", 1),
        "num_local_experts": get("expert_count"), "num_experts_per_tok": get("expert_used_count"),
        "routed_scaling_factor": get("expert_weights_scale", 1.0),
        "layer_types": ["full_attention" if i < lead else "minimax_m3_sparse" for i in range(n)],
        "mlp_layer_types": ["dense" if i < lead else "sparse" for i in range(n)],
        "index_n_heads": get("attention.indexer.head_count"),
        "index_head_dim": get("attention.indexer.key_length"),
        "index_block_size": get("attention.indexer.block_size"),
        "index_topk_blocks": get("attention.indexer.top_k"),
        "index_local_blocks": get("attention.indexer.local_blocks"), "index_init_blocks": 0,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }


def _deepseek2_fields(get, n_heads: int, rope_dim: int, q_lora: bool) -> dict[str, Any]:
    """The DeepseekV2Config keys of a deepseek2 GGUF (convert_hf_to_gguf.py DeepseekV2Model). Newer
    converters write the MLA head sizes as `key_length_mla` / `value_length_mla` (key_length is then
    the latent's), older ones as key_length / value_length; routed experts are never renormalised
    and the file's head_count_kv (1: MLA as MQA) is not a config key here. `expert_group_count` /
    `expert_group_used_count` (the converter's n_group / topk_group) > 1: DeepSeek-V2's
    group-limited routing, groups ranked by their best expert as the model does (llama.cpp ranks
    them by their best two, DeepSeek-V3's rule)."""
    key, value = get("attention.key_length_mla"), get("attention.value_length_mla")
    if key is None:
        key, value = get("attention.key_length"), get("attention.value_length")
    if get("expert_weights_norm", False):
        raise ValueError("GGUF deepseek2.expert_weights_norm = true is not supported (DeepSeek-V2 routing "
                         "does not renormalise the top-k)")
    if get("expert_gating_func", 1) != 1:
        raise ValueError(f"GGUF deepseek2.expert_gating_func = {get('expert_gating_func')} is not supported "
                         "(supported: 1, softmax)")
    return {"num_key_value_heads": n_heads, "head_dim": rope_dim, "partial_rotary_factor": 1.0,
            "q_lora_rank": get("attention.q_lora_rank") if q_lora else None,
            "kv_lora_rank": get("attention.kv_lora_rank"), "qk_rope_head_dim": rope_dim,
            "qk_nope_head_dim": key - rope_dim, "v_head_dim": value,
            "first_k_dense_replace": get("leading_dense_block_count", 0),
            "n_routed_experts": get("expert_count"), "num_experts_per_tok": get("expert_used_count"),
            "n_shared_experts": get("expert_shared_count", 0),
            "moe_intermediate_size": get("expert_feed_forward_length"),
            "routed_scaling_factor": get("expert_weights_scale", 1.0),
            "topk_method": "group_limited_greedy" if get("expert_group_count", 1) > 1 else "greedy",
            "n_group": get("expert_group_count", 1), "topk_group": get("expert_group_used_count", 1),
            "num_experts": None, "mlp_only_layers": None, "norm_topk_prob": False}


def _olmo3_fields(get, n_layers: int, theta: float, scaling: dict[str, Any] | None) -> dict[str, Any]:
    """OLMo 3 as llama.cpp's olmo2 runs a file with a window: the windowed layers from
    `sliding_window_pattern` (else all but every 4th), rotating unscaled by `rope.freq_base_swa`
    (else the global base); the full layers' rope as the file's scaling says."""
    pattern = get("attention.sliding_window_pattern")
    windowed = pattern if isinstance(pattern, list) else [(i + 1) % 4 != 0 for i in range(n_layers)]
    local = get("rope.freq_base_swa", theta)
    return {"layer_types": ["sliding_attention" if s else "full_attention" for s in windowed],
            "rope_parameters": {"full_attention": dict(scaling or {"rope_type": "default"}, rope_theta=theta),
                                "sliding_attention": {"rope_type": "default", "rope_theta": local}}}


def _gemma_fields(arch: str, get, n_layers: int, hidden: int, n_heads: int, head_dim: int) -> dict[str, Any]:
    """The HF config keys of a Gemma 2 / 3 GGUF that llama.cpp reads, or knows per model."""
    big = n_layers == _GEMMA_27B_LAYERS[arch]
    fields: dict[str, Any] = {"query_pre_attn_scalar": hidden // n_heads if big else head_dim,
                              "hidden_activation": "gelu_pytorch_tanh"}
    if arch == "gemma2":       # absent: llama.cpp's defaults, as transformers' (config.py _DEFAULTS)
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if (cap := get(key)) is not None:
                fields[key] = cap
    else:       # newer converters write the local base (rope_parameters' sliding_attention)
        fields["rope_local_base_freq"] = get("rope.freq_base_swa", _GEMMA_LOCAL_ROPE_BASE)
    pattern = get("attention.sliding_window_pattern")     # where a file says it (else the family's)
    if isinstance(pattern, int):
        fields["sliding_window_pattern"] = pattern
    elif pattern is not None:
        fields["layer_types"] = ["sliding_attention" if s else "full_attention" for s in pattern]
    return fields


def _rope_scaling(reader: GGUFFile, get, arch: str, head_dim: int) -> dict[str, Any] | None:
    """The rope scaling a GGUF file declares, as an HF-style `rope_scaling` dict (None: plain rope):
    `{arch}.rope.scaling.*` metadata (linear, yarn; older files' `rope.scale_linear`), the
    `rope_freqs.weight` divisors (rotary._inv_freq's "freq_factors") or Phi-3's LongRoPE factor
    tensors. What cannot be honoured is refused, naming the key."""
    kind = get("rope.scaling.type")
    factor = get("rope.scaling.factor", get("rope.scale_linear"))
    if kind is None and factor not in (None, 1.0):
        kind = "linear"
    tensors = {t.name: t for t in reader.tensors if t.name in _NOT_WEIGHTS}
    original = get("rope.scaling.original_context_length")
    if all(name in tensors for name in _ROPE_FACTORS.values()):
        return {"rope_type": "longrope", "attention_factor": get("rope.scaling.attn_factor"),
                "original_max_position_embeddings": original, "factor": get("context_length") / original,
                **{key: _floats(tensors[name]) for key, name in _ROPE_FACTORS.items()}}
    if kind == "yarn":
        log_mul = get("rope.scaling.yarn_log_multiplier")
        if arch == "deepseek2" and log_mul is not None:
            # 0.1 * mscale_all_dim (the converter's legacy form); llama.cpp scales cos / sin by
            # none: as a config whose mscale equals mscale_all_dim (DeepSeek-V2's own configs)
            mscale = float(np.float32(log_mul)) / 0.1
            return {"rope_type": "yarn", "factor": float(factor), "mscale": mscale, "mscale_all_dim": mscale,
                    "original_max_position_embeddings": original}
        if log_mul is not None:
            raise ValueError(f"GGUF {arch}.rope.scaling.yarn_log_multiplier (DeepSeek's YaRN mscale) is not "
                             "supported")
        betas = {k: v for k in ("beta_fast", "beta_slow") if (v := get(f"rope.scaling.yarn_{k}")) is not None}
        return {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": original,
                **betas}
    freqs = tensors.get(_ROPE_FREQS)
    if kind not in (None, "none", "linear"):
        raise ValueError(f"GGUF {arch}.rope.scaling.type = {kind!r} is not supported (supported: none, "
                         f"linear, yarn, and llama3 as a {_ROPE_FREQS} tensor)")
    if kind == "linear" and freqs is not None:
        raise ValueError(f"GGUF {arch}.rope.scaling.type = 'linear' beside a {_ROPE_FREQS} tensor is not "
                         "supported (one rope scaling at a time)")
    if kind == "linear" and factor not in (None, 1.0):
        return {"rope_type": "linear", "factor": float(factor)}
    if freqs is None:
        return None
    factors = _floats(freqs)
    if len(factors) != head_dim // 2:
        raise ValueError(f"GGUF {_ROPE_FREQS} has {len(factors)} values; expected head_dim / 2 = "
                         f"{head_dim // 2}")
    return {"rope_type": "freq_factors", "factors": factors}


def _floats(tensor) -> list[float]:
    return gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float64).reshape(-1).tolist()


def _unpermute_rows(rows: int, n_head: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation: hf[i] = gguf[perm[i]]."""
    return np.arange(rows).reshape(n_head, rows // n_head // 2, 2).swapaxes(1, 2).reshape(rows)


def gguf_weights(path: str, cfg: ModelConfig, names: set[str] | None = None, for_int8: bool = False
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor (HF names), or only those in `names` (the others are not dequantized).
    `for_int8`: the model runs int8 activations, so quantized weights of other types come as
    blocks of a type the int8 kernels read (loader/gguf_int8.py). Once read (or abandoned), the
    file's reader is dropped from the cache: a process reads its weights once, and the reader
    holds a few times the metadata's memory besides the file's mapping."""
    reader = open_gguf(path)
    arch = gguf_metadata(path)["general.architecture"]
    permuted = arch in _PERMUTED
    forms = _int8_forms(reader) if for_int8 else {}
    if forms and names is None:
        kinds = Counter(f"{type_name(int(t.tensor_type))} -> {type_name(forms[t.name])}"
                        for t in reader.tensors if t.name in forms)
        log.info("GGUF weights held for the int8 kernels: %s",
                 ", ".join(f"{k} x {n}" for k, n in kinds.items()))
    try:
        yield from _tensors(reader, cfg, names, permuted, forms, _LAYER_NAMES_OF.get(arch, _LAYER_NAMES))
    finally:
        close_gguf(path)


# Tensors of one layer fused into one projection (layers/linear.py FusedLinear: q|k|v, with Kimi-Linear's KDA
# f_a|g_a|beta; a MoE expert's gate|up); MLA's kv_b halves, blocks of rows per head (models/split_kv_b.py).
_FUSED = ({"attn_q", "attn_k", "attn_v", "ssm_f_a", "ssm_g_a", "ssm_beta"}, {"ffn_gate", "ffn_up"},
          {"ffn_gate_exps", "ffn_up_exps"})
_SPLIT_KV_B = ("attn_k_b.weight", "attn_v_b.weight")      # [heads, rows, k], read as [heads * rows, k]


def _int8_forms(reader: GGUFFile) -> dict[str, int]:
    """GGUF tensor name -> the block type it is converted to for the int8 kernels (those kept as
    they are are left out): each tensor's own form, one form for the tensors of a fused projection."""
    types = {t.name: int(t.tensor_type) for t in reader.tensors
             if len(t.shape) == 2 or t.name.endswith(("_exps.weight", *_SPLIT_KV_B))}
    forms = {name: form for name, qtype in types.items() if (form := int8_form(qtype)) is not None}
    forms.update({n: Q8_0 for n, f in forms.items() if f == Q6_S and n.endswith(_SPLIT_KV_B)})  # fp32 x: fast
    for name in types:
        m = re.fullmatch(r"(blk\.\d+\.)(\w+)\.weight", name)
        group = next((g for g in _FUSED if m and m.group(2) in g), None)
        if group is None:
            continue
        members = [f"{m.group(1)}{part}.weight" for part in sorted(group)]
        form = group_form([types[n] for n in members if n in types])
        if form is not None and form != types[name]:
            forms[name] = form
        elif form is None:
            forms.pop(name, None)
    return forms


def _tensors(reader: GGUFFile, cfg: ModelConfig, names: set[str] | None, permuted: bool,
             int8_forms: dict[str, int], layer_names: dict[str, str]) -> Iterator[tuple[str, torch.Tensor]]:
    for t in reader.tensors:
        if t.name in _NOT_WEIGHTS:      # read into the config's rope scaling (gguf_config)
            continue
        name = _hf_name(t.name, layer_names)
        if names is not None and name not in names:
            continue
        shape = (t.shape[0] * t.shape[1], t.shape[2]) if t.name.endswith(_SPLIT_KV_B) else t.shape
        n_head = (cfg.num_attention_heads if name.endswith(("q_proj.weight", "q_proj.bias")) else
                  cfg.num_key_value_heads if name.endswith(("k_proj.weight", "k_proj.bias")) else None)
        perm = _unpermute_rows(shape[0], n_head) if permuted and n_head is not None else None
        form = int8_forms.get(t.name)
        stacked = len(shape) == 3 and t.name.endswith("_exps.weight")
        if stacked and (form is not None or BlockWeight.supports(int(t.tensor_type), shape[1:])):
            yield from _expert_blocks(t, name, form)
            continue
        if len(shape) < 3 and (form is not None or BlockWeight.supports(int(t.tensor_type), shape)):
            # unread: the loader dequantizes the blocks only for a module that keeps fp32 values
            blocks = (BlockWeight.from_numpy(int(t.tensor_type), t.data, shape) if form is None else
                      int8_blocks(int(t.tensor_type), t.data, shape, form))
            yield name, with_blocks(torch.empty(shape, device="meta"),
                                    blocks if perm is None else blocks.rows(perm))
            continue
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if perm is not None:
            w = w[perm]
        if t.name.endswith(".ssm_a"):      # Kimi-Linear: the converter wrote -exp(A_log)
            w = np.log(-w)
        if cfg.norm_offset and name.endswith("norm.weight"):
            w = w - np.float32(cfg.norm_offset)   # the converter folded Gemma's 1 + w in: HF's w loads
        yield name, torch.from_numpy(w if w.flags.writeable and w.flags.c_contiguous else w.copy())



def _expert_blocks(t, name: str, form: int | None) -> Iterator[tuple[str, torch.Tensor]]:
    """A stacked `ffn_*_exps` tensor of block type as one unread tensor per expert (HF's per-expert
    names) with its blocks: a MoE served from blocks holds them as they are, never in fp32."""
    prefix, part = name.rsplit(".", 2)[0], name.rsplit(".", 2)[1]       # ...mlp.experts, gate_proj
    shape = t.shape[1:]
    for e in range(t.shape[0]):
        blocks = (BlockWeight.from_numpy(int(t.tensor_type), t.data[e], shape) if form is None else
                  int8_blocks(int(t.tensor_type), t.data[e], shape, form))
        yield f"{prefix}.{e}.{part}.weight", with_blocks(torch.empty(shape, device="meta"), blocks)


def _hf_name(name: str, layer_names: dict[str, str] = _LAYER_NAMES) -> str:
    m = re.fullmatch(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight", name)
    if m:       # older Mixtral GGUFs: one tensor per expert
        return f"model.layers.{m[1]}.mlp.experts.{m[3]}.{m[2]}_proj.weight"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+(?:\.\w+)*?)(?:\.(weight|bias))?", name)   # part: `indexer.q_proj`
    if m and (m[3] is None or f"{m[2]}.{m[3]}" in layer_names):     # a whole HF name (_KIMI_LAYER_NAMES)
        key = m[2] if m[3] is None else f"{m[2]}.{m[3]}"
        if key not in layer_names:
            raise ValueError(f"unknown GGUF tensor {name}")
        return f"model.layers.{m[1]}.{layer_names[key]}"
    if m:
        layer, part, kind = m.groups()
        if part not in layer_names:
            raise ValueError(f"unknown GGUF tensor {name}")
        return f"model.layers.{layer}.{layer_names[part]}.{kind}"
    base, kind = name.rsplit(".", 1)
    if base not in _TOP_NAMES:
        raise ValueError(f"unknown GGUF tensor {name}")
    return f"{_TOP_NAMES[base]}.{kind}"
