"""Block-sparse paged attention: each query reads only the key blocks the lightning indexer
chose for its head group (layers/sparse_indexer.py), causally.

Query head h follows index head h // (H / Hi), as the reference does. Two ways to run it, same
result: few queries per request (decode, verify) gather just the chosen blocks' K/V, so a step
costs O(topk * block_size) per query whatever the context length; longer extends attend the
padded batch under a block mask (one SDPA call, like PagedAttention)."""
from __future__ import annotations

import torch
from torch import nn

from sparkserve.core.forward_batch import ForwardBatch
from sparkserve.layers.attention import gather_rows, pool_scales, store_rows
from sparkserve.layers.sparse_indexer import padded_queries, unpad_queries

GATHER_MAX_QUERIES = 16   # per request; past this, per-query gathered K/V outgrow one masked pass


class BlockSparseAttention(nn.Module):
    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int, num_index_heads: int):
        super().__init__()
        if num_heads % num_index_heads:
            raise ValueError(f"num_attention_heads {num_heads} is not a multiple of index heads "
                             f"{num_index_heads}")
        self.layer_id = layer_id
        self.h, self.hkv, self.d, self.hi = num_heads, num_kv_heads, head_dim, num_index_heads
        self.block_size = block_size
        self.scale = head_dim ** -0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
                block_ids: torch.Tensor) -> torch.Tensor:
        """q [T, H, D]; k, v [T, Hkv, D]; block_ids [B, Hi, Qmax, k] (-1 = none) -> [T, H*D]."""
        k_buf, v_buf = batch.kv_pool.layer(self.layer_id)
        # a quantized pool (--kv-cache-dtype int8 / fp8): rows stored with their block scales
        ks, vs = (pool_scales(batch.kv_pool, name, self.layer_id, k_buf) for name in ("k", "v"))
        store_rows(batch, k_buf, ks, k)
        store_rows(batch, v_buf, vs, v)
        k_buf, v_buf = (k_buf, ks), (v_buf, vs)
        qp = padded_queries(batch, q)                                   # [B, Q, H, D]
        qpos = padded_queries(batch, batch.positions)                   # [B, Q]
        B, Q = qpos.shape
        L = batch.kv_indices.shape[1]
        if (Q <= GATHER_MAX_QUERIES and self.hi == self.hkv
                and block_ids.shape[-1] * self.block_size < L):
            out = self._gathered(qp, qpos, k_buf, v_buf, batch.kv_indices, block_ids)
        else:
            out = self._masked(qp, qpos, k_buf, v_buf, batch.kv_indices, block_ids)
        return unpad_queries(batch, out).reshape(-1, self.h * self.d)

    def _masked(self, qp, qpos, k_buf, v_buf, kv_indices, block_ids) -> torch.Tensor:
        B, Q = qpos.shape
        L = kv_indices.shape[1]
        nb = -(-L // self.block_size)
        keep = torch.zeros(*block_ids.shape[:3], nb + 1, dtype=torch.bool)
        keep.scatter_(-1, block_ids.masked_fill(block_ids < 0, nb), True)   # -1 -> spare column
        keep = keep[..., :nb].repeat_interleave(self.block_size, dim=-1)[..., :L]
        keep = keep.repeat_interleave(self.h // self.hi, dim=1)            # [B, H, Q, L]
        keep &= (torch.arange(L)[None, :] <= qpos[:, :, None])[:, None]
        out = torch.nn.functional.scaled_dot_product_attention(
            qp.transpose(1, 2), gather_rows(*k_buf, kv_indices).transpose(1, 2),
            gather_rows(*v_buf, kv_indices).transpose(1, 2),
            attn_mask=keep, scale=self.scale, enable_gqa=self.h != self.hkv)
        return out.transpose(1, 2)                                          # [B, Q, H, D]

    def _gathered(self, qp, qpos, k_buf, v_buf, kv_indices, block_ids) -> torch.Tensor:
        """Index head g == KV head g: gather the chosen blocks of KV head g once for its group."""
        B, Q = qpos.shape
        g = self.h // self.hkv
        pos = (block_ids[..., None] * self.block_size + torch.arange(self.block_size)).flatten(-2)
        ok = (block_ids[..., None] >= 0).expand(*block_ids.shape, self.block_size).flatten(-2)
        ok = ok & (pos <= qpos[:, None, :, None])                           # [B, Hkv, Q, S]
        pos = pos.masked_fill(~ok, 0)
        slots = kv_indices.gather(1, pos.reshape(B, -1)).view(pos.shape)
        head = torch.arange(self.hkv)[None, :, None, None]
        keys = gather_rows(*k_buf, (slots, head))                           # [B, Hkv, Q, S, D]
        vals = gather_rows(*v_buf, (slots, head))
        qg = qp.view(B, Q, self.hkv, g, self.d).permute(0, 2, 3, 1, 4)      # [B, Hkv, G, Q, D]
        s = torch.einsum("bkgqd,bkqsd->bkgqs", qg, keys) * self.scale
        s = s.masked_fill(~ok[:, :, None], float("-inf"))
        out = torch.einsum("bkgqs,bkqsd->bkgqd", torch.softmax(s, dim=-1), vals)
        return out.permute(0, 3, 1, 2, 4).reshape(B, Q, self.h, self.d)
