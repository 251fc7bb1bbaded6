"""Rotary position embedding (neox / HF `rotate_half` layout) with a precomputed cos/sin table
indexed by absolute positions, so a flat batch of mixed requests needs one gather."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None, context: int = 0) -> torch.Tensor:
    """Inverse frequencies over `head_dim` rotated channels under an HF-style `rope_scaling`
    (config.py fills the pre-training length and factor where configs leave them out); `context`:
    the longest sequence served, by which LongRoPE picks its factors and dynamic NTK its base."""
    kind = scaling.get("rope_type", scaling.get("type")) if scaling else "default"
    if kind not in _SCALINGS:
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    return _SCALINGS[kind](_plain(head_dim, theta), scaling, head_dim, theta, context)


def _plain(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))


def _longrope(inv, s, head_dim, theta, context):
    long = context > s["original_max_position_embeddings"]
    factors = torch.tensor(s["long_factor" if long else "short_factor"], dtype=torch.float64)
    if factors.numel() != inv.numel():
        raise ValueError(f"rope_scaling: {factors.numel()} LongRoPE factors for {inv.numel()} frequencies")
    return inv / factors


def _llama3(inv, s, head_dim, theta, context):
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_ctx = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    smooth = (old_ctx / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    mid = (1 - smooth) * inv / factor + smooth * inv
    is_mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
    return torch.where(is_mid, mid, scaled)


def _yarn(inv, s, head_dim, theta, context):
    """NTK-by-parts: interpolated (/ factor) below the low-rotation bound, extrapolated (as they
    are) above the high one, a linear ramp between (beta_fast / beta_slow rotations)."""
    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(s["original_max_position_embeddings"] / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))
    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / ((high - low) or 0.001)).clamp(0, 1)
    return inv / s["factor"] * ramp + inv * (1 - ramp)


def _dynamic(inv, s, head_dim, theta, context):
    """Dynamic NTK at the served context: the base grows once it runs past the pre-training length."""
    original, factor = s["original_max_position_embeddings"], s["factor"]
    if context <= original:
        return inv
    base = theta * ((factor * context / original) - (factor - 1)) ** (head_dim / (head_dim - 2))
    return _plain(head_dim, base)


_SCALINGS = {
    "default": lambda inv, s, d, theta, context: inv,
    "linear": lambda inv, s, d, theta, context: inv / s["factor"],
    "llama3": _llama3,
    "yarn": _yarn,
    "longrope": _longrope,
    "dynamic": _dynamic,
    # per-frequency divisors: a GGUF file's rope_freqs tensor (loader/gguf.py)
    "freq_factors": lambda inv, s, d, theta, context: inv / torch.tensor(s["factors"], dtype=torch.float64),
}
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")


def _attention_factor(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are scaled by: a scaling's `attention_factor`, else LongRoPE's
    sqrt(1 + ln s / ln L) and YaRN's 0.1 ln s + 1 (DeepSeek: the ratio of two such, mscale and
    mscale_all_dim) for the extension s = factor over the pre-training length L (as transformers)."""
    kind = scaling.get("rope_type") if scaling else None
    if kind not in ("longrope", "yarn"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling["factor"]
    if factor <= 1.0:
        return 1.0
    if kind == "longrope":
        return math.sqrt(1 + math.log(factor) / math.log(scaling["original_max_position_embeddings"]))
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all:
        return (0.1 * mscale * math.log(factor) + 1) / (0.1 * mscale_all * math.log(factor) + 1)
    return 0.1 * math.log(factor) + 1.0


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
        scale = _attention_factor(self.scaling)
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
