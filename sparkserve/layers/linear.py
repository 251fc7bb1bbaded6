"""Linear layers that own how checkpoint tensors load into them. Fused projections (q|k|v,
gate|up) cut the number of GEMV calls per decode step, which bounds CPU decode speed."""
from __future__ import annotations

import torch
from torch import nn


class FusedLinear(nn.Module):
    """One weight holding several stacked projections; `load(shard, w)` fills one of them."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False):
        super().__init__()
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        off = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (off, size)
            off += size
        self.weight = nn.Parameter(torch.empty(off, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(off), requires_grad=False) if bias else None

    def load(self, shard: str, tensor: torch.Tensor, kind: str = "weight") -> None:
        start, size = self.shard_offsets[shard]
        target = self.weight if kind == "weight" else self.bias
        if tensor.shape[0] != size:
            raise ValueError(f"shard {shard} {kind}: expected {size} rows, got {tuple(tensor.shape)}")
        target.data[start:start + size].copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight, self.bias)
