"""The pool contract (docs/design.md, contract 3): every KV or state pool says how its storage is
laid out, so transfer, retraction and rollback code never needs to know a pool's internals."""
from __future__ import annotations

from dataclasses import dataclass

import torch

POOL_KINDS = ("token_page", "window_page", "request_row")


@dataclass
class PoolComponent:
    name: str
    kind: str                     # one of POOL_KINDS
    tensors: list[torch.Tensor]   # one per layer that has this component
    bytes_per_item: int
    layer_ids: list[int] | None = None   # which layers the tensors belong to; None = all, in order


class Pool:
    """Base of every pool. `window`: every layer is sliding-window with at most this window, so
    pages that leave it are freed while a request runs; `swa_window`: a split pool's windowed
    layers (their own slot space). None: full attention."""

    num_slots: int
    window: int | None = None
    swa_window: int | None = None

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-attention K and V buffers of one layer."""
        raise NotImplementedError

    def components(self) -> list[PoolComponent]:
        raise NotImplementedError
