"""All-to-all expert parallel (`--moe-a2a-backend a2a`; SGLang's DeepEP-style dispatch / combine,
on torch.distributed's all_to_all_single: gloo on CPU, NCCL on GPUs). Each rank routes only its
own tokens, sends every (token, slot) row to the rank owning the slot's expert, runs its experts
on the rows it received and sends the outputs back, where each token's weighted sum is made and
its shared experts (whole on every rank) added. Rows travel ordered by expert id, so one
all-gather of every rank's per-expert counts tells each rank how many rows go where and which
expert each row it receives is for (no ids travel), and hands every rank (the driver's /metrics)
the layer's load. A rank with no tokens (an IDLE DP group, a routing that skips its experts)
still takes part, with zero rows.

The ranks holding the same rows (`ep.row_holders`: the tp group without DP attention, an attention
group with it) each dispatch an even share of them and gather the outputs back afterwards, so no
token is computed twice."""
from __future__ import annotations

from typing import Callable

import torch

from sparkserve.distributed import expert_parallel as ep
from sparkserve.distributed import parallel_state as ps

# (rows [R, d], expert id of each row [R] among this rank's experts) -> expert outputs [R, d]
RunExperts = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Router = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def even_split(rows: int, parts: int) -> list[int]:
    """How many of `rows` each of `parts` holders dispatches (the first ones one more)."""
    return [rows // parts + (i < rows % parts) for i in range(parts)]


def dispatch_combine(x: torch.Tensor, gate: Router, run_experts: RunExperts, num_experts: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_j weight_j * expert_{id_j}(x[t]) for each of this rank's rows x [T, d], the experts
    spread evenly over the mlp group's ranks in id order; also the layer's row counts
    [ranks, experts] (what each rank sent each expert)."""
    weights, ids = gate(x)
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)                  # (token, slot) pairs grouped by expert
    token_of = order // k
    counts = ep.moe_counts(torch.bincount(flat, minlength=num_experts))
    ranks = counts.shape[0]
    per = num_experts // ranks
    me = ps.ep_rank()
    send = counts[ps.mlp_index()].view(ranks, per).sum(1).tolist()
    mine = counts[:, me * per:(me + 1) * per]          # [source rank, local expert]
    recv = mine.sum(1).tolist()
    rows = ep.all_to_all_rows(x[token_of], send, recv)
    local_ids = torch.arange(per, device=x.device).repeat(ranks).repeat_interleave(mine.reshape(-1))
    out = ep.all_to_all_rows(run_experts(rows, local_ids), recv, send)
    out *= weights.reshape(-1)[order].to(out.dtype).unsqueeze(1)
    return x.new_zeros(x.shape).index_add_(0, token_of, out), counts


def a2a_moe(x: torch.Tensor, holders: ps.Group, gate: Router, run_experts: RunExperts, num_experts: int,
            shared: Callable[[torch.Tensor], torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE block's output for x (the rows `holders` all hold), and the layer's row counts."""
    split = even_split(x.shape[0], holders.size)
    start = sum(split[:holders.rank])
    own = x[start:start + split[holders.rank]]
    y, counts = dispatch_combine(own, gate, run_experts, num_experts)
    if shared is not None:
        y = y + shared(own)
    if holders.size == 1 or x.shape[0] == 0:
        return y, counts
    return ep.holders_gather(y, split, holders), counts
