"""Rotary position embedding (neox / HF `rotate_half` layout) with a precomputed cos/sin table
indexed by absolute positions, so a flat batch of mixed requests needs one gather."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None, context: int = 0) -> torch.Tensor:
    """Inverse frequencies over `head_dim` rotated channels; `context`: the longest sequence served
    (LongRoPE picks its factors by it)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "longrope":
        long = context > scaling["original_max_position_embeddings"]
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float64)
        if factors.numel() != inv.numel():
            raise ValueError(f"rope_scaling: {factors.numel()} LongRoPE factors for {inv.numel()} "
                             "frequencies")
        return inv / factors
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        mid = (1 - smooth) * inv / factor + smooth * inv
        is_mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        return torch.where(is_mid, mid, scaled)
    if kind == "freq_factors":   # per-frequency divisors: a GGUF file's rope_freqs tensor (loader/gguf.py)
        return inv / torch.tensor(scaling["factors"], dtype=torch.float64)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")


ROPE_TYPES = ("default", "linear", "llama3", "longrope")


def _attention_factor(scaling: dict[str, Any] | None, context: int) -> float:
    """What LongRoPE scales cos and sin by: its `attention_factor`, else sqrt(1 + ln s / ln L) for
    the extension s = factor (or context / L) over the pre-training length L (as transformers)."""
    if not scaling or scaling.get("rope_type") != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or context / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None = None):
        """`head_dim`: the channels it turns; `max_positions`: the context served (fixed here:
        LongRoPE's choice of factors does not change as `cover` grows the tables)."""
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        self.context = max_positions
        self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)
        if not self.cos.is_meta:
            self.build()

    def build(self) -> None:
        """Fill the tables (again after a meta-device construction left them empty)."""
        inv = _inv_freq(self.head_dim, self.theta, self.scaling, self.context).float()
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32), inv)
        scale = _attention_factor(self.scaling, self.context)
        # sin with rotate_half's sign folded in: x*cos + roll(x, half)*sin_signed == HF's formula.
        self.cos = torch.cat([freqs, freqs], dim=-1).cos() * scale
        self.sin = torch.cat([-freqs.sin(), freqs.sin()], dim=-1) * scale

    def cover(self, positions: int) -> None:
        """Grow the tables to hold positions 0..positions-1 (a DSpark block's mask slots may run
        past the model's context end: never verified, but they shape the block)."""
        if positions > self.max_positions:
            self.max_positions = positions
            self.build()

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] positions -> cos, sin of shape [T, 1, head_dim] (broadcast over heads)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; sin is sign-folded (see RotaryEmbedding.build)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Partial RoPE: rotate the first cos.shape[-1] channels of x [T, heads, D] (neox layout),
    pass the rest through unchanged."""
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return apply_rotary(x, cos, sin)
    return torch.cat([apply_rotary(x[..., :rd], cos, sin), x[..., rd:]], dim=-1)
