"""Mixture of experts: the expert computation (`fused_experts`, shared by every MoE model), the
routers by rule (ROUTERS: the sigmoid + grouped top-k of DeepSeek-V3 / Kimi, `grouped_topk`; the
softmax top-k of Mixtral and Qwen3-MoE, `softmax_topk`; DeepSeek-V2's scaled one, `softmax_greedy`),
and a MoE block with optional shared experts (`SharedExpertMoE`).

Expert weights are stacked 3-D tensors, as transformers 5 keeps them: `gate_up_w[E, 2I, d]` (gate
rows first, then up) and `down_w[E, d, I]`; or, served with int8 activations from a quantized GGUF,
each expert's checkpoint blocks in a block Linear (`Experts.load_blocks`), so a quantized MoE is
held at its file's size, never in fp32. Tokens are grouped per expert so each expert runs one
GEMM over all of its tokens instead of one GEMV per (token, slot)."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from sparkserve.distributed import parallel_state as ps
from sparkserve.distributed.sharding import experts_shard, width_shard
from sparkserve.kernels import BlockWeight
from sparkserve.layers.activation import silu_and_mul
from sparkserve.layers.block_backed import ServesActivationQuant
from sparkserve.layers.linear import FusedLinear, Linear, RowParallelLinear
from sparkserve.layers.sharded import Sharded


def fused_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  gate_up_w: torch.Tensor, down_w: torch.Tensor,
                  activation: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) for x [T, d],
    topk_weights / topk_ids [T, k]; gate_up_w [E, 2I, d]; down_w [E, d, I] -> [T, d], where
    expert_e(x) = down_w[e] @ activation(gate_up_w[e] @ x) and `activation` maps the [n, 2I]
    gate|up output to [n, I] (default SwiGLU-silu; see layers/activation.py).
    Ids outside [0, E) (experts another rank owns) contribute nothing."""
    def expert(e: int, xs: torch.Tensor) -> torch.Tensor:
        h = activation(torch.nn.functional.linear(xs, gate_up_w[e]))
        return torch.nn.functional.linear(h, down_w[e])
    return grouped_experts(x, topk_weights, topk_ids, gate_up_w.shape[0], expert)


def grouped_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, E: int,
                    expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """fused_experts with expert e's computation given as expert(e, rows) -> rows."""
    T, k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    order = flat_ids.argsort(stable=True)              # (token, slot) pairs grouped by expert
    sorted_ids = flat_ids[order]
    token_of = order // k
    counts = torch.bincount(sorted_ids.clamp(-1, E) + 1, minlength=E + 2).tolist()
    start = counts[0]                                  # ids < 0 sort first: skipped
    xs = x[token_of]
    out = x.new_zeros(T * k, x.shape[1])
    for e in range(E):
        n = counts[e + 1]
        if n == 0:
            continue
        out[start:start + n] = expert(e, xs[start:start + n])
        start += n
    out *= topk_weights.reshape(-1)[order].to(out.dtype).unsqueeze(1)
    return x.new_zeros(x.shape).index_add_(0, token_of, out)


def grouped_topk(router_logits: torch.Tensor, top_k: int, bias: torch.Tensor | None = None,
                 num_groups: int = 1, topk_groups: int = 1, renormalize: bool = True,
                 scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 / Kimi routing: sigmoid scores; experts are chosen by score + bias (the
    load-balancing correction) among the best `topk_groups` groups (a group's score is the sum
    of its two best), but weighted by the plain score. Returns (weights [T, k], ids [T, k])."""
    scores = router_logits.float().sigmoid()
    choice = scores if bias is None else scores + bias.float()
    T, E = choice.shape
    if num_groups > 1:
        groups = choice.view(T, num_groups, E // num_groups)
        group_scores = groups.topk(2, dim=-1)[0].sum(-1)
        best = group_scores.topk(topk_groups, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // num_groups, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral / Qwen3-MoE routing: softmax over every expert, the top_k best, their weights
    renormalised to sum 1 when `renormalize`. Returns (weights [T, k], ids [T, k])."""
    weights, ids = router_logits.float().softmax(-1).topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


def softmax_greedy(router_logits: torch.Tensor, top_k: int, num_groups: int = 1, topk_groups: int = 1,
                   scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2 routing: softmax over every expert, the top_k best (`greedy`; with num_groups > 1
    `group_limited_greedy`: only among the `topk_groups` groups of best single score), their
    weights never renormalised, times `scaling` (routed_scaling_factor)."""
    scores = router_logits.float().softmax(-1)
    if num_groups > 1:
        T, E = scores.shape
        best = scores.view(T, num_groups, E // num_groups).amax(-1).topk(topk_groups, dim=-1, sorted=False)[1]
        keep = torch.zeros(T, num_groups, dtype=torch.bool, device=scores.device).scatter_(1, best, True)
        scores = scores.masked_fill(~keep.repeat_interleave(E // num_groups, dim=1), 0.0)
    weights, ids = scores.topk(top_k, dim=-1, sorted=False)
    return weights * scaling, ids


# The routing rules a config may name (ModelConfig.moe_router; Kimi / MiniMax-M3 / DeepSeek-V2 build
# theirs directly).
ROUTERS = ("sigmoid_grouped", "softmax_topk", "softmax_topk_renorm", "topk_softmax", "softmax_greedy")


class GatedMLP(nn.Module):
    """Dense SwiGLU MLP with a fused gate|up projection (dense layers and shared experts), its
    width split over the tensor-parallel ranks like LlamaMLP. `reduce=False` (shared experts)
    returns this rank's partial sum, which the MoE block adds to the experts' before its one
    all-reduce."""

    def __init__(self, hidden: int, intermediate: int, reduce: bool = True):
        super().__init__()
        index, parts, width = width_shard(intermediate)
        self.gate_up_proj = FusedLinear(hidden, {"gate": width, "up": width},
                                        tp_parts={"gate": (index, parts), "up": (index, parts)})
        self.down_proj = RowParallelLinear(intermediate, hidden, reduce=reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class Router(nn.Module):
    """Router weights in fp32 (as the reference keeps them) and the rule's settings: `rule` one of
    ROUTERS (the grouped top-k settings and the score-correction bias are sigmoid_grouped's)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, num_groups: int = 1,
                 topk_groups: int = 1, renormalize: bool = True, scaling: float = 1.0,
                 rule: str = "sigmoid_grouped"):
        super().__init__()
        if rule not in ROUTERS:
            raise ValueError(f"MoE router {rule!r} is not supported (supported: {', '.join(ROUTERS)})")
        self.rule = rule
        self.weight = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)
        if rule == "sigmoid_grouped":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)
        if rule == "topk_softmax":      # GPT-OSS: a biased router, softmax over the top-k logits
            self.bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)
        self.top_k, self.num_groups, self.topk_groups = top_k, num_groups, topk_groups
        self.renormalize, self.scaling = renormalize, scaling

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rule == "topk_softmax":
            values, ids = torch.nn.functional.linear(x.float(), self.weight.float(), self.bias.float()).topk(
                self.top_k, dim=-1)
            return values.softmax(-1), ids
        logits = torch.nn.functional.linear(x.float(), self.weight.float())
        if self.rule == "softmax_greedy":
            return softmax_greedy(logits, self.top_k, self.num_groups, self.topk_groups, self.scaling)
        if self.rule != "sigmoid_grouped":
            return softmax_topk(logits, self.top_k, self.rule == "softmax_topk_renorm")
        return grouped_topk(logits, self.top_k, self.e_score_correction_bias, self.num_groups,
                            self.topk_groups, self.renormalize, self.scaling)


class Experts(Sharded, ServesActivationQuant):
    """Stacked routed-expert weights; `activation` as in fused_experts. Expert parallel: this
    rank keeps experts first .. first + local - 1, runs them for every token routed to them (the
    tokens are on every rank of the group); `forward` returns this rank's partial sum and the MoE
    block sums the group's (one all-reduce, shared experts' partial sums included)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int,
                 activation: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul, bias: bool = False):
        """`bias`: each expert's gate|up and down projections add one (GPT-OSS)."""
        super().__init__()
        self.first, self.local = experts_shard(num_experts)
        self.gate_up_proj = nn.Parameter(torch.empty(self.local, 2 * intermediate, hidden),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(self.local, hidden, intermediate), requires_grad=False)
        def maybe(*shape: int) -> nn.Parameter | None:
            return nn.Parameter(torch.empty(self.local, *shape), requires_grad=False) if bias else None
        self.gate_up_proj_bias, self.down_proj_bias = maybe(2 * intermediate), maybe(hidden)
        self.activation = activation
        # Served from checkpoint blocks (load_blocks): per local expert its gate|up and down Linear,
        # built once all its parts came; the stacked parameters then go (meta).
        self.blocks: dict[tuple[int, str], BlockWeight] = {}
        self.block_experts: nn.ModuleList | None = None
        self.activation_quant = "none"

    def set_activation_quant(self, mode: str) -> None:
        """The mode block Linears built from now on serve (load_model sets it before the weights
        load; the built ones are BlockBacked modules of their own)."""
        self.activation_quant = mode

    def takes_blocks(self, blocks: BlockWeight) -> bool:
        """Whether an expert tensor with these blocks is held as blocks (load_blocks) rather than
        as fp32 values: when its Linear would never read an fp32 weight."""
        return Linear.reads_only_blocks(blocks, self.activation_quant)

    def load_blocks(self, part: str, blocks: BlockWeight, expert: int) -> list[int]:
        """As load_part for one expert's gate | up | down, held as its checkpoint blocks."""
        i = self.local_index(expert)
        if i is None:
            return []
        self.blocks[i, part] = blocks
        if len(self.blocks) == 3 * self.local:
            self._build_block_experts()
        return [i]

    def _build_block_experts(self) -> None:
        mods = []
        for i in range(self.local):
            gate_up = BlockWeight.cat([self.blocks[i, "gate"], self.blocks[i, "up"]])
            if gate_up is None:
                raise ValueError(f"expert {self.first + i}: gate and up blocks of different types")
            mods.append(nn.ModuleList([Linear.from_blocks(gate_up, self.activation_quant),
                                       Linear.from_blocks(self.blocks[i, "down"], self.activation_quant)]))
        self.block_experts = nn.ModuleList(mods)
        self.blocks = {}
        meta = torch.device("meta")
        self.gate_up_proj = nn.Parameter(self.gate_up_proj.detach().to(meta), requires_grad=False)
        self.down_proj = nn.Parameter(self.down_proj.detach().to(meta), requires_grad=False)

    def local_index(self, expert: int) -> int | None:
        """Where global expert `expert` sits on this rank, or None when another rank has it."""
        i = expert - self.first
        return i if 0 <= i < self.local else None

    def local_shard(self, tensor: torch.Tensor, blocks=None) -> tuple[torch.Tensor, None]:
        """This rank's experts of a stacked [num_experts, ...] checkpoint tensor."""
        return tensor[self.first:self.first + self.local], None

    def load_part(self, part: str, tensor: torch.Tensor, expert: int | None = None) -> list[int]:
        """Fill `part` (gate | up | down) of global expert `expert` from its 2-D checkpoint tensor,
        or of every expert from a stacked [num_experts, ...] one (GGUF's `*_exps`); experts other
        ranks keep are skipped. Returns the local indices filled."""
        I = self.down_proj.shape[2]
        if expert is None:
            pairs = [(i, t) for i, t in enumerate(self.local_shard(tensor)[0])]
        else:
            pairs = [] if (i := self.local_index(expert)) is None else [(i, tensor)]
        for i, t in pairs:
            if part == "down":
                self.down_proj.data[i].copy_(t)
            else:
                self.gate_up_proj.data[i, (0 if part == "gate" else I):][:I].copy_(t)
        return [i for i, _ in pairs]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.block_experts is None and self.down_proj_bias is None:
            return fused_experts(x, weights, ids - self.first, self.gate_up_proj, self.down_proj,
                                 self.activation)

        def expert(e: int, xs: torch.Tensor) -> torch.Tensor:
            if self.block_experts is None:
                gate_up = torch.nn.functional.linear(xs, self.gate_up_proj[e], self.gate_up_proj_bias[e])
                return torch.nn.functional.linear(self.activation(gate_up), self.down_proj[e],
                                                  self.down_proj_bias[e])
            gate_up, down = self.block_experts[e]
            if self.down_proj_bias is None:
                return down(self.activation(gate_up(xs)))
            return down(self.activation(gate_up(xs) + self.gate_up_proj_bias[e])) + self.down_proj_bias[e]
        return grouped_experts(x, weights, ids - self.first, self.local, expert)


class SharedExpertMoE(nn.Module):
    """Routed experts plus always-on shared experts (one wide SwiGLU MLP; none when num_shared is 0,
    as Mixtral and Qwen3-MoE), summed: both are
    partial sums under tensor parallelism (experts split, shared width split), added on each rank
    and summed over the group by one all-reduce."""

    def __init__(self, hidden: int, num_experts: int, intermediate: int, top_k: int,
                 num_shared: int, num_groups: int = 1, topk_groups: int = 1,
                 renormalize: bool = True, scaling: float = 1.0, router: str = "sigmoid_grouped",
                 activation: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul,
                 expert_bias: bool = False):
        super().__init__()
        self.gate = Router(hidden, num_experts, top_k, num_groups, topk_groups, renormalize, scaling, router)
        self.experts = Experts(num_experts, hidden, intermediate, activation, expert_bias)
        self.shared_experts = (GatedMLP(hidden, intermediate * num_shared, reduce=False) if num_shared
                               else None)
        self.group = ps.layer_group()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        return ps.all_reduce(out if self.shared_experts is None else out + self.shared_experts(x), self.group)
