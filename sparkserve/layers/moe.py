"""Mixture of experts: the expert computation (`fused_experts`, shared by every MoE model), the
routers by rule (ROUTERS: the sigmoid + grouped top-k of DeepSeek-V3 / Kimi, `grouped_topk`; the
softmax top-k of Mixtral and Qwen3-MoE, `softmax_topk`; DeepSeek-V2's scaled one, `softmax_greedy`),
and a MoE block with optional shared experts (`SharedExpertMoE`).

Expert weights are stacked 3-D tensors, as transformers 5 keeps them: `gate_up_w[E, 2I, d]` (gate
rows first, then up) and `down_w[E, d, I]`; or, served with int8 activations from a quantized GGUF,
each expert's checkpoint blocks in a block Linear (`Experts.load_blocks`), so a quantized MoE is
held at its file's size, never in fp32. Tokens are grouped per expert so each expert runs one
GEMM over all of its tokens instead of one GEMV per (token, slot).

Parallel: with --ep-size = --tp-size each rank keeps E / ranks whole experts; with --ep-size 1 and
--tp-size N (SGLang's TP MoE) every rank keeps a 1/N slice of every expert's width. Either way
the default backend routes every token on every rank and sums partial outputs with one
all-reduce; --moe-a2a-backend a2a dispatches tokens to their experts' ranks (layers/moe_a2a.py)."""
from __future__ import annotations

import contextlib
import weakref
from typing import Callable

import torch
from torch import nn

from sparkserve.distributed import expert_parallel as ep
from sparkserve.distributed import parallel_state as ps
from sparkserve.distributed.sharding import experts_shard, width_shard
from sparkserve.kernels import BlockWeight
from sparkserve.layers.activation import silu_and_mul
from sparkserve.layers.block_backed import ServesActivationQuant
from sparkserve.layers.linear import FusedLinear, Linear, RowParallelLinear
from sparkserve.layers.moe_a2a import a2a_moe
from sparkserve.layers.moe_decode import decode_experts
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
    rank keeps experts first .. first + local - 1 and runs them for the tokens routed to them.
    TP MoE (--ep-size 1 over several ranks): it keeps every expert's slice `width_index` of
    `width_parts` of the intermediate channels (gate and up rows, down columns). `forward`
    returns this rank's partial sum and the MoE block sums the group's (one all-reduce, shared
    experts' partial sums included); GPT-OSS's biases stay whole (gate|up's slice is cut as it is
    added, down's added by width slice 0 only)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int,
                 activation: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul, bias: bool = False):
        """`bias`: each expert's gate|up and down projections add one (GPT-OSS)."""
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.first, self.local = experts_shard(num_experts)
        self.width_index, self.width_parts, width = (width_shard(intermediate) if ps.ep_size() == 1
                                                     else (0, 1, intermediate))
        self.gate_up_proj = nn.Parameter(torch.empty(self.local, 2 * width, hidden), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(self.local, hidden, width), requires_grad=False)
        def maybe(*shape: int) -> nn.Parameter | None:
            return nn.Parameter(torch.empty(self.local, *shape), requires_grad=False) if bias else None
        self.gate_up_proj_bias, self.down_proj_bias = maybe(2 * intermediate), maybe(hidden)
        self.activation = activation
        # Served from checkpoint blocks (load_blocks): per local expert its gate|up and down Linear,
        # built once all its parts came; the stacked parameters then go (meta).
        self.blocks: dict[tuple[int, str], BlockWeight] = {}
        self.block_experts: nn.ModuleList | None = None
        self.activation_quant = "none"

    @property
    def width(self) -> int:
        return self.intermediate // self.width_parts

    def _channels(self) -> tuple[int, int]:
        """This rank's intermediate channels [k0, k1) of every expert."""
        return self.width_index * self.width, (self.width_index + 1) * self.width

    def set_activation_quant(self, mode: str) -> None:
        """The mode block Linears built from now on serve (load_model sets it before the weights
        load; the built ones are BlockBacked modules of their own)."""
        self.activation_quant = mode

    def takes_blocks(self, blocks: BlockWeight) -> bool:
        """Whether an expert tensor with these blocks is held as blocks (load_blocks) rather than
        as fp32 values: when its Linear would never read an fp32 weight (and, split by width,
        when the down projection's slice falls on block edges)."""
        return Linear.reads_only_blocks(blocks, self.activation_quant) and \
            (self.width_parts == 1 or self.width % 32 == 0)

    def load_blocks(self, part: str, blocks: BlockWeight, expert: int) -> list[int]:
        """As load_part for one expert's gate | up | down, held as its checkpoint blocks."""
        i = self.local_index(expert)
        if i is None:
            return []
        if self.width_parts > 1:
            k0, k1 = self._channels()
            blocks = blocks.cols(k0, k1) if part == "down" else blocks.rows(torch.arange(k0, k1))
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
        """This rank's part of a stacked [num_experts, ...] checkpoint parameter: its experts, and
        split by width its channels of gate_up_proj [E, 2I, d] (gate rows, up rows) and
        down_proj [E, d, I] (the biases [E, n] stay whole)."""
        t = tensor[self.first:self.first + self.local]
        if self.width_parts == 1 or t.dim() != 3:
            return t, None
        k0, k1 = self._channels()
        if t.shape[1:] == (2 * self.intermediate, self.hidden):
            I = self.intermediate
            return torch.cat([t[:, k0:k1], t[:, I + k0:I + k1]], 1), None
        return t[:, :, k0:k1], None

    def _width_part(self, part: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's channels of one expert's 2-D gate / up [I, d] or down [d, I] tensor."""
        if self.width_parts == 1:
            return t
        k0, k1 = self._channels()
        return t[:, k0:k1] if part == "down" else t[k0:k1]

    def load_part(self, part: str, tensor: torch.Tensor, expert: int | None = None) -> list[int]:
        """Fill `part` (gate | up | down) of global expert `expert` from its 2-D checkpoint tensor,
        or of every expert from a stacked [num_experts, ...] one (GGUF's `*_exps`); experts other
        ranks keep are skipped. Returns the local indices filled."""
        I = self.down_proj.shape[2]
        if expert is None:
            pairs = list(enumerate(tensor[self.first:self.first + self.local]))
        else:
            pairs = [] if (i := self.local_index(expert)) is None else [(i, tensor)]
        for i, t in pairs:
            t = self._width_part(part, t)
            if part == "down":
                self.down_proj.data[i].copy_(t)
            else:
                self.gate_up_proj.data[i, (0 if part == "gate" else I):][:I].copy_(t)
        return [i for i, _ in pairs]

    def _biases(self, e: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Expert e's gate|up bias slice and its down bias (None on width slices but the first)."""
        b = self.gate_up_proj_bias[e]
        if self.width_parts > 1:
            k0, k1 = self._channels()
            b = torch.cat([b[k0:k1], b[self.intermediate + k0:self.intermediate + k1]])
        return b, self.down_proj_bias[e] if self.width_index == 0 else None

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if (y := decode_experts(self, x, weights, ids - self.first)) is not None:    # a few rows: one call
            return y
        if self.block_experts is None and self.down_proj_bias is None:
            return fused_experts(x, weights, ids - self.first, self.gate_up_proj, self.down_proj,
                                 self.activation)

        def expert(e: int, xs: torch.Tensor) -> torch.Tensor:
            if self.down_proj_bias is None:
                gate_up, down = self.block_experts[e]
                return down(self.activation(gate_up(xs)))
            gate_up_bias, down_bias = self._biases(e)
            if self.block_experts is None:
                gate_up = torch.nn.functional.linear(xs, self.gate_up_proj[e], gate_up_bias)
                return torch.nn.functional.linear(self.activation(gate_up), self.down_proj[e], down_bias)
            gate_up, down = self.block_experts[e]
            out = down(self.activation(gate_up(xs) + gate_up_bias))
            return out if down_bias is None else out + down_bias
        return grouped_experts(x, weights, ids - self.first, self.local, expert)

    def run_rows(self, rows: torch.Tensor, weights: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """The all-to-all backend's received rows, each the weighted sum of its slots' experts
        (local_ids [R, k]: this rank's expert index per slot, -1 where the expert is elsewhere)."""
        return self(rows, weights, local_ids + self.first)


def shared_experts_scope():
    """Where a MoE block builds its shared experts: split by width with the routed experts'
    partial sums (one all-reduce), or whole on every rank under the all-to-all backend, where each
    rank runs them on its own tokens."""
    return ps.replicated_scope() if ps.moe_a2a() else contextlib.nullcontext()


class MoEBlock(nn.Module):
    """Routed experts (`gate` routes, `experts` run) plus optional always-on shared experts,
    summed. Backend none: every rank routes all the rows it is given and adds its experts' and
    shared experts' partial sums, one all-reduce over the group. Backend a2a: the rows are
    dispatched (moe_a2a.py); `holders` are the ranks that hold the same rows (run_mlp passes
    them). Every call counts the (token, slot) rows each expert got: `routed_tokens`, summed over
    the whole group's tokens, which /metrics reports."""

    def __init__(self, gate: nn.Module, experts: Experts, shared_experts: nn.Module | None):
        super().__init__()
        self.gate, self.experts, self.shared_experts = gate, experts, shared_experts
        self.a2a = ps.moe_a2a()
        self.group = ps.layer_group()
        self.routed_tokens: torch.Tensor | None = None     # [experts], made at the first forward

    def _count(self, per_expert: torch.Tensor) -> None:
        if self.routed_tokens is None:
            self.routed_tokens = torch.zeros_like(per_expert)
        self.routed_tokens += per_expert

    def forward(self, x: torch.Tensor, holders: ps.Group | None = None) -> torch.Tensor:
        E = self.experts.num_experts
        if self.a2a:
            y, counts = a2a_moe(x, holders or ep.row_holders(False), self.gate, self.experts.run_rows, E,
                                self.shared_experts)
            self._count(counts.sum(0))
            return y
        weights, ids = self.gate(x)
        self._count(torch.bincount(ids.reshape(-1), minlength=E))
        out = self.experts(x, weights, ids)
        return ps.all_reduce(out if self.shared_experts is None else out + self.shared_experts(x), self.group)


_moe_blocks: weakref.WeakKeyDictionary[nn.Module, list[MoEBlock]] = weakref.WeakKeyDictionary()


def routed_token_counts(model: nn.Module) -> list[int]:
    """(token, slot) rows each expert received so far, summed over the model's MoE layers on this
    rank's pipeline stage (empty for a model without experts)."""
    if model not in _moe_blocks:        # read every step (the scheduler's load): found once
        _moe_blocks[model] = [m for m in model.modules() if isinstance(m, MoEBlock)]
    counts = [m.routed_tokens for m in _moe_blocks[model] if m.routed_tokens is not None]
    return torch.stack(counts).sum(0).tolist() if counts else []


def expert_rank_tokens(per_expert: list[int]) -> list[int]:
    """per_expert summed over each expert-parallel rank's experts (one entry under --ep-size 1)."""
    n = ps.ep_size()
    per = len(per_expert) // n
    return [sum(per_expert[r * per:(r + 1) * per]) for r in range(n)] if per_expert else []


class SharedExpertMoE(MoEBlock):
    """Routed experts plus always-on shared experts (one wide SwiGLU MLP; none when num_shared is 0,
    as Mixtral and Qwen3-MoE)."""

    def __init__(self, hidden: int, num_experts: int, intermediate: int, top_k: int,
                 num_shared: int, num_groups: int = 1, topk_groups: int = 1,
                 renormalize: bool = True, scaling: float = 1.0, router: str = "sigmoid_grouped",
                 activation: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul,
                 expert_bias: bool = False):
        with shared_experts_scope():
            shared = GatedMLP(hidden, intermediate * num_shared, reduce=False) if num_shared else None
        gate = Router(hidden, num_experts, top_k, num_groups, topk_groups, renormalize, scaling, router)
        super().__init__(gate, Experts(num_experts, hidden, intermediate, activation, expert_bias), shared)
