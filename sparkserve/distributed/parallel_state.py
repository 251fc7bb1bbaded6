"""The one place that builds parallel groups from the world and the flags (SGLang's names:
--tp-size, --pp-size, --nnodes, --node-rank, --dist-init-addr), on torch.distributed: gloo on
CPU. One process per rank; global rank 0 is the driver (it schedules), the others mirror its
forwards. Layers ask `tp_rank()` / `tp_size()` while they are built and `all_reduce` in forward;
both are the single-process values when nothing was initialised."""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sparkserve.args import ParallelConfig

# Waiting for the driver's next command may last as long as a server is idle; a collective
# inside a forward may not (a hung rank must fail requests, not hang them).
CONTROL_TIMEOUT = datetime.timedelta(days=365)


def group_ranks(world_size: int, tp_size: int) -> dict[str, list[list[int]]]:
    """Ranks of every group: a tp group is tp_size consecutive ranks (one pipeline stage); a pp
    group takes one rank of each stage."""
    stages = world_size // tp_size
    return {"tp": [list(range(s * tp_size, (s + 1) * tp_size)) for s in range(stages)],
            "pp": [list(range(t, world_size, tp_size)) for t in range(tp_size)]}


@dataclass
class _State:
    rank: int = 0
    world_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    tp_group: object = None


_state = _State()


def init_distributed(cfg: ParallelConfig, rank: int, init_addr: str, timeout_s: float) -> None:
    """Join the world as `rank` and build every group (each rank builds all of them, in order)."""
    dist.init_process_group("gloo", init_method=f"tcp://{init_addr}", rank=rank, world_size=cfg.world_size,
                            timeout=CONTROL_TIMEOUT)
    timeout = datetime.timedelta(seconds=timeout_s)
    groups = group_ranks(cfg.world_size, cfg.tp_size)
    tp_group = None
    for ranks in groups["tp"]:
        g = dist.new_group(ranks, timeout=timeout, backend="gloo")
        if rank in ranks:
            tp_group = g
    _state.__init__(rank, cfg.world_size, rank % cfg.tp_size, cfg.tp_size, tp_group)


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    _state.__init__()


def rank() -> int:
    return _state.rank


def tp_rank() -> int:
    return _state.tp_rank


def tp_size() -> int:
    return _state.tp_size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the tensor-parallel group, in place; nothing to do on one rank."""
    if _state.tp_size > 1:
        dist.all_reduce(x, group=_state.tp_group)
    return x


def broadcast_object(obj: object = None) -> object:
    """The driver's `obj` on every rank (the driver passes it, the others receive it)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
