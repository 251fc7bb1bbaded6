"""The KV pool of a DSpark draft with prev_context_fusion: each slot also keeps its fused
context row, which the block after it reads; and the Python path's writes and reads of a draft
pool's K/V rows, quantized with their block scales in an int8 / fp8 pool (mem/kv_quant.py)."""
from __future__ import annotations

import torch

from sparkserve.core.pool import PoolComponent
from sparkserve.mem.heap import lazy_zeros
from sparkserve.mem.kv_pool import KVPool
from sparkserve.mem.kv_quant import dequantize, quantize


class DraftKVPool(KVPool):
    """A fused draft's pool (prev_context_fusion): the K/V, and each slot's fused context row
    [slots, hidden] (hidden_norm(fc(taps)) of the token there), which the block before the next
    anchor reads. A token_page component, so the target's slot lifetimes and the PD transfer of a
    request's rows cover it as they cover the K/V."""

    def __init__(self, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int, hidden: int,
                 dtype: torch.dtype = torch.float32):
        super().__init__(num_slots, num_layers, num_kv_heads, head_dim, dtype)
        self.context = lazy_zeros((num_slots + 1, hidden), torch.float32 if self.quantized else dtype)

    def components(self) -> list[PoolComponent]:
        item = self.context[0].numel() * self.context.element_size()
        return super().components() + [PoolComponent("draft_context", "token_page", [self.context], item)]


def write_rows(pool: KVPool, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """K and V rows [T, Hkv, D] into `layer` of `pool` at `slots` (quantized in a quantized pool)."""
    k_buf, v_buf = pool.layer(layer)
    if not pool.quantized:
        k_buf[slots], v_buf[slots] = k, v
        return
    for buf, scale, rows in ((k_buf, pool.k_scale[layer], k), (v_buf, pool.v_scale[layer], v)):
        elems, scales = quantize(rows, buf.dtype)
        buf.view(torch.uint8)[slots] = elems.view(torch.uint8)
        scale[slots] = scales


def read_rows(pool: KVPool, layer: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V rows of `layer` at `index` (any shape of slots), float32 (dequantized: only these)."""
    k_buf, v_buf = pool.layer(layer)
    if not pool.quantized:
        return k_buf[index], v_buf[index]
    return (dequantize(k_buf[index], pool.k_scale[layer][index]),
            dequantize(v_buf[index], pool.v_scale[layer][index]))
