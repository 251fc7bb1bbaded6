"""Token-indexed KV pool: per layer one K and one V buffer of [slots, kv_heads, head_dim].
Slot 0 is a dummy that padding reads from and never holds a real token."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PoolComponent:
    """How a pool's storage is laid out, for transfer / retraction / rollback code that must
    not know pool internals (DESIGN.md contract 3)."""
    name: str
    kind: str                     # token_page | window_page | request_row
    tensors: list[torch.Tensor]   # one per layer that has this component
    bytes_per_item: int
    layer_ids: list[int] | None = None   # which layers the tensors belong to; None = all, in order


def uniform_window(layer_windows: list[int | None]) -> int | None:
    """The sliding window that bounds every layer (the largest one), or None when any layer
    attends over the full context (or there are no layers): only then can a token's KV slot,
    shared by all layers, be freed once it leaves the window."""
    if not layer_windows or any(w is None for w in layer_windows):
        return None
    return max(layer_windows)


class KVPool:
    """`window`: every layer is sliding-window with at most this window, so pages that leave it
    are freed while a request runs (KVCacheManager.slide_window) and the K/V components are
    `window_page`; None: full attention, `token_page`."""

    def __init__(self, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, window: int | None = None):
        self.num_slots = num_slots
        self.window = window
        shape = (num_slots + 1, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer_id], self.v[layer_id]

    def components(self) -> list[PoolComponent]:
        item = self.k[0][0].numel() * self.k[0].element_size()
        kind = "token_page" if self.window is None else "window_page"
        return [PoolComponent("k", kind, self.k, item), PoolComponent("v", kind, self.v, item)]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
