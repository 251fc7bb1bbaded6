"""Growing a trained draft (`train-draft --init-draft DIR` with architecture flags): the options
added to it start with weights that make the grown draft compute exactly the init draft's logits,
so training continues from what the draft knows instead of from scratch. Added fusion starts
with a zero projection; added layers with zero output projections (attention's o_proj and the
MLP's down_proj: identity residual blocks); a wider context read copies each KV head to the
query heads that read it (GQA). A per-tap RMS norm cannot start exact (it divides each row by
its own RMS, which no starting weight undoes): refused."""
from __future__ import annotations

import torch

from sparkserve.models.dspark_draft import DSparkDraft, init_dspark_draft


def grown_config(init_cfg: dict, init_dir: str, num_layers: int | None = None, kv_heads: int | None = None,
                 tap_norm: bool = False, prev_context_fusion: bool = False) -> dict:
    """The init draft's config with the options the flags add (a flag the draft already has, or
    left out, keeps it); what cannot start as the init draft is refused, naming its flag."""
    out = dict(init_cfg)
    if tap_norm and not init_cfg.get("tap_norm"):
        raise ValueError(f"--tap-norm with --init-draft: the draft in {init_dir} has no tap norm, and one "
                         "cannot start as the identity (it divides each row by its own RMS); train a new "
                         "draft for it")
    if prev_context_fusion:
        out["prev_context_fusion"] = True
    layers = init_cfg["num_hidden_layers"]
    if num_layers is not None and num_layers != layers:
        if num_layers < layers:
            raise ValueError(f"--num-layers {num_layers} with --init-draft: the draft in {init_dir} has "
                             f"{layers} layers (a draft grows, it does not shrink)")
        out["num_hidden_layers"] = num_layers
        out["layer_types"] = ["full_attention"] * num_layers
    heads, kv = init_cfg["num_attention_heads"], init_cfg.get("num_key_value_heads") or init_cfg[
        "num_attention_heads"]
    if kv_heads is not None and kv_heads != kv:
        if kv_heads % kv or heads % kv_heads:
            raise ValueError(f"--draft-kv-heads {kv_heads} with --init-draft: the draft in {init_dir} has "
                             f"{kv} KV heads; a wider read starts as it only at a multiple of {kv} that "
                             f"divides its {heads} attention heads")
        out["num_key_value_heads"] = kv_heads
    return out


def load_init_draft(path: str, init_cfg: dict, config: dict, target, vocab: torch.Tensor | None,
                    head: torch.Tensor) -> DSparkDraft:
    """The draft in `path` (config init_cfg), grown to `config` where the flags added options, and
    moved to the reduced vocab `vocab` when one was re-picked (draft_vocab.move_to_vocab)."""
    from sparkserve.loader.hf import hf_weights
    from sparkserve.training.draft_vocab import move_to_vocab
    draft = init_dspark_draft(init_cfg, target)
    draft.load_weights(hf_weights(path), target)
    own_vocab = dict(config, draft_vocab_size=init_cfg.get("draft_vocab_size"))
    if own_vocab != {**init_cfg, "draft_vocab_size": init_cfg.get("draft_vocab_size")}:
        draft = grow_draft(draft, own_vocab, target)
    if vocab is not None:
        moved = init_dspark_draft(config, target, vocab=vocab)
        move_to_vocab(draft, moved, head)
        draft = moved
    return draft


def grow_draft(init: DSparkDraft, config: dict, target=None) -> DSparkDraft:
    """A draft of `config` (init's, grown by grown_config) computing init's logits exactly."""
    c = init.config
    vocab = None if init.d2t is None else init.to_target_ids(torch.arange(c.out_vocab))
    grown = init_dspark_draft(config, target, vocab=vocab)
    shared = tuple(f"{m}." for m in init.shared_with_target)     # the target's: grown copies them
    state = {k: v.detach().clone() for k, v in init.state_dict().items() if not k.startswith(shared)}
    rep = grown.config.num_key_value_heads // c.num_key_value_heads
    if rep > 1:
        for i in range(c.num_hidden_layers):
            for part in ("weight", "bias"):
                key = f"layers.{i}.self_attn.kv_proj.{part}"
                if key in state:      # [k; v] rows, each [Hkv * D]: head j of the grown read = j // rep
                    kv = state[key].view(2, c.num_key_value_heads, c.head_dim, -1)
                    state[key] = kv.repeat_interleave(rep, dim=1).reshape(-1, *state[key].shape[1:])
    missing, unexpected = grown.load_state_dict(state, strict=False)
    new = (f"layers.{i}." for i in range(c.num_hidden_layers, grown.config.num_hidden_layers))
    added = tuple(new) + (("fuse_proj.",) if grown.fuse_proj is not None and init.fuse_proj is None else ())
    added += shared
    if unexpected or any(not k.startswith(added) for k in missing):
        raise ValueError(f"grow_draft: weights that do not carry over: {unexpected or missing}")
    with torch.no_grad():
        for layer in grown.layers[c.num_hidden_layers:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.down_proj.weight.zero_()
        if init.fuse_proj is None and grown.fuse_proj is not None:
            grown.fuse_proj.weight.zero_()
            if grown.fuse_proj.bias is not None:
                grown.fuse_proj.bias.zero_()
    return grown
