"""Token-indexed KV pool: per layer one K and one V buffer of [slots, kv_heads, head_dim], and for a
quantized dtype (mem/kv_quant.py) their float16 block scales [slots, kv_heads, blocks].
Slot 0 is a dummy that padding reads from and never holds a real token."""
from __future__ import annotations

import torch

from sparkserve.core.pool import Pool, PoolComponent, Split
from sparkserve.mem.heap import lazy_zeros
from sparkserve.mem.kv_quant import SCALE_DTYPE, block_size, is_quantized, scale_component


def uniform_window(layer_windows: list[int | None]) -> int | None:
    """The sliding window that bounds every layer (the largest one), or None when any layer
    attends over the full context (or there are no layers): only then can a token's KV slot,
    shared by all layers, be freed once it leaves the window."""
    if not layer_windows or any(w is None for w in layer_windows):
        return None
    return max(layer_windows)


def split_windows(layer_windows: list[int | None]) -> tuple[list[int], int] | None:
    """(the windowed layers, their largest window) when a model mixes full-attention and
    sliding-window layers (Qwen3 max_window_layers, Gemma-style): those layers then get a slot
    space of their own whose pages can leave the window. None otherwise."""
    windowed = [i for i, w in enumerate(layer_windows) if w is not None]
    if not windowed or len(windowed) == len(layer_windows):
        return None
    return windowed, max(layer_windows[i] for i in windowed)


class KVPool(Pool):
    """`window`: every layer is sliding-window with at most this window, so pages that leave it
    are freed while a request runs (KVCacheManager.slide_window) and the K/V components are
    `window_page`; None: full attention, `token_page`.

    Split pool (`swa_layers`, `swa_slots`, `swa_window`): those windowed layers index their
    K/V by slots of a second space of `swa_slots` (SplitAllocator.full_to_swa), components
    `swa_k`/`swa_v` of kind `window_page`; the other layers' `k`/`v` are `token_page`."""

    def __init__(self, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, window: int | None = None,
                 swa_layers: list[int] = (), swa_slots: int = 0, swa_window: int | None = None,
                 layers: range | None = None, split: Split | None = None):
        """`layers`: those this pipeline stage owns (the others get only the dummy slot);
        `split`: how the KV heads are cut over the tp ranks."""
        self.split = split
        self.num_slots = num_slots
        self.window = window
        self.swa_layers = sorted(swa_layers)
        self.swa_slots = swa_slots
        self.swa_window = swa_window if self.swa_layers else None
        owned = range(num_layers) if layers is None else layers
        self.owned = list(owned)
        rows = [(swa_slots if i in self.swa_layers else num_slots) + 1 if i in owned else 1
                for i in range(num_layers)]
        self.dtype = dtype
        self.k = [lazy_zeros((n, num_kv_heads, head_dim), dtype) for n in rows]
        self.v = [lazy_zeros((n, num_kv_heads, head_dim), dtype) for n in rows]
        self.quantized = is_quantized(dtype)
        scales = [(n, num_kv_heads, head_dim // block_size(head_dim)) for n in rows] if self.quantized else []
        self.k_scale = [lazy_zeros(shape, SCALE_DTYPE) for shape in scales]
        self.v_scale = [lazy_zeros(shape, SCALE_DTYPE) for shape in scales]

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer_id], self.v[layer_id]

    def layer_scales(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A quantized pool's K and V block scales of one layer; None for a float pool."""
        return (self.k_scale[layer_id], self.v_scale[layer_id]) if self.quantized else None

    def components(self) -> list[PoolComponent]:
        """The owned layers' K and V, and a quantized pool's scales (a pipeline stage's others
        hold only the dummy slot)."""
        full = [i for i in self.owned if i not in self.swa_layers]
        if not self.swa_layers:
            kind = "token_page" if self.window is None else "window_page"
            return self._components("", kind, full)
        swa = [i for i in self.swa_layers if i in self.owned]
        return self._components("", "token_page", full) + self._components("swa_", "window_page", swa)

    def _components(self, prefix: str, kind: str, layers: list[int]) -> list[PoolComponent]:
        bufs = {"k": self.k, "v": self.v}
        if self.quantized:
            bufs[scale_component("k", self.dtype)] = self.k_scale
            bufs[scale_component("v", self.dtype)] = self.v_scale
        return [PoolComponent(prefix + name, kind, [b[i] for i in layers], b[0][0].nbytes, layers, self.split)
                for name, b in bufs.items()]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """K and V of one token in every layer, with a quantized pool's float16 block scales."""
        row = head_dim * torch.empty((), dtype=dtype).element_size()
        if is_quantized(dtype):
            row += head_dim // block_size(head_dim) * torch.empty((), dtype=SCALE_DTYPE).element_size()
        return 2 * num_layers * num_kv_heads * row
