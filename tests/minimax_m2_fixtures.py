"""Tiny random MiniMax-M2 checkpoints (hidden 64, 4 heads / 2 KV heads of 16 channels, 8 of them
rotated, 4 experts top-2 on every layer), saved by transformers' MiniMaxM2ForCausalLM in the released
checkpoints' format (transformers 5 writes it back: `block_sparse_moe.experts.N.w1/w2/w3`,
`block_sparse_moe.e_score_correction_bias`, `rotary_dim`), which llama.cpp's converter reads too.

Every 1-D tensor (norms, the routing bias, a buffer) is moved off its init value so a loader that drops
one shows; every value is rounded to bfloat16 so the F32 / F16 GGUF files hold the directory's numbers."""
from __future__ import annotations

import json
import os
from typing import Any

import torch

VOCAB = 320
TINY: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, rotary_dim=8, num_local_experts=4, num_experts_per_tok=2,
    max_position_embeddings=256, rope_theta=5000000.0, initializer_range=0.15, rms_norm_eps=1e-6,
    scoring_func="sigmoid", use_routing_bias=True, use_qk_norm=True, bos_token_id=None, eos_token_id=None,
    pad_token_id=None, tie_word_embeddings=False)


def make_minimax_m2(path: str, seed: int = 0, **overrides: Any) -> str:
    from transformers import AutoModelForCausalLM, MiniMaxM2Config
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(MiniMaxM2Config(**dict(TINY, **overrides)), dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if "rotary_emb" in name:
                continue
            if t.dim() == 1:       # norms start at 1, the routing bias at 0
                t.add_(0.3 * torch.randn(t.shape, generator=g))
            t.copy_(t.to(torch.bfloat16).float())
    model.save_pretrained(path)
    return path


def as_released_config(path: str) -> str:
    """config.json as MiniMaxAI's checkpoints ship it: `rope_theta` and `rotary_dim` at the top level,
    no `rope_parameters` (transformers derives the partial rotary factor from `rotary_dim`). In place."""
    file = os.path.join(path, "config.json")
    with open(file) as f:
        cfg = json.load(f)
    rope = cfg.pop("rope_parameters")
    cfg.update(rope_theta=rope["rope_theta"], rotary_dim=int(rope["partial_rotary_factor"] * cfg["head_dim"]),
               qk_norm_type="per_layer", shared_intermediate_size=0)
    with open(file, "w") as f:
        json.dump(cfg, f, indent=1)
    return path


# HF name (after the layer prefix) -> GGUF name, gguf-py's minimax-m2 tensor list
GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.e_score_correction_bias": "exp_probs_b.bias"}
GGUF_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}
GGUF_EXPERTS = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def minimax_gguf_writer(out: str, arch: str, hp: dict, ftype: str, ffn_width: int, rope_theta: float,
                        gating):
    """A GGUFWriter holding the keys convert_hf_to_gguf.py's MiniMaxM2Model writes (its MiniMaxM3Model
    adds its own after them): TextModel's, the gating function, the experts' width and rotary_dim."""
    import gguf
    w = gguf.GGUFWriter(out, arch)
    w.add_block_count(hp["num_hidden_layers"])
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(ffn_width)
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_expert_count(hp["num_local_experts"])
    w.add_expert_used_count(hp["num_experts_per_tok"])
    if gating is not None:
        w.add_expert_gating_func(gating)
    w.add_key_length(hp["head_dim"])
    w.add_value_length(hp["head_dim"])
    w.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                     "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[ftype])
    w.add_expert_feed_forward_length(hp["intermediate_size"])
    w.add_rope_dimension_count(hp["rotary_dim"])
    return w


def add_stand_in_vocab(w, vocab: int) -> None:
    """A stand-in vocabulary (_set_vocab_gpt2 writes one entry per id up to vocab_size)."""
    import gguf
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("minimax-m2")
    w.add_token_list([f"<t{i}>" for i in range(vocab)])
    w.add_token_types([gguf.TokenType.NORMAL] * vocab)
    w.add_token_merges([])


def write_minimax_m2_gguf(hf_dir: str, out: str, ftype: str = "f32", gating_func: int | None = None) -> str:
    """The checkpoint at `hf_dir` as convert_hf_to_gguf.py MiniMaxM2Model writes it (--outtype f32 /
    f16 / q8_0): TextModel's keys (the gating function from `scoring_func`, key/value length from
    head_dim), the experts' width and `rotary_dim`; per-expert w1/w3/w2 stacked into ffn_*_exps, the
    routing bias as `exp_probs_b.bias`; F32 for 1-D tensors, norms and the router. `gating_func`:
    another expert_gating_func in its place (a file the loader must refuse)."""

    import gguf
    from gguf_fixture_tensors import checkpoint_arrays, stacked_experts, tensor_adder
    with open(os.path.join(hf_dir, "config.json")) as f:
        hp = json.load(f)
    rope = hp.get("rope_parameters") or {}
    n_experts, vocab = hp["num_local_experts"], hp["vocab_size"]
    if gating_func is not None:
        gating = gguf.ExpertGatingFuncType(gating_func)
    else:
        gating = gguf.ExpertGatingFuncType.SIGMOID if hp.get("scoring_func") == "sigmoid" else None
    w = minimax_gguf_writer(out, "minimax-m2", hp, ftype, hp["intermediate_size"],
                            rope.get("rope_theta", hp.get("rope_theta")), gating)
    add_stand_in_vocab(w, vocab)

    add = tensor_adder(w, ftype, lambda gname, t: t.ndim == 1
                       or gname.endswith(("_norm.weight", "ffn_gate_inp.weight", ".bias")))
    for name, t in stacked_experts(checkpoint_arrays(hf_dir), n_experts, GGUF_EXPERTS):
        if name.startswith("blk."):
            add(name, t)
        elif name in GGUF_TOP:
            add(GGUF_TOP[name], t)
        else:
            _, _, layer, rest = name.split(".", 3)
            add(f"blk.{layer}.{GGUF_LAYER[rest]}", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
