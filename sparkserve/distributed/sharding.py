"""How a model's dimensions split over the tensor-parallel ranks, written once: query heads (MLA,
KDA and full attention alike) and MLP widths divide by --tp-size; KV heads and MiniMax-M3's index
heads divide too, or are replicated when there are fewer of them than ranks (rank r keeps head
r * heads // tp); routed experts divide by --ep-size when MoE models set it to --tp-size, or, with
--ep-size 1, every expert's intermediate channels divide by --tp-size (TP MoE); shared-expert
channels divide too, except under the all-to-all backend, which keeps shared experts whole; the
vocabulary (embedding and LM head rows) is padded up to a multiple of --tp-size and split, so any
vocab size splits. Each model lists its dimensions (`tp_dims`) and `check_tp` refuses, at start-up,
what does not split."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sparkserve.config import ModelConfig
from sparkserve.core.pool import Split
from sparkserve.distributed import parallel_state as ps


@dataclass(frozen=True)
class Dim:
    """A dimension a model splits: `what` names it in errors (plural), `size` is its count;
    `serves` (the query heads they serve) marks KV-like heads, replicated when fewer than the ranks;
    `flag` is the flag that splits it; `mlp` marks the MLP / MoE's dimensions, which DP attention
    splits over the whole tp group while attention's split over one attention group; `width` (the
    experts' dimension) their intermediate channels, which split instead under --ep-size 1;
    `whole_under_a2a` marks shared experts, built whole on every rank under --moe-a2a-backend a2a
    (layers/moe.py shared_experts_scope), so nothing of them splits there."""
    what: str
    size: int
    serves: int = 0
    flag: str = "--tp-size"
    mlp: bool = False
    width: int = 0
    whole_under_a2a: bool = False


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _check_dim(d: Dim, parts: int, label: str) -> None:
    n = d.size
    if not d.serves and n % parts:
        raise ValueError(f"{label}: the model's {n} {d.what} do not split over {parts} ranks; "
                         f"use one of {_divisors(n)}")
    if d.serves and n % parts and parts % n:
        ok = ", ".join(str(s) for s in range(1, d.serves + 1)
                       if d.serves % s == 0 and (n % s == 0 or s % n == 0))
        raise ValueError(f"{label}: the model's {n} {d.what} neither split over {parts} ranks nor "
                         f"replicate evenly onto them; use one of {ok}")


def check_tp(cfg: ModelConfig, tp: int, ep: int, dims: list[Dim], attn_tp: int | None = None,
             a2a: bool = False) -> None:
    """Start-up check of --tp-size / --ep-size against the model's `dims`, naming the flags and
    the sizes that work. With DP attention or context parallel, attention splits over `attn_tp`
    ranks only (--tp-size / (--dp-size x --attn-cp-size)), the MLP over all of them. Experts are
    checked first: by count under --ep-size, by width without it. `a2a` (--moe-a2a-backend a2a
    with --ep-size > 1): shared experts stay whole, their widths are not checked."""
    has_experts = any(d.flag == "--ep-size" for d in dims)
    if ep > 1 and not has_experts:
        raise ValueError(f"--ep-size {ep}: {cfg.architecture} has no experts to split; run with --ep-size 1")
    if tp == 1:
        return
    attn_tp = tp if attn_tp is None else attn_tp
    for d in sorted(dims, key=lambda d: d.flag != "--ep-size"):
        if d.whole_under_a2a and a2a and ep > 1:
            continue
        if d.flag == "--ep-size" and ep == 1:
            _check_dim(Dim("expert channels", d.width), tp, f"--tp-size {tp} --ep-size 1 (experts by width)")
        elif d.flag == "--ep-size":
            _check_dim(d, ep, f"--ep-size {ep}")
        elif d.mlp or attn_tp == tp:
            _check_dim(d, tp, f"--tp-size {tp}")
        elif attn_tp > 1:
            label = f"--tp-size {tp} over --dp-size x --attn-cp-size (attention over {attn_tp} ranks)"
            _check_dim(d, attn_tp, label)


def check_pp(cfg: ModelConfig, pp: int, partition: tuple[int, ...] | None) -> None:
    """Start-up check of --pp-size / --pp-layer-partition against the model's layers."""
    if pp > 1:
        ps.layer_partition(cfg.num_hidden_layers, pp, partition)


def heads_shard(num_heads: int) -> tuple[int, int, int]:
    """(this rank's part index, number of parts, heads per part) of the query heads."""
    tp = ps.tp_size()
    return ps.tp_rank(), tp, num_heads // tp


def kv_heads_shard(num_kv_heads: int) -> tuple[int, int, int]:
    """As heads_shard for KV heads; with fewer KV heads than ranks each rank keeps one, shared
    by tp // num_kv_heads ranks."""
    tp, r = ps.tp_size(), ps.tp_rank()
    if num_kv_heads >= tp:
        return r, tp, num_kv_heads // tp
    return r * num_kv_heads // tp, num_kv_heads, 1


def kv_split(num_kv_heads: int) -> Split:
    """How pool items of [KV heads, ...] are cut over the tp ranks (kv_heads_shard's layout)."""
    return Split(0, kv_heads_shard(num_kv_heads)[1])


def heads_split(dim: int = 0, groups: int = 1) -> Split:
    """How pool items whose `dim` holds this rank's query heads (in `groups` blocks) are cut."""
    return Split(dim, ps.tp_size(), groups)


def leads_replica(num_kv_heads: int) -> bool:
    """Whether this rank is the first of those that share its replicated KV-like head (always
    true when the heads split): a sum over the group counts each head once through these."""
    tp = ps.tp_size()
    return num_kv_heads >= tp or ps.tp_rank() % (tp // num_kv_heads) == 0


def width_shard(width: int) -> tuple[int, int, int]:
    tp = ps.tp_size()
    return ps.tp_rank(), tp, width // tp


def vocab_shard(vocab_size: int) -> tuple[int, int, int]:
    """(first row, rows, real rows) of this rank's slice of the vocabulary: padded up to Vp, a
    multiple of the tp size, rank r keeps rows [r * Vp / tp, (r + 1) * Vp / tp); the rows past
    vocab_size (`rows - real` of them, on the last ranks) are padding: zero, never sampled."""
    tp = ps.tp_size()
    rows = -(-vocab_size // tp)
    start = ps.tp_rank() * rows
    return start, rows, max(0, min(rows, vocab_size - start))


def experts_shard(num_experts: int) -> tuple[int, int]:
    """(first expert, experts per rank) of this rank's routed experts."""
    local = num_experts // ps.ep_size()
    return ps.ep_rank() * local, local


def shard_rows(n: int, index: int, parts: int, stacks: int = 1) -> torch.Tensor:
    """Row ids of part `index` of `parts` of each of `stacks` equal blocks of n rows (one block
    per stacked projection, e.g. q|k|v conv weights or a gate|up weight stored as one tensor)."""
    block = n // stacks
    per = block // parts
    return torch.cat([torch.arange(s * block + index * per, s * block + (index + 1) * per)
                      for s in range(stacks)])
