"""C++ CPU kernels for batch-1 / small-batch inference.

`quant_linear(x, w, bias)` computes `x @ W.T (+ bias)` in fp32 from a `BlockWeight` (Q4_1, Q8_0,
BF16, F16), reading the blocks once for all rows of x (quant_gemv.cpp; used by layers/linear.py).
The extension also has `rms_norm` and `add_rms_norm` (rms_norm.cpp; used by layers/norm.py) and
`decode_attention` (decode_attention.cpp: paged attention without the K/V gather; layers/attention.py).
Built on first use (build.py); when that is impossible `load_extension()` is None and callers
use their torch path (F.linear / oneDNN on the fp32 weight, F.rms_norm)."""
from __future__ import annotations

import torch

from sparkserve.kernels.blocks import BF16, BLOCK_BYTES, F16, Q4_1, Q8_0, BlockWeight
from sparkserve.kernels.build import load_extension

__all__ = ["BlockWeight", "Q4_1", "Q8_0", "BF16", "F16", "BLOCK_BYTES", "available", "load_extension",
           "quant_linear"]


def available() -> bool:
    return load_extension() is not None


def quant_linear(x: torch.Tensor, w: BlockWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float32 -> [M, N] float32. Raises if the kernels are unavailable."""
    ext = load_extension()
    if ext is None:
        raise RuntimeError("sparkserve kernels are unavailable (see the warning logged at first use)")
    return ext.quant_linear(x, w.blocks, w.qtype, bias)
