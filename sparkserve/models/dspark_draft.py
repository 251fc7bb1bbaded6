"""DSpark draft model (DeepSpec checkpoint format): a small non-causal backbone over a block
[anchor, mask x (gamma-1)] whose attention also sees per-layer K/V rows made from tapped
target hidden states (KV injection), plus the Markov head and the confidence head.

Context rows live in the draft's own KV pool at the same slots as the target's tokens, so the
target's allocator, prefix cache and retraction cover the draft's cache too."""
from __future__ import annotations

import json
import os
from typing import Any, Iterable

import torch
from torch import nn

from sparkserve.kernels import BlockWeight
from sparkserve.layers.activation import silu_and_mul
from sparkserve.layers.block_backed import hold_weights_in_huge_pages
from sparkserve.layers.linear import ACTIVATION_QUANTS, FusedLinear, Linear
from sparkserve.layers.norm import RMSNorm
from sparkserve.layers.rotary import RotaryEmbedding, apply_rotary
from sparkserve.loader.weights import WeightLoader, values_of
from sparkserve.mem.heap import release_freed_memory
from sparkserve.mem.kv_pool import KVPool
from sparkserve.models.causal_lm import CausalLM
from sparkserve.models.dspark_config import DSparkConfig
from sparkserve.models.dspark_native import NativeDraftStep
from sparkserve.models.dspark_pool import DraftKVPool, read_rows, write_rows


class DSparkAttention(nn.Module):
    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.h, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, self.h * self.d, bias=cfg.attention_bias)
        self.kv_proj = FusedLinear(cfg.hidden_size, {"k": self.hkv * self.d, "v": self.hkv * self.d},
                                   bias=cfg.attention_bias)
        self.o_proj = Linear(self.h * self.d, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos_sin) -> tuple[torch.Tensor, torch.Tensor]:
        """K (normed, rotated) and V rows [T, Hkv, D] of hidden rows x [T, d]."""
        k, v = self.kv_proj(x).split(self.hkv * self.d, dim=-1)
        k = apply_rotary(self.k_norm(k.reshape(-1, self.hkv, self.d)), *cos_sin)
        return k, v.reshape(-1, self.hkv, self.d)

    def queries(self, x: torch.Tensor, cos_sin) -> torch.Tensor:
        """Q rows (normed, rotated) [T, H, D] of hidden rows x [T, d]."""
        return apply_rotary(self.q_norm(self.q_proj(x).view(-1, self.h, self.d)), *cos_sin)

    def forward(self, x: torch.Tensor, cos_sin, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
                mask: torch.Tensor | None, B: int) -> torch.Tensor:
        """x: [B*G, d] block rows; ctx_k/v: [B, L, Hkv, D] injected context."""
        q = self.queries(x, cos_sin)
        k, v = self.kv(x, cos_sin)
        k = torch.cat([ctx_k, k.view(B, -1, self.hkv, self.d)], dim=1).transpose(1, 2)
        v = torch.cat([ctx_v, v.view(B, -1, self.hkv, self.d)], dim=1).transpose(1, 2)
        q = q.view(B, -1, self.h, self.d).transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=self.h != self.hkv)
        return self.o_proj(out.transpose(1, 2).reshape(-1, self.h * self.d))


class DSparkLayer(nn.Module):
    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DSparkAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_up_proj = FusedLinear(cfg.hidden_size, {"gate": cfg.intermediate_size,
                                                          "up": cfg.intermediate_size})
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x, cos_sin, ctx_k, ctx_v, mask, B):
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, ctx_k, ctx_v, mask, B)
        return x + self.mlp(x)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP branch (its pre-norm included) of residual rows x."""
        return self.down_proj(silu_and_mul(self.gate_up_proj(self.post_attention_layernorm(x))))


def _embedding(num: int, dim: int) -> nn.Embedding:
    """nn.Embedding with its usual N(0, 1) weight, left uninitialized when built on the meta device
    for loading: torch's meta normal_ imports torch._dynamo on first use, most of a second."""
    weight = torch.empty(num, dim)
    if weight.device.type != "meta":
        nn.init.normal_(weight)
    return nn.Embedding(num, dim, _weight=weight)


class MarkovHead(nn.Module):
    """First-order low-rank bias W2 W1[x_prev] on the slot logits (gated: sigma(gate([h; W1 x])))."""

    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.markov_w1 = _embedding(cfg.vocab_size, cfg.markov_rank)   # input: target-vocab id
        self.markov_w2 = Linear(cfg.markov_rank, cfg.out_vocab)
        self.gate_proj = (Linear(cfg.hidden_size + cfg.markov_rank, cfg.markov_rank, bias=True)
                          if cfg.markov_head_type == "gated" else None)

    def prev_embedding(self, prev: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(prev)

    def bias(self, prev_emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        if self.gate_proj is not None:
            prev_emb = torch.sigmoid(self.gate_proj(torch.cat([hidden, prev_emb], -1))) * prev_emb
        return self.markov_w2(prev_emb)


class ConfidenceHead(nn.Module):
    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.with_markov = cfg.confidence_head_with_markov
        self.proj = Linear(cfg.hidden_size + (cfg.markov_rank if self.with_markov else 0), 1, bias=True)

    def forward(self, hidden: torch.Tensor, prev_emb: torch.Tensor) -> torch.Tensor:
        """P(slot accepted | prefix accepted), in [0, 1]."""
        x = torch.cat([hidden, prev_emb], -1) if self.with_markov else hidden
        return torch.sigmoid(self.proj(x).squeeze(-1).float())


class TapNorm(nn.Module):
    """An RMSNorm per tap over taps side by side [T, n * d]: weight [n, d], one row per tap."""

    def __init__(self, n_taps: int, hidden: int, eps: float):
        super().__init__()
        self.n, self.d, self.eps = n_taps, hidden, eps
        self.weight = nn.Parameter(torch.ones(n_taps, hidden))

    def forward(self, taps: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.rms_norm(taps.reshape(-1, self.n, self.d), (self.d,), None, self.eps)
        return (x * self.weight).view(taps.shape)


class DSparkDraft(nn.Module):
    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.config = cfg
        n_taps = len(cfg.target_layer_ids)
        self.embed_tokens = _embedding(cfg.vocab_size, cfg.hidden_size)
        self.tap_norm = TapNorm(n_taps, cfg.hidden_size, cfg.rms_norm_eps) if cfg.tap_norm else None
        self.fc = Linear(n_taps * cfg.hidden_size, cfg.hidden_size)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # EAGLE-style fusion: the block rows start from their embedding plus this projection of
        # the context row before the anchor (the newest target feature the draft has)
        self.fuse_proj = Linear(cfg.hidden_size, cfg.hidden_size) if cfg.prev_context_fusion else None
        self.layers = nn.ModuleList(DSparkLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.out_vocab)
        # Reduced draft vocab: draft id i is target id i + d2t[i] (EAGLE-3 / vLLM convention).
        # The draft then scores a few thousand likely tokens instead of the whole vocab.
        self.register_buffer("d2t", torch.zeros(cfg.out_vocab, dtype=torch.long)
                             if cfg.draft_vocab_size else None)
        self.markov_head = MarkovHead(cfg)
        self.confidence_head = ConfidenceHead(cfg) if cfg.enable_confidence_head else None
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.rope_scaling)
        self.native: NativeDraftStep | None = None
        self.activation_quant = "none"
        # modules that are the target's (load_weights), or whole copies of its vocab-split ones
        self.shared_with_target: set[str] = set()

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]

    def to_target_probs(self, q: torch.Tensor) -> torch.Tensor:
        """[..., draft vocab] probabilities -> [..., target vocab] (zero outside the draft vocab)."""
        if self.d2t is None:
            return q
        out = q.new_zeros(*q.shape[:-1], self.config.vocab_size)
        out[..., self.to_target_ids(torch.arange(q.shape[-1]))] = q
        return out

    def new_kv_pool(self, num_slots: int, dtype: torch.dtype = torch.float32, block_rows: int = 0) -> KVPool:
        """The draft's pool at the target's slots 1..num_slots, plus `block_rows` rows after them
        that no allocator hands out (where the native step keeps the blocks' own K/V); with
        prev_context_fusion also each slot's fused context row (DraftKVPool). `dtype`: the
        target's --kv-cache-dtype where it is int8 / fp8 (K/V quantized with their block scales, as
        the target's; the fused context rows stay float32)."""
        c = self.config
        if c.prev_context_fusion:
            return DraftKVPool(num_slots + block_rows, c.num_hidden_layers, c.num_key_value_heads, c.head_dim,
                               c.hidden_size, dtype)
        return KVPool(num_slots + block_rows, c.num_hidden_layers, c.num_key_value_heads, c.head_dim, dtype)

    # ---- KV injection -----------------------------------------------------------------------
    def normed_taps(self, taps: torch.Tensor) -> torch.Tensor:
        """Taps side by side [T, n * d], each RMS-normed when the draft has tap_norm."""
        return taps if self.tap_norm is None else self.tap_norm(taps)

    def context_hidden(self, taps: list[torch.Tensor]) -> torch.Tensor:
        """Fuse the tapped target hidden rows [T, d] each (or one [T, n * d] of them side by
        side) -> [T, d] draft context."""
        return self.hidden_norm(self.fc(self.normed_taps(torch.cat(taps, dim=-1))))

    def fused_rows(self, x: torch.Tensor, prev_ctx: torch.Tensor) -> torch.Tensor:
        """Block rows [B, G, d] plus fuse_proj of each block's context row before its anchor
        [B, d] (prev_context_fusion); x itself otherwise."""
        if self.fuse_proj is None:
            return x
        return x + self.fuse_proj(prev_ctx)[:, None, :]

    def inject(self, taps: list[torch.Tensor], positions: torch.Tensor, slots: torch.Tensor,
               pool: KVPool) -> None:
        """Write the context K/V of target tokens at `positions` into `pool` at `slots` (and,
        with prev_context_fusion, their context rows)."""
        ctx = None
        if self.fuse_proj is not None:
            ctx = self.context_hidden(taps)
            pool.context[slots] = ctx.to(pool.context.dtype)
        if self.native is not None and taps[0].dtype == torch.float32 and self.native.ready(self):
            self.native.inject(self.normed_taps(torch.cat(taps, dim=-1)).contiguous(), positions, slots, pool)
            return
        ctx = self.context_hidden(taps) if ctx is None else ctx
        cos_sin = self.rotary.cos_sin(positions)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.kv(ctx, cos_sin)
            write_rows(pool, i, slots, k, v)

    def set_activation_quant(self, mode: str) -> None:
        """"int8": the draft's own projections (backbone, fc, a reduced-vocab LM head) run as the
        target's do under --activation-quant int8 — int8 activations on Q8_0 blocks made from their
        weights, which then take the Q8_0 values (or go, where int8 takes every row count), so the
        Python path and the native block pass compute one draft. Proposals change slightly;
        verification keeps the output exact. The heads' small matrices (Markov, confidence) and
        modules shared with the target keep theirs."""
        if mode not in ACTIVATION_QUANTS:
            raise ValueError(f"activation_quant {mode!r}: use one of {', '.join(ACTIVATION_QUANTS)}")
        self.activation_quant = mode
        if mode != "int8":
            return
        own = [self.fc, *([] if "lm_head" in self.shared_with_target else [self.lm_head]),
               *([] if self.fuse_proj is None else [self.fuse_proj])]
        for layer in self.layers:
            attn = layer.self_attn
            own += [attn.q_proj, attn.kv_proj, attn.o_proj, layer.gate_up_proj, layer.down_proj]
        for lin in own:
            if lin.in_features % 32 == 0 and lin.activation_quant != "int8":
                blocks = BlockWeight.q8_0(lin.weight)
                lin.weight.data.copy_(blocks.dequantize())
                lin.set_blocks(blocks)
                lin.set_activation_quant("int8")

    # ---- one parallel block pass ------------------------------------------------------------
    def enable_native_step(self, on: bool) -> None:
        """Run the block pass as one native call where it can (models/dspark_native.py)."""
        self.native = NativeDraftStep() if on else None

    def block_hidden(self, anchors: torch.Tensor, anchor_pos: torch.Tensor, kv_indices: torch.Tensor,
                     ctx_lens: list[int], pool: KVPool,
                     block_slots: torch.Tensor | None = None) -> torch.Tensor:
        """Normed hidden states [B, G, d] of the block [anchor, mask x (G-1)] at positions
        anchor_pos.. for B requests whose injected context is kv_indices[b, :ctx_lens[b]].
        Positions at the pad slot 0 are masked out: padding, and pages a sliding-window target
        gave up (slot 0 never holds a real token). `block_slots`: pool rows no request uses, where
        the native step may keep the blocks' own K/V (None: the Python path)."""
        B, G = anchors.shape[0], self.block_size
        ids = torch.full((B, G), self.config.mask_token_id, dtype=torch.long)
        ids[:, 0] = anchors
        x = self.embed_tokens(ids).view(B, G, -1)
        if self.fuse_proj is not None:     # each request's last context row: position anchor - 1
            n = torch.tensor(ctx_lens)
            last = kv_indices[torch.arange(B), (n - 1).clamp_min(0)] * (n > 0)
            x = self.fused_rows(x, pool.context[last].to(x.dtype))
        x = x.reshape(B * G, -1)
        pos = (anchor_pos[:, None] + torch.arange(G)[None, :]).view(-1)
        self.rotary.cover(int(anchor_pos.max()) + G)
        if self.native is not None and self.native.applies(self, kv_indices, ctx_lens, block_slots):
            out = self.native.block_hidden(self, x, pos, kv_indices, ctx_lens, pool, block_slots)
            return out.view(B, G, -1)
        cos_sin = self.rotary.cos_sin(pos)
        L = kv_indices.shape[1]
        ctx_ok = (torch.arange(L)[None, :] < torch.tensor(ctx_lens)[:, None]) & (kv_indices != 0)  # [B, L]
        mask = None
        if not bool(ctx_ok.all()):
            mask = torch.cat([ctx_ok, torch.ones(B, G, dtype=torch.bool)], 1)[:, None, None, :]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos_sin, *read_rows(pool, i, kv_indices), mask, B)
        return self.norm(x).view(B, G, -1)

    # ---- loading ----------------------------------------------------------------------------
    _renames = {".k_proj.": (".kv_proj.", "k"), ".v_proj.": (".kv_proj.", "v"),
                ".mlp.gate_proj.": (".gate_up_proj.", "gate"), ".mlp.up_proj.": (".gate_up_proj.", "up")}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     target: CausalLM | None = None) -> None:
        """DeepSpec names (no prefix; `model.` tolerated). embed_tokens / lm_head may be absent:
        then they are shared with the target's, or copied in full when the target keeps only its
        vocab slice of them (tensor parallel: `target_vocab_weights`)."""
        loader = WeightLoader(self, self._renames, "DSpark checkpoint")
        has_d2t = False
        for name, t in weights:
            name = name.removeprefix("model.").replace(".mlp.down_proj.", ".down_proj.")
            if name == "d2t":
                if self.d2t is None or t.shape != self.d2t.shape:
                    raise ValueError(f"d2t {tuple(t.shape)} does not match draft_vocab_size "
                                     f"{self.config.draft_vocab_size}")
                self.d2t.copy_(t)
                has_d2t = True
                continue
            loader.load(name, t)
        if self.d2t is not None and not has_d2t:
            raise ValueError("DSpark checkpoint sets draft_vocab_size but has no d2t tensor")
        full: dict[str, torch.Tensor] = {}
        for shared in ("embed_tokens", "lm_head"):
            if f"{shared}.weight" not in loader.loaded:
                if target is None:
                    raise ValueError(f"DSpark checkpoint lacks {shared}.weight and no target to share "
                                     "it from")
                if shared == "lm_head" and self.d2t is not None:
                    raise ValueError("a reduced-vocab DSpark checkpoint must contain lm_head.weight")
                if target.vocab_sharded:
                    full = full or target_vocab_weights(target)
                    loader.load(f"{shared}.weight", full[f"{shared}.weight"])
                    self.shared_with_target.add(shared)
                    continue
                src = target.model.embed_tokens if shared == "embed_tokens" else target.lm_head
                own = getattr(self, shared).weight
                if src.weight.shape != own.shape:
                    raise ValueError(f"{shared}: target shape {tuple(src.weight.shape)} != draft "
                                     f"{tuple(own.shape)}")
                setattr(self, shared, src)        # share the module (and its packed weight)
                self.shared_with_target.add(shared)
                loader.mark_loaded(f"{shared}.weight")
        loader.check_complete()


def load_dspark_draft(path: str, target: CausalLM | None = None, activation_quant: str = "none",
                      huge_pages: bool = False) -> DSparkDraft:
    """On the target's device; off the CPU with fp32 weights and torch's kernels, as the target.
    `huge_pages`: hold the draft's own CPU weights in 2 MiB pages, as load_model the target's."""
    from sparkserve.layers.linear import pack_linears
    from sparkserve.loader.hf import hf_weights
    with open(os.path.join(path, "config.json")) as f:
        cfg = DSparkConfig.from_dict(json.load(f))
    _check_against_target(cfg, target)
    with torch.device("meta"):
        draft = DSparkDraft(cfg)
    draft = draft.to_empty(device="cpu")
    draft.rotary.build()
    draft.load_weights(hf_weights(path), target)
    draft.eval().requires_grad_(False)
    device = torch.device("cpu") if target is None else target.device
    if device.type != "cpu":
        return draft.to(device)
    draft.set_activation_quant(activation_quant)
    pack_linears(draft)
    if huge_pages:
        own = (m for name, m in draft.named_children() if name not in draft.shared_with_target)
        hold_weights_in_huge_pages(*own)
    release_freed_memory()
    return draft


def _check_against_target(cfg: DSparkConfig, target: CausalLM | None) -> None:
    if target is None:
        return
    t = target.config
    if cfg.vocab_size != t.vocab_size:
        raise ValueError(f"draft vocab_size {cfg.vocab_size} != target vocab_size {t.vocab_size}")
    if cfg.hidden_size != t.hidden_size:
        raise ValueError(f"draft hidden_size {cfg.hidden_size} != target hidden_size {t.hidden_size}")
    target.set_aux_layers(cfg.target_layer_ids)   # validates the ids against the target


def dspark_config_dict(target_cfg, num_layers: int = 1, block_size: int = 7,
                       target_layer_ids: list[int] | None = None, mask_token_id: int = 0,
                       markov_rank: int = 64, markov_head_type: str = "vanilla",
                       enable_confidence_head: bool = True,
                       draft_vocab_size: int | None = None, kv_heads: int | None = None,
                       tap_norm: bool = False, prev_context_fusion: bool = False) -> dict[str, Any]:
    """A DeepSpec-format config.json for a draft of `target_cfg` (a ModelConfig). `kv_heads`: the
    draft's KV heads, the width of its context read (default: the target's); tap_norm /
    prev_context_fusion: sparkserve's options, written only when on (DeepSpec's format otherwise)."""
    n = target_cfg.num_hidden_layers
    taps = target_layer_ids or (sorted({1, n // 2, n - 2}) if n > 2 else [0])
    return {
        "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3",
        "hidden_size": target_cfg.hidden_size, "intermediate_size": target_cfg.intermediate_size,
        "num_hidden_layers": num_layers, "num_target_layers": n,
        "num_attention_heads": target_cfg.num_attention_heads,
        "num_key_value_heads": kv_heads or target_cfg.num_key_value_heads, "head_dim": target_cfg.head_dim,
        "vocab_size": target_cfg.vocab_size, "rms_norm_eps": target_cfg.rms_norm_eps,
        "rope_theta": target_cfg.rope_theta, "rope_scaling": target_cfg.rope_scaling,
        "max_position_embeddings": target_cfg.max_position_embeddings,
        "block_size": block_size, "target_layer_ids": taps, "mask_token_id": mask_token_id,
        "num_anchors": 512, "markov_rank": markov_rank, "markov_head_type": markov_head_type,
        "enable_confidence_head": enable_confidence_head, "confidence_head_with_markov": True,
        "tie_word_embeddings": False, "layer_types": ["full_attention"] * num_layers,
        **({"draft_vocab_size": draft_vocab_size} if draft_vocab_size else {}),
        **({"tap_norm": True} if tap_norm else {}),
        **({"prev_context_fusion": True} if prev_context_fusion else {}),
    }


def init_dspark_draft(config: dict[str, Any], target: CausalLM | None = None, seed: int = 0,
                      std: float = 0.02, vocab: torch.Tensor | list[int] | None = None) -> DSparkDraft:
    """A randomly initialised draft (embedding and LM head copied from the target if given);
    `vocab`: the target ids of a reduced draft vocab (config draft_vocab_size = len(vocab))."""
    g = torch.Generator().manual_seed(seed)
    draft = DSparkDraft(DSparkConfig.from_dict(config))
    for name, p in draft.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        elif name.startswith("fuse_proj."):
            p.data.zero_()          # the fused draft starts as the plain one; training grows the fusion
        elif name.endswith("bias"):
            p.data.zero_()
        elif name == "markov_head.markov_w1.weight":
            # unit-scale token codes (nn.Embedding's own init): with both Markov factors tiny
            # the bias W2 W1[x] starts at a saddle and learns slowly
            p.data.copy_(torch.randn(p.shape, generator=g))
        else:
            p.data.copy_(torch.randn(p.shape, generator=g) * std)
    # The block's residual stream starts as the anchor's embedding; through a (often tied)
    # embedding / LM head pair a unit-scale final norm makes the untrained draft echo the anchor
    # with logits ~60 above the rest (SmolLM2: initial CE ~61 nats). A small norm starts it near
    # uniform, where the gradients are useful.
    draft.norm.weight.data.fill_(0.03)
    if vocab is not None:
        vocab = torch.as_tensor(vocab, dtype=torch.long).sort().values
        if draft.d2t is None or len(vocab) != len(draft.d2t):
            raise ValueError(f"draft vocab of {len(vocab)} ids needs draft_vocab_size={len(vocab)} in the "
                             f"config")
        draft.d2t.copy_(vocab - torch.arange(len(vocab)))
    if target is not None:
        full = target_vocab_weights(target)
        draft.embed_tokens.weight.data.copy_(full["embed_tokens.weight"])
        rows = draft.to_target_ids(torch.arange(draft.config.out_vocab))
        draft.lm_head.weight.data.copy_(full["lm_head.weight"][rows])
    return draft


def target_vocab_weights(target: CausalLM) -> dict[str, torch.Tensor]:
    """The target's whole embedding and LM head weights ("embed_tokens.weight", "lm_head.weight").
    Under tensor parallelism the target keeps only its vocab slice of them (layers/vocab_parallel.py),
    so they are read from its checkpoint, just those tensors: the driver (where the draft runs)
    holds a full copy of them only when a draft needs one."""
    if not target.vocab_sharded:
        return {"embed_tokens.weight": target.model.embed_tokens.dense_weight(),
                "lm_head.weight": target.lm_head.dense_weight()}
    from sparkserve.models.registry import checkpoint_weights
    got = {name: values_of(t) for name, t in checkpoint_weights(
        target.checkpoint_path, target.config, {"model.embed_tokens.weight", "lm_head.weight"},
        target.checkpoint_for_int8)}
    embed = got["model.embed_tokens.weight"]
    head = embed if target.config.tie_word_embeddings else got["lm_head.weight"]
    return {"embed_tokens.weight": embed, "lm_head.weight": head}


def save_dspark_draft(draft: DSparkDraft, path: str, include_shared: bool = False,
                      dtype: torch.dtype | None = None) -> None:
    """Write DeepSpec's layout: config.json + model.safetensors (k/v and gate/up unfused).
    Without include_shared, embed_tokens / lm_head are left out (served from the target).
    `dtype` casts the floating-point tensors (fp16 for shipping; loading upcasts to fp32)."""
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    out: dict[str, torch.Tensor] = {}
    for name, mod in draft.named_modules():
        if isinstance(mod, FusedLinear):
            parent = name.rsplit(".", 1)[0]
            for shard, (start, size) in mod.shard_offsets.items():
                key = {"k": f"{parent}.k_proj", "v": f"{parent}.v_proj", "gate": f"{parent}.mlp.gate_proj",
                       "up": f"{parent}.mlp.up_proj"}[shard]
                out[f"{key}.weight"] = mod.weight[start:start + size]
                if mod.bias is not None:
                    out[f"{key}.bias"] = mod.bias[start:start + size]
    for name, p in draft.named_parameters():
        if ".kv_proj." in name or ".gate_up_proj." in name:
            continue
        shared = ("embed_tokens",) if draft.d2t is not None else ("embed_tokens", "lm_head")
        if not include_shared and name.split(".")[0] in shared:
            continue
        out[name.replace(".down_proj.", ".mlp.down_proj.")] = p
    if draft.d2t is not None:
        out["d2t"] = draft.d2t
    cast = lambda t: t.to(dtype) if dtype is not None and t.is_floating_point() else t
    save_file({k: cast(v.detach()).contiguous().clone() for k, v in out.items()},
              os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(draft.config.raw, f, indent=1)
