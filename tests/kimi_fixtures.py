"""Tiny random Kimi-Linear checkpoints (KDA + MLA + MoE) saved by transformers, shared by the
model tests and the pool-sizing test."""
from __future__ import annotations

import json
import os
import re

import torch

VOCAB = 256
BASE = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=VOCAB, kv_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=16, num_local_experts=8, num_experts_per_tok=2,
            linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4, initializer_range=0.2,
            rms_norm_eps=1e-5, max_position_embeddings=512, bos_token_id=None, eos_token_id=None,
            pad_token_id=None, tie_word_embeddings=False)
CONFIGS = {
    # KDA first, grouped routing, one shared expert, no q LoRA
    "kda_mla": dict(BASE, num_hidden_layers=4, q_lora_rank=None, n_shared_experts=1, n_group=2, topk_group=1,
                    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                    mlp_layer_types=["dense", "sparse", "sparse", "sparse"]),
    # MLA first, q LoRA, two shared experts, ungrouped routing, two dense layers
    "mla_kda": dict(BASE, num_hidden_layers=3, q_lora_rank=24, n_shared_experts=2, n_group=1, topk_group=1,
                    layer_types=["full_attention", "linear_attention", "linear_attention"],
                    mlp_layer_types=["dense", "sparse", "dense"]),
}
# What a GGUF file can say (llama.cpp's converter writes no expert groups for Kimi-Linear, and llama.cpp
# builds it without q LoRA, as the released model): KDA first, one dense layer then MoE
# (first_k_dense_replace), ungrouped routing; a vocabulary a byte-level BPE fits
CONFIGS["gguf"] = dict(BASE, num_hidden_layers=4, q_lora_rank=None, n_shared_experts=1, n_group=1,
                       topk_group=1, vocab_size=320, layer_types=["linear_attention", "full_attention"] * 2,
                       mlp_layer_types=["dense", "sparse", "sparse", "sparse"])
# with q LoRA, which a file may carry (sparkserve reads it; llama.cpp's kimi-linear does not)
CONFIGS["gguf_qlora"] = dict(CONFIGS["gguf"], q_lora_rank=24)


def make_kimi(path: str, name: str, seed: int = 0) -> str:
    from transformers import AutoModelForCausalLM, KimiLinearConfig
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(KimiLinearConfig(**CONFIGS[name]), dtype=torch.float32)
    with torch.no_grad():     # init leaves norms at 1 and the routing bias at 0: make them count
        for n, t in list(model.named_parameters()) + list(model.named_buffers()):
            if "norm" in n or "e_score_correction_bias" in n:
                t.add_(torch.randn(t.shape) * 0.3)
    model.save_pretrained(path)
    return path


def as_original_checkpoint(path: str) -> str:
    """The checkpoint at `path` in the format moonshotai's Kimi-Linear checkpoints ship (and llama.cpp's
    converter reads): `linear_attn_config` (1-indexed layer lists), `first_k_dense_replace`,
    `moe_router_activation_func`, `mla_use_nope`, and the dense MLPs under `mlp.` (transformers'
    save_pretrained names them `block_sparse_moe.`); transformers reads both the same. In place."""
    from safetensors.torch import load_file, save_file
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    types, mlp = cfg.pop("layer_types"), cfg.pop("mlp_layer_types")
    if "dense" in mlp[mlp.index("sparse"):]:
        raise ValueError("the original format has dense layers first only (first_k_dense_replace)")
    cfg["linear_attn_config"] = {
        "full_attn_layers": [i + 1 for i, t in enumerate(types) if t == "full_attention"],
        "kda_layers": [i + 1 for i, t in enumerate(types) if t == "linear_attention"],
        "num_heads": cfg.pop("linear_num_heads"), "head_dim": cfg.pop("linear_head_dim"),
        "short_conv_kernel_size": cfg.pop("linear_conv_kernel_dim")}
    cfg.pop("head_dim", None)
    cfg.update(first_k_dense_replace=mlp.index("sparse"), moe_router_activation_func="sigmoid",
               mla_use_nope=True, use_grouped_topk=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    file = os.path.join(path, "model.safetensors")
    weights = {re.sub(r"\.block_sparse_moe\.(gate|up|down)_proj\.", r".mlp.\1_proj.", k): v
               for k, v in load_file(file).items()}
    save_file(weights, file, metadata={"format": "pt"})
    return path
