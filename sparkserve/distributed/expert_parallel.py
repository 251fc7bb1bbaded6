"""The collectives of all-to-all expert parallel (layers/moe_a2a.py), over the mlp group (the ranks
a MoE layer's experts are spread over): every rank's per-expert and per-rank counts, the rows' all-to-all
(torch.distributed.all_to_all_single, which gloo runs, uneven and empty splits included), and the
gather that gives the ranks holding the same rows their outputs back."""
from __future__ import annotations

import torch
import torch.distributed as dist

from sparkserve.distributed import parallel_state as ps


def row_holders(own_rows: bool) -> ps.Group:
    """The ranks that hold the same rows as this one, which an all-to-all MoE splits among
    themselves and gathers back: this rank alone when it runs its own share of a split prefill
    (`own_rows`), else its attention group (DP attention, CP), or the whole tp group."""
    if own_rows:
        return ps.Group()
    cp = ps.group_of("cp")
    return cp if cp.size > 1 else ps.group_of("tp")


def moe_counts(per_expert: torch.Tensor) -> torch.Tensor:
    """Every rank's counts of one MoE layer (its per-expert (token, slot) pairs and the rows it
    sends each rank), [ranks of the mlp group, n]."""
    g = ps.group_of("mlp")
    if g.size == 1:
        return per_expert.unsqueeze(0)
    parts = [torch.empty_like(per_expert) for _ in range(g.size)]
    ps.count_sent(per_expert.numel() * per_expert.element_size())
    dist.all_gather(parts, per_expert, group=g.handle)
    return torch.stack(parts)


def all_to_all_rows(x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
    """x's rows cut into send[r] for mlp rank r, in rank order; returns the recv[r] rows each rank
    r sent this one, in rank order."""
    g = ps.group_of("mlp")
    if g.size == 1:
        return x
    out = x.new_empty(sum(recv), *x.shape[1:])
    ps.count_sent((x.shape[0] - send[g.rank]) * x[:1].numel() * x.element_size())
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=g.handle)
    return out


def holders_gather(x: torch.Tensor, counts: list[int], holders: ps.Group) -> torch.Tensor:
    """Every holder's rows (counts[r] each) in holder order, on each of them."""
    return x if holders.size == 1 else ps.gather_rows(x, counts, holders)
