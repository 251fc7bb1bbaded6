"""The pool contract (docs/design.md, contract 3): every KV or state pool says how its storage is
laid out, so transfer, retraction and rollback code never needs to know a pool's internals."""
from __future__ import annotations

from dataclasses import dataclass

import torch

POOL_KINDS = ("token_page", "window_page", "request_row")


@dataclass(frozen=True)
class Split:
    """How an item dimension is cut over the attention tensor-parallel ranks: the full `dim`
    (of the item, the row index excluded) is `groups` equal blocks (KDA's q|k|v conv channels),
    each cut into `parts` equal pieces, and tp rank r of T holds piece r * parts // T of every
    block (parts < T: ranks share a piece, as replicated KV heads do). Transfers between
    different layouts rebuild the full rows from the pieces (mem/transfer.py)."""
    dim: int
    parts: int
    groups: int = 1


@dataclass
class PoolComponent:
    name: str
    kind: str                     # one of POOL_KINDS
    tensors: list[torch.Tensor]   # one per layer that has this component
    bytes_per_item: int
    layer_ids: list[int] | None = None   # which layers the tensors belong to; None = all, in order
    split: Split | None = None    # cut over the tp ranks; None: every rank holds it whole

    @property
    def layers(self) -> list[int]:
        return list(range(len(self.tensors))) if self.layer_ids is None else self.layer_ids


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
