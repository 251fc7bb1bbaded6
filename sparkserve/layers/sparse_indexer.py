"""Lightning indexer of MiniMax-M3 sparse attention, for varlen flat batches.

A small side branch scores every query against every earlier key: `index_n_heads` query heads,
ONE shared index-key head, plain dot products (no softmax scale: only the ordering matters).
Keys are grouped into absolute-position blocks of `block_size`; a block's score is the max over
its visible keys. Each query then keeps, per index head, the top-k blocks, where its own
`local_blocks` newest blocks and the `init_blocks` first ones are forced in (scored +inf). The
main attention of that layer reads only the kept blocks (layers/sparse_attention.py).

Index K is cached per token in the pool's `index_k` component (token_page: written at
`out_cache_loc`, read through `kv_indices`, so prefix cache, retraction and PD transfer treat it
like main KV). With the index value path (SGLang: a sparse layer whose
`sparse_disable_index_value` flag is 0) the indexer also caches one index V head per token
(`index_v`) and returns a small attention output, added by the caller to the layer output:

    out_t = index_o_proj( concat_h softmax_{s <= t}(q_{t,h} . k_s / sqrt(D)) v_s )

over ALL visible keys, not only the selected blocks. Why: the indexer already reads every index
K row to score blocks, so the value path is the same pass (one extra 1-head V row per token);
restricting it to the selected blocks would make the output jump whenever the discrete block
choice changes, and would couple the index output to the top-k budget.

Tensor parallel: the index heads split like KV heads. Exact, because each index head scores
and selects its blocks on its own (no sum or softmax across index heads: the top-k runs per
head) and main head h reads only index head h // (H / Hi)'s blocks, so the rank holding main
heads [r H / tp, (r + 1) H / tp) needs exactly index heads [r Hi / tp, (r + 1) Hi / tp), or the
one it shares with other ranks when Hi < tp (replicated, as kv_heads_shard does). The index K
(and V) head is one head shared by all index heads: whole on every rank. The value output is a
sum over index heads through o_proj: a partial sum per rank (its heads' columns of o_proj), which
the caller adds to the main attention's before one all-reduce; of ranks sharing a replicated
index head only the first contributes it."""
from __future__ import annotations

import torch
from torch import nn

from sparkserve.core.forward_batch import ForwardBatch
from sparkserve.distributed.sharding import kv_heads_shard, leads_replica
from sparkserve.layers.attention import gather_rows, pool_scales, store_rows
from sparkserve.layers.linear import FusedLinear, RowParallelLinear
from sparkserve.layers.norm import RMSNorm
from sparkserve.layers.rotary import apply_partial_rotary


def padded_queries(batch: ForwardBatch, x: torch.Tensor) -> torch.Tensor:
    """Flat rows [T, ...] -> [B, Qmax, ...] (padding rows repeat flat row 0)."""
    q_index, _ = batch.query_layout()
    return x.view(batch.batch_size, -1, *x.shape[1:]) if q_index is None else x[q_index]


def unpad_queries(batch: ForwardBatch, x: torch.Tensor) -> torch.Tensor:
    """[B, Qmax, ...] -> flat rows [T, ...] (drops the padding rows)."""
    _, flat = batch.query_layout()
    x = x.reshape(-1, *x.shape[2:])
    return x if flat is None else x[flat]


def select_blocks(scores: torch.Tensor, qpos: torch.Tensor, block_size: int, topk: int,
                  local_blocks: int, init_blocks: int = 0) -> torch.Tensor:
    """scores [B, Hi, Q, L] (keys after a query at -inf), qpos [B, Q] -> block ids
    [B, Hi, Q, min(topk, ceil(L / block_size))], best first; -1 marks an empty slot (a query
    with fewer visible blocks than topk). The ids are distinct, as the attention requires."""
    B, Hi, Q, L = scores.shape
    nb = -(-L // block_size)
    pad = nb * block_size - L
    if pad:
        scores = torch.nn.functional.pad(scores, (0, pad), value=float("-inf"))
    block = scores.view(B, Hi, Q, nb, block_size).amax(-1)
    qblk = (qpos // block_size)[:, :, None]                                  # [B, Q, 1]
    bid = torch.arange(nb)[None, None, :]
    forced = (bid <= qblk) & ((bid > qblk - local_blocks) | (bid < init_blocks))
    block = block.masked_fill(forced[:, None], float("inf"))
    vals, ids = block.topk(min(topk, nb), dim=-1)
    return ids.masked_fill(vals == float("-inf"), -1)


class LightningIndexer(nn.Module):
    """Index q/k(/v) projections with Gemma-style norms (weights stored +1, see the model's
    loader) and partial RoPE; `forward` picks each query's key blocks."""

    def __init__(self, layer_id: int, hidden_size: int, num_heads: int, head_dim: int,
                 block_size: int, topk_blocks: int, local_blocks: int, init_blocks: int,
                 eps: float, with_value: bool):
        super().__init__()
        self.layer_id = layer_id
        index, parts, self.h = kv_heads_shard(num_heads)
        self.d = head_dim
        self.block_size, self.topk, self.local, self.init = block_size, topk_blocks, local_blocks, init_blocks
        shards = {"q": self.h * head_dim, "k": head_dim}
        if with_value:
            shards["v"] = head_dim
        self.qkv_proj = FusedLinear(hidden_size, shards, tp_parts={"q": (index, parts)})
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, part=(index, parts),
                                        reduce=False) if with_value else None
        self.adds_value = leads_replica(num_heads)      # this rank's copy of its heads counts

    @property
    def with_value(self) -> bool:
        return self.o_proj is not None

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [T, hidden] -> (block ids [B, Hi, Qmax, k] per padded query of this rank's index
        heads, this rank's partial index value output [T, hidden] or None). Writes this forward's
        index K (and V) rows into the pool."""
        h, d = self.h, self.d
        qkv = self.qkv_proj(x)
        q = apply_partial_rotary(self.q_norm(qkv[:, :h * d].view(-1, h, d)), *cos_sin)
        k = apply_partial_rotary(self.k_norm(qkv[:, h * d:(h + 1) * d].view(-1, 1, d)), *cos_sin)
        pool = batch.kv_pool
        k_buf = pool.get("index_k", self.layer_id)
        k_scale = pool_scales(pool, "index_k", self.layer_id, k_buf)      # --kv-cache-dtype int8 / fp8
        store_rows(batch, k_buf, k_scale, k[:, 0])
        keys = gather_rows(k_buf, k_scale, batch.kv_indices)                     # [B, L, D]
        qpos = padded_queries(batch, batch.positions)                            # [B, Q]
        visible = torch.arange(keys.shape[1])[None, None, :] <= qpos[:, :, None]  # [B, Q, L]
        scores = torch.einsum("bqhd,bld->bhql", padded_queries(batch, q).float(), keys.float())
        scores = scores.masked_fill(~visible[:, None], float("-inf"))
        block_ids = select_blocks(scores, qpos, self.block_size, self.topk, self.local, self.init)
        if self.o_proj is None:
            return block_ids, None
        v_buf = pool.get("index_v", self.layer_id)
        v_scale = pool_scales(pool, "index_v", self.layer_id, v_buf)
        store_rows(batch, v_buf, v_scale, qkv[:, (h + 1) * d:])
        if not self.adds_value:
            return block_ids, None
        probs = torch.softmax(scores * d ** -0.5, dim=-1)
        out = torch.einsum("bhql,bld->bqhd", probs, gather_rows(v_buf, v_scale, batch.kv_indices)).to(x.dtype)
        return block_ids, self.o_proj(unpad_queries(batch, out).reshape(-1, h * d))
