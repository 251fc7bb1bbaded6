"""Torch reference of the int8-activation kernels (int8_*.cpp), for tests and benchmarks.

x rows are quantized per block of 32 exactly as the kernels do (all in fp32: d = amax / 127,
q = round-half-even(x * (127 / amax)), s = d * sum(q)); the integer block dots are exact (float64
of integers), and y sums the block terms d_w * d_x * dot (+ m_w * s for Q4_1) in float64."""
from __future__ import annotations

import torch

from sparkserve.kernels.blocks import BLOCK_BYTES, Q4_0, Q4_1, Q6_S, Q8_0, BlockWeight, q6_s_ints


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] fp32 -> q [M, K/32, 32] (integer-valued fp32), d [M, K/32], s [M, K/32]."""
    m, k = x.shape
    xb = x.float().reshape(m, k // 32, 32)
    amax = xb.abs().amax(-1)
    d = amax / 127
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv[..., None])
    return q, d, d * q.sum(-1)


def _weight_ints(w: BlockWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Integer weights [N, K/32, 32], d [N, K/32] and (Q4_1) m [N, K/32], as fp32."""
    n, k = w.shape
    b = w.blocks.view(n, k // 32, BLOCK_BYTES[w.qtype])
    d = b[..., 0:2].contiguous().view(torch.float16).float()[..., 0]
    if w.qtype == Q8_0:
        return b[..., 2:].contiguous().view(torch.int8).float(), d, None
    if w.qtype == Q4_0:
        qs = b[..., 2:]
        return torch.cat([qs & 0x0F, qs >> 4], dim=-1).float() - 8, d, None
    if w.qtype == Q6_S:              # scale * (u - 32): integers, the kernels' int32 sum
        u, scale = q6_s_ints(b)
        return (scale.long() * (u.long() - 32)).float(), d, None
    if w.qtype != Q4_1:
        raise ValueError("int8 activations cover Q4_0, Q4_1, Q8_0 and Q6_S weights only")
    qs = b[..., 4:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()
    return q, d, b[..., 2:4].contiguous().view(torch.float16).float()[..., 0]


def block_terms(x: torch.Tensor, w: BlockWeight) -> torch.Tensor:
    """The per-block terms [M, N, K/32] (float64) whose sum over blocks is y without bias."""
    q, d, s = quantize_rows(x)
    wq, wd, wm = _weight_ints(w)
    dots = torch.einsum("mbk,nbk->mnb", q.double(), wq.double())     # exact integers
    terms = wd.double()[None] * d.double()[:, None] * dots
    if wm is not None:
        terms = terms + wm.double()[None] * s.double()[:, None]
    return terms


def linear_int8(x: torch.Tensor, w: BlockWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] float64 = the int8-activation product (+ bias)."""
    y = block_terms(x, w).sum(-1)
    return y if bias is None else y + bias.double()
