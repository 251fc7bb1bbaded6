"""Quantized KV pools (--kv-cache-dtype int8 | fp8_e4m3 | fp8_e5m2): each head's row of K or V is
cut into blocks of 32 values (a head dim that is not a multiple of 32: one block per row), each
stored as its elements in the pool's dtype with one float16 scale per block, as llama.cpp's q8_0
cache (`d = amax / qmax`, `x ~ d * q`). The scales are pool buffers of their own ([slots, kv heads,
blocks]); attention dequantizes only the rows it reads (kernels/decode_tile.h, prefill_tile.h, the
torch path's gather).

The rounding here is the one the native step's C++ store does (kernels/kv_quant.h): the scale is
rounded to float16 first and the values divided by the rounded scale, int8 rounded half to even
and clamped to +-127, fp8 clamped to its largest finite value, so both paths hold the same bytes.
A dequantized value (an fp16 scale times an int8 or fp8 element) is exact in float32."""
from __future__ import annotations

import torch

QUANT_BLOCK = 32

# --kv-cache-dtype names of the quantized pools and what their elements are stored as
QUANT_KV_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# what a block's amax maps onto: the largest int8 / e4m3 value; e5m2's largest (57344) would push
# the float16 scales of blocks below ~4e-3 under float16's range, and its precision is the same at
# 448 (values stay normal down to 448 * 2^-23 of the block's amax)
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 448.0}
SCALE_DTYPE = torch.float16


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in _QMAX


def kv_dtype(name: str) -> torch.dtype:
    """A --kv-cache-dtype value (other than auto) as the dtype the pool's K/V buffers hold."""
    return QUANT_KV_DTYPES.get(name) or getattr(torch, name)


def kv_dtype_name(dtype: torch.dtype) -> str:
    """The --kv-cache-dtype name of a pool dtype."""
    return next((n for n, d in QUANT_KV_DTYPES.items() if d == dtype), str(dtype).removeprefix("torch."))


def block_size(head_dim: int) -> int:
    """Values per scale: 32, or the whole row where the head dim is not a multiple of 32."""
    return QUANT_BLOCK if head_dim % QUANT_BLOCK == 0 else head_dim


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] float rows -> (elements [..., D] of `dtype`, float16 scales [..., D / block])."""
    D = x.shape[-1]
    qb = block_size(D)
    xb = x.float().reshape(*x.shape[:-1], D // qb, qb)
    qmax = _QMAX[dtype]
    d = (xb.abs().amax(-1) / qmax).to(SCALE_DTYPE)
    df = d.float().unsqueeze(-1)
    y = torch.where(df > 0, xb / df, torch.zeros((), dtype=torch.float32))
    if dtype == torch.int8:
        q = y.round().clamp(-127, 127).to(torch.int8)
    else:
        q = y.clamp(-qmax, qmax).to(dtype)
    return q.reshape(x.shape), d


def dequantize(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """quantize's inverse for rows read out of a pool: [..., D] elements, [..., D / block] scales."""
    D = q.shape[-1]
    qb = block_size(D)
    x = q.float().reshape(*q.shape[:-1], D // qb, qb) * scales.float().unsqueeze(-1)
    return x.reshape(q.shape).to(dtype)


def scale_component(name: str, dtype: torch.dtype) -> str:
    """A scale buffer's component name: it carries the pool's format, so two sides of a transfer
    whose quantized pools differ (int8 vs fp8, or one side not quantized) hold different components
    (mem/transfer.py check_shapes names both formats)."""
    return f"{name}_scale_{kv_dtype_name(dtype)}"


def format_of(component: str) -> str | None:
    """The --kv-cache-dtype a scale component's name carries, None for other components."""
    _, sep, fmt = component.partition("_scale_")
    return fmt if sep else None
