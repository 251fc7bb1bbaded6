"""Tiny random Kimi-Linear checkpoints (KDA + MLA + MoE) saved by transformers, shared by the
model tests and the pool-sizing test."""
from __future__ import annotations

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
