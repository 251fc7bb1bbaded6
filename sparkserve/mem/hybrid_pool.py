"""HybridPool: named per-layer buffers of two kinds, for models whose layers keep different
things — full-attention KV and sparse index K/V per token (`token_page`), linear-attention
recurrent and conv state per request (`request_row`). Layers fetch their buffers by name;
transfer, retraction and rollback code walks `components()` (docs/design.md, contract 3)."""
from __future__ import annotations

import math

import torch

from sparkserve.core.pool import POOL_KINDS, Pool, PoolComponent, Split
from sparkserve.mem.heap import lazy_zeros


class HybridPool(Pool):
    def __init__(self, num_slots: int, num_rows: int):
        self.num_slots = num_slots
        self.num_rows = num_rows
        self._buffers: dict[str, dict[int, torch.Tensor]] = {}
        self._kinds: dict[str, str] = {}
        self._splits: dict[str, Split | None] = {}

    def add(self, name: str, kind: str, layer_ids: list[int], item_shape: tuple[int, ...],
            dtype: torch.dtype = torch.float32, split: Split | None = None) -> None:
        """One buffer per layer: [num_slots + 1, *item_shape] for token kinds (slot 0 is the
        padding dummy), [num_rows, *item_shape] for request_row; `split`: how its items are cut
        over the tp ranks (None: whole on every rank)."""
        if kind not in POOL_KINDS:
            raise ValueError(f"pool kind {kind!r} is not one of {POOL_KINDS}")
        n = self.num_rows if kind == "request_row" else self.num_slots + 1
        self._kinds[name] = kind
        self._splits[name] = split
        self._buffers[name] = {i: lazy_zeros((n, *item_shape), dtype) for i in layer_ids}

    def get(self, name: str, layer_id: int) -> torch.Tensor:
        return self._buffers[name][layer_id]

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-attention K and V, so PagedAttention works unchanged on hybrid models."""
        return self._buffers["k"][layer_id], self._buffers["v"][layer_id]

    def components(self) -> list[PoolComponent]:
        out = []
        for name, per_layer in self._buffers.items():
            ids = sorted(per_layer)
            t = per_layer[ids[0]]
            out.append(PoolComponent(name, self._kinds[name], [per_layer[i] for i in ids],
                                     t[0].numel() * t.element_size(), layer_ids=ids,
                                     split=self._splits[name]))
        return out

    @staticmethod
    def token_bytes(specs: list[tuple[int, tuple[int, ...], torch.dtype]]) -> int:
        """Bytes one token costs across token-kind buffers: specs = (num_layers, item_shape, dtype)."""
        return sum(n * math.prod(shape) * torch.empty((), dtype=dt).element_size() for n, shape, dt in specs)

    @staticmethod
    def row_bytes(specs: list[tuple[int, tuple[int, ...], torch.dtype]]) -> int:
        """Bytes one request row costs across request_row buffers (same specs as token_bytes)."""
        return HybridPool.token_bytes(specs)
