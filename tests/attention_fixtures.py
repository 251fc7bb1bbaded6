"""Paged attention test helpers: a one-layer pool of random K/V with each request's keys in
scattered slots, and the batch of each request's last q_lens tokens over it."""
from __future__ import annotations

import torch

from sparkserve.core.forward_batch import ForwardBatch, ForwardMode
from sparkserve.mem.kv_pool import KVPool


def random_paged_kv(seq_lens: list[int], Hkv: int, D: int, g: torch.Generator, slots: int = 200):
    """A one-layer KV pool of random rows and a token table giving each request scattered slots."""
    B, lmax = len(seq_lens), max(seq_lens)
    pool = KVPool(slots, 1, Hkv, D)
    pool.k[0].normal_(generator=g)
    pool.v[0].normal_(generator=g)
    table = torch.zeros(B, lmax, dtype=torch.long)
    free = 1 + torch.randperm(slots - 1, generator=g)
    for b, n in enumerate(seq_lens):
        table[b, :n] = free[b * lmax:b * lmax + n]
    return pool, table


def last_tokens_batch(mode: ForwardMode, seq_lens: list[int], q_lens: list[int], table: torch.Tensor,
                      pool: KVPool) -> ForwardBatch:
    """The batch whose request b runs its last q_lens[b] tokens (positions and slots from table)."""
    pos = torch.cat([torch.arange(s - n, s) for s, n in zip(seq_lens, q_lens)])
    loc = torch.cat([table[b, s - n:s] for b, (s, n) in enumerate(zip(seq_lens, q_lens))])
    return ForwardBatch(mode, torch.zeros(pos.shape[0], dtype=torch.long), pos, loc, q_lens, seq_lens, table,
                        pool)
