"""All-to-all expert parallel (`--moe-a2a-backend a2a`, also taken as `deepep`; SGLang's DeepEP-style
dispatch / combine, on torch.distributed's all_to_all_single: gloo on CPU, NCCL on GPUs). Each rank
routes only its own tokens and, as DeepEP, sends each token's row once to every rank owning at least
one of its top-k experts (not once per slot), with the slots' weights and that rank's expert ids
riding in the same row's bytes (-1 for a slot whose expert is elsewhere). The expert rank runs its
experts on the rows it received and sends back one row per token, the weighted sum of its experts'
outputs, which the token's rank adds up and to which it adds its shared experts (whole on every
rank). So a top-k token whose experts sit on j ranks travels j times each way instead of k times.
One all-gather of every rank's per-expert counts and per-destination row counts sizes both
exchanges and hands every rank (the driver's /metrics) the layer's load. A rank with no tokens (an
IDLE DP group, a routing that skips its experts) still takes part, with zero rows.

The ranks holding the same rows (`ep.row_holders`: the tp group without DP attention, an attention
group with it) each dispatch an even share of them and gather the outputs back afterwards, so no
token is computed twice."""
from __future__ import annotations

from typing import Callable

import torch

from sparkserve.distributed import expert_parallel as ep
from sparkserve.distributed import parallel_state as ps

# (rows [R, d], weights [R, k], this rank's expert index per slot [R, k], -1 for none)
#   -> sum over each row's slots of weight * expert(row), [R, d]
RunExperts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Router = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def even_split(rows: int, parts: int) -> list[int]:
    """How many of `rows` each of `parts` holders dispatches (the first ones one more)."""
    return [rows // parts + (i < rows % parts) for i in range(parts)]


def pack_rows(x: torch.Tensor, weights: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
    """Each row's bytes followed by its k float32 weights and k local expert ids (as float32,
    exact below 2**24): one all-to-all carries a row and what the expert rank needs of it."""
    meta = torch.cat([weights.float(), local_ids.float()], 1)
    return torch.cat([x.contiguous().view(torch.uint8), meta.view(torch.uint8)], 1)


def unpack_rows(buf: torch.Tensor, dtype: torch.dtype, d: int, k: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pack_rows' inverse: (rows [R, d] of `dtype`, weights [R, k], local ids [R, k])."""
    row_bytes = d * torch.empty(0, dtype=dtype).element_size()
    meta = buf[:, row_bytes:].contiguous().view(torch.float32)
    return buf[:, :row_bytes].contiguous().view(dtype), meta[:, :k], meta[:, k:].long()


def dispatch_combine(x: torch.Tensor, gate: Router, run_experts: RunExperts, num_experts: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_j weight_j * expert_{id_j}(x[t]) for each of this rank's rows x [T, d], the experts
    spread evenly over the mlp group's ranks in id order; also the layer's row counts
    [ranks, experts] (the (token, slot) pairs each rank routed to each expert)."""
    weights, ids = gate(x)
    T, k = ids.shape
    ranks = ps.group_of("mlp").size
    per = num_experts // ranks
    dest = ids // per                                  # the rank of each slot's expert
    hit = torch.zeros(T, ranks, dtype=torch.bool, device=x.device).scatter_(1, dest, True)
    rank_of, token_of = hit.t().nonzero(as_tuple=True)     # (rank, token) pairs, by rank then token
    table = ep.moe_counts(torch.cat([torch.bincount(ids.reshape(-1), minlength=num_experts),
                                     hit.sum(0)]))
    counts, rows = table[:, :num_experts], table[:, num_experts:]     # rows[src, dst]: tokens sent
    me = ps.mlp_index()
    send, recv = rows[me].tolist(), rows[:, me].tolist()
    there = dest[token_of] == rank_of.unsqueeze(1)     # [R, k]: the slots the row's rank serves
    local = torch.where(there, ids[token_of] - rank_of.unsqueeze(1) * per, -1)
    packed = pack_rows(x[token_of], torch.where(there, weights[token_of], 0.0), local)
    got = ep.all_to_all_rows(packed, send, recv)
    out = ep.all_to_all_rows(run_experts(*unpack_rows(got, x.dtype, x.shape[1], k)), recv, send)
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
