"""The DSpark draft's settings, read from its checkpoint's config.json (DeepSpec's format, the
speculators layout, and sparkserve's architecture options, which DeepSpec's configs lack: off)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class DSparkConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    block_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    markov_rank: int
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    attention_bias: bool = False
    sample_from_anchor: bool = False      # speculators-format exports: slot j predicts anchor+j
    rope_scaling: dict | None = None
    draft_vocab_size: int | None = None   # reduced draft vocab (vLLM's d2t convention); None = full
    # sparkserve's architecture options (absent from DeepSpec's configs: off), docs/design.md
    tap_norm: bool = False                # an RMSNorm per tap before fc (taps enter at RMS ~3 to ~30)
    prev_context_fusion: bool = False     # fuse_proj(context row at anchor - 1) added to every block row
    raw: dict | None = None

    @property
    def out_vocab(self) -> int:
        return self.draft_vocab_size or self.vocab_size

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DSparkConfig":
        if d.get("speculators_model_type") == "dspark":      # speculators layout
            inner = dict(d.get("transformer_layer_config") or {})
            inner.update({k: v for k, v in d.items() if k != "transformer_layer_config"})
            inner.setdefault("target_layer_ids", d.get("aux_hidden_state_layer_ids"))
            d = inner
        missing = [k for k in ("block_size", "target_layer_ids", "mask_token_id", "markov_rank")
                   if d.get(k) is None]
        if missing:
            raise ValueError(f"DSpark draft config lacks {missing} (is this a DeepSpec DSpark checkpoint?)")
        heads = d["num_attention_heads"]
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        kind = str(d.get("markov_head_type", "vanilla")).lower()
        if kind not in ("vanilla", "gated"):
            raise ValueError(f"markov_head_type {kind!r} is not supported (vanilla, gated)")
        if int(d["markov_rank"]) <= 0:
            raise ValueError(f"DSpark needs markov_rank > 0, got {d['markov_rank']}")
        kv_heads = d.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ValueError(f"num_key_value_heads {kv_heads} must divide num_attention_heads {heads}")
        return cls(
            hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads, vocab_size=d["vocab_size"],
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(d.get("rope_theta", rope.get("rope_theta", 10000.0))),
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            block_size=int(d["block_size"]), target_layer_ids=list(d["target_layer_ids"]),
            mask_token_id=int(d["mask_token_id"]), markov_rank=int(d["markov_rank"]),
            markov_head_type=kind,
            enable_confidence_head=bool(d.get("enable_confidence_head", True)),
            confidence_head_with_markov=bool(d.get("confidence_head_with_markov", True)),
            attention_bias=bool(d.get("attention_bias", False)),
            sample_from_anchor=bool(d.get("sample_from_anchor", False)),
            draft_vocab_size=(int(d["draft_vocab_size"]) if d.get("draft_vocab_size") not in
                              (None, d["vocab_size"]) else None),
            tap_norm=bool(d.get("tap_norm", False)),
            prev_context_fusion=bool(d.get("prev_context_fusion", False)),
            rope_scaling=(dict(rope) if rope.get("rope_type", rope.get("type", "default")) != "default"
                          else None), raw=d)
