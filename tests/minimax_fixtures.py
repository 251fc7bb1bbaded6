"""A tiny random MiniMax-M3 text checkpoint (hidden 64, 3 layers: dense attention + dense MLP, then
two sparse-attention MoE layers with 4 experts; index block 4, top-3 blocks, 1 local block), shared
by the model tests and the expert- and tensor-parallel tests; `with_index_value` gives its last
layer the index value path (not in transformers: its v/o weights are added to the checkpoint)."""
from __future__ import annotations

import json
import os

import torch
from minimax_m2_fixtures import GGUF_EXPERTS, GGUF_TOP, add_stand_in_vocab, minimax_gguf_writer
from minimax_m2_fixtures import GGUF_LAYER as M2_LAYER

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


def as_original_checkpoint(path: str) -> str:
    """The checkpoint at `path` (transformers' MiniMaxM3VL text names) in MiniMax's own layout, which
    llama.cpp's converter reads (MiniMaxM3Model): `sparse_attention_config` / `moe_layer_freq` /
    `n_shared_experts` / `scoring_func` / `rotary_dim` in config.json (transformers' flat keys kept), the
    MoE under `block_sparse_moe.` with per-expert w1 / w3 / w2, gate and up apart in the dense MLP and the
    shared expert, the indexer's tensors as `self_attn.index_*` (transformers' conversion mapping, reversed).
    In place."""
    from safetensors.torch import load_file, save_file
    file, cfg_file = os.path.join(path, "model.safetensors"), os.path.join(path, "config.json")
    with open(cfg_file) as f:
        cfg = json.load(f)
    n, rope = cfg["num_hidden_layers"], cfg["rope_parameters"]
    # a model_type transformers has no class for (a remote-code checkpoint's): the converter reads config.json
    cfg.update(architectures=["MiniMaxM3SparseForCausalLM"], model_type="minimax_m3", n_shared_experts=1,
               scoring_func="sigmoid",
               rotary_dim=int(rope["partial_rotary_factor"] * cfg["head_dim"]),
               moe_layer_freq=[int(t == "sparse") for t in cfg["mlp_layer_types"]],
               sparse_attention_config={
                   "sparse_attention_freq": [int(t == "minimax_m3_sparse") for t in cfg["layer_types"]],
                   "sparse_num_index_heads": cfg["index_n_heads"], "sparse_index_dim": cfg["index_head_dim"],
                   "sparse_topk_blocks": cfg["index_topk_blocks"],
                   "sparse_block_size": cfg["index_block_size"],
                   "sparse_local_block": cfg["index_local_blocks"], "sparse_init_block": 0})
    with open(cfg_file, "w") as f:
        json.dump(cfg, f, indent=1)
    out = {}
    for name, t in load_file(file).items():
        name = name.replace(".self_attn.indexer.", ".self_attn.index_")
        moe = name.replace(".mlp.", ".block_sparse_moe.")
        if name.endswith("mlp.experts.gate_up_proj"):
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[moe.replace("gate_up_proj", f"{e}.w1.weight")] = t[e, :half].clone()
                out[moe.replace("gate_up_proj", f"{e}.w3.weight")] = t[e, half:].clone()
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                out[moe.replace("down_proj", f"{e}.w2.weight")] = t[e].clone()
        elif name.endswith("gate_up_proj.weight"):
            base = moe if ".shared_experts." in name else name
            half = t.shape[0] // 2
            out[base.replace("gate_up_proj", "gate_proj")] = t[:half].clone()
            out[base.replace("gate_up_proj", "up_proj")] = t[half:].clone()
        elif ".mlp.gate." in name or ".mlp.shared_experts." in name:
            out[moe.replace(".gate.e_score_correction_bias", ".e_score_correction_bias")] = t
        else:
            out[name] = t
    save_file(out, file, metadata={"format": "pt"})
    assert n == len(cfg["layer_types"])
    return path


# MiniMax's names (after `model.layers.N.`) -> GGUF names, gguf-py's minimax-m3 tensor list: M2's,
# the indexer's, the leading dense MLP's and the shared expert's
GGUF_LAYER = {
    **M2_LAYER,
    **{f"self_attn.index_{p}.weight": f"indexer.{p}.weight" for p in ("q_proj", "k_proj", "q_norm",
                                                                      "k_norm")},
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "block_sparse_moe.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "block_sparse_moe.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "block_sparse_moe.shared_experts.down_proj.weight": "ffn_down_shexp.weight"}


def write_minimax_m3_gguf(hf_dir: str, out: str, ftype: str = "f32") -> str:
    """A checkpoint in MiniMax's layout (as_original_checkpoint) as convert_hf_to_gguf.py MiniMaxM3Model
    writes it (--outtype f32 / f16 / q8_0): TextModel's keys (feed_forward_length the dense width,
    the gating function from scoring_func), M2's (experts' width, rotary_dim), M3's (shared expert count,
    weights scale, weights norm, the indexer's sizes from sparse_attention_config, leading dense blocks
    from moe_layer_freq); every `*norm.weight` + 1 (Gemma's norm folded in); experts stacked; F32 for
    1-D tensors, norms, the router and every indexer tensor."""

    import gguf
    import numpy as np
    from gguf_fixture_tensors import checkpoint_arrays, stacked_experts, tensor_adder
    with open(os.path.join(hf_dir, "config.json")) as f:
        hp = json.load(f)
    rope, sac, vocab = hp["rope_parameters"], hp["sparse_attention_config"], hp["vocab_size"]
    n_experts, arch = hp["num_local_experts"], "minimax-m3"
    w = minimax_gguf_writer(out, arch, hp, ftype, hp["dense_intermediate_size"], rope["rope_theta"],
                            gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_shared_count(hp["n_shared_experts"])
    w.add_expert_weights_scale(hp["routed_scaling_factor"])
    w.add_expert_weights_norm(True)
    for key, value in (("head_count", sac["sparse_num_index_heads"]), ("key_length", sac["sparse_index_dim"]),
                       ("top_k", sac["sparse_topk_blocks"]), ("block_size", sac["sparse_block_size"]),
                       ("local_blocks", sac["sparse_local_block"])):
        w.add_uint32(f"{arch}.attention.indexer.{key}", value)
    freq = hp["moe_layer_freq"]
    w.add_leading_dense_block_count(freq.index(1) if 1 in freq else len(freq))
    add_stand_in_vocab(w, vocab)

    add = tensor_adder(w, ftype, lambda gname, t: t.ndim == 1 or ".indexer." in gname
                       or gname.endswith(("_norm.weight", "ffn_gate_inp.weight", ".bias")))
    for name, t in stacked_experts(checkpoint_arrays(hf_dir), n_experts, GGUF_EXPERTS):
        if name.startswith("blk."):
            add(name, t)
            continue
        if name.endswith("norm.weight"):
            t = t + np.float32(1.0)
        if name in GGUF_TOP:
            add(GGUF_TOP[name], t)
            continue
        _, _, layer, rest = name.split(".", 3)
        add(f"blk.{layer}.{GGUF_LAYER[rest]}", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def make_minimax_exact(path: str, seed: int = 0, **overrides) -> str:
    """make_minimax with every 1-D tensor (norms, the routing bias) moved off its init value, so a
    loader that drops or mis-offsets one shows, and every value rounded to bfloat16, so F32 / F16 GGUF
    files hold the directory's numbers."""
    from safetensors.torch import load_file, save_file
    make_minimax(path, seed, **overrides)
    file = os.path.join(path, "model.safetensors")
    g = torch.Generator().manual_seed(seed + 1)
    w = {k: (t + 0.3 * torch.randn(t.shape, generator=g) if t.dim() == 1 else t).to(torch.bfloat16).float()
         for k, t in load_file(file).items()}
    save_file(w, file, metadata={"format": "pt"})
    return path
