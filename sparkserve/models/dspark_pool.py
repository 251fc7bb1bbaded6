"""The KV pool of a DSpark draft with prev_context_fusion: each slot also keeps its fused
context row, which the block after it reads."""
from __future__ import annotations

import torch

from sparkserve.core.pool import PoolComponent
from sparkserve.mem.heap import lazy_zeros
from sparkserve.mem.kv_pool import KVPool


class DraftKVPool(KVPool):
    """A fused draft's pool (prev_context_fusion): the K/V, and each slot's fused context row
    [slots, hidden] (hidden_norm(fc(taps)) of the token there), which the block before the next
    anchor reads. A token_page component, so the target's slot lifetimes and the PD transfer of a
    request's rows cover it as they cover the K/V."""

    def __init__(self, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int, hidden: int,
                 dtype: torch.dtype = torch.float32):
        super().__init__(num_slots, num_layers, num_kv_heads, head_dim, dtype)
        self.context = lazy_zeros((num_slots + 1, hidden), dtype)

    def components(self) -> list[PoolComponent]:
        item = self.context[0].numel() * self.context.element_size()
        return super().components() + [PoolComponent("draft_context", "token_page", [self.context], item)]
