"""A tiny random MiniMax-M3 text checkpoint (hidden 64, 3 layers: dense attention + dense MLP, then
two sparse-attention MoE layers with 4 experts; index block 4, top-3 blocks, 1 local block), shared
by the model tests and the expert- and tensor-parallel tests; `with_index_value` gives its last
layer the index value path (not in transformers: its v/o weights are added to the checkpoint)."""
from __future__ import annotations

import json
import os

import torch

VOCAB, BLOCK, TOPK = 256, 4, 3
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, dense_intermediate_size=96,
            shared_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, index_n_heads=2,
            index_head_dim=16, index_block_size=BLOCK, index_topk_blocks=TOPK, index_local_blocks=1,
            layer_types=["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"],
            mlp_layer_types=["dense", "sparse", "sparse"], max_position_embeddings=512,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            initializer_range=0.15, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def make_minimax(path: str, seed: int = 0, **overrides) -> str:
    from transformers import MiniMaxM3VLForCausalLM, MiniMaxM3VLTextConfig
    torch.manual_seed(seed)
    MiniMaxM3VLForCausalLM(MiniMaxM3VLTextConfig(**dict(TINY, **overrides))).save_pretrained(path)
    return path


def with_index_value(path: str, seed: int = 1) -> str:
    """Turn the index value path on for the last layer (SGLang's sparse_disable_index_value
    flag 0 there), with random index v_proj / o_proj weights; in place."""
    from safetensors.torch import load_file, save_file
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    d, hi, n = cfg["index_head_dim"], cfg["index_n_heads"], cfg["num_hidden_layers"]
    g = torch.Generator().manual_seed(seed)
    pre = f"model.layers.{n - 1}.self_attn.indexer"
    extra = {f"{pre}.v_proj.weight": torch.randn(d, cfg["hidden_size"], generator=g) * 0.15,
             f"{pre}.o_proj.weight": torch.randn(cfg["hidden_size"], hi * d, generator=g) * 0.15}
    file = os.path.join(path, "model.safetensors")
    save_file({**load_file(file), **extra}, file, metadata={"format": "pt"})
    cfg["sparse_disable_index_value"] = [1] * (n - 1) + [0]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path
