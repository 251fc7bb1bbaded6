"""The one place that builds parallel groups from the world and the flags (SGLang's names:
--tp-size, --pp-size, --nnodes, --node-rank, --dist-init-addr), on torch.distributed: gloo on
CPU. One process per rank; global rank 0 is the driver (it schedules), the others mirror its
forwards. Layers ask `tp_rank()` / `tp_size()` while they are built and `all_reduce` in forward;
both are the single-process values when nothing was initialised. `tp_broadcast` / `tp_gather`
carry the LM head's input rows out from the driver and its vocab slices back."""
from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sparkserve.args import ParallelConfig

# Waiting for the driver's next command may last as long as a server is idle; a collective
# inside a forward may not (a hung rank must fail requests, not hang them).
CONTROL_TIMEOUT = datetime.timedelta(days=365)


def tp_group_ranks(world_size: int, tp_size: int) -> list[list[int]]:
    """A tp group is tp_size consecutive ranks: one pipeline stage. (Stage s, tp rank t is
    global rank s * tp_size + t; pipeline messages go between the same t of neighbouring stages.)"""
    return [list(range(s * tp_size, (s + 1) * tp_size)) for s in range(world_size // tp_size)]


@dataclass
class _State:
    world_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    tp_group: object = None
    pp_rank: int = 0
    pp_size: int = 1
    pp_layer_partition: tuple[int, ...] | None = None
    data_group: object = None       # every rank, with the collective timeout: pipeline sends
    ep_size: int = 1                # experts split over the tp group (1: every rank has them all)
    timeout: datetime.timedelta = datetime.timedelta(seconds=300)
    sent_bytes: int = 0             # payload this rank put into collectives and sends (benchmarks)


_state = _State()


def init_distributed(cfg: ParallelConfig, rank: int, init_addr: str, timeout_s: float) -> None:
    """Join the world as `rank` and build every group (each rank builds all of them, in order)."""
    if dist.is_initialized():
        raise ValueError("this process already drives a parallel engine (--tp-size/--pp-size > 1); "
                         "shut that one down first (Engine.shutdown())")
    dist.init_process_group("gloo", init_method=f"tcp://{init_addr}", rank=rank, world_size=cfg.world_size,
                            timeout=CONTROL_TIMEOUT)
    timeout = datetime.timedelta(seconds=timeout_s)
    tp_group = None
    for ranks in tp_group_ranks(cfg.world_size, cfg.tp_size):
        g = dist.new_group(ranks, timeout=timeout, backend="gloo")
        if rank in ranks:
            tp_group = g
    data_group = dist.new_group(list(range(cfg.world_size)), timeout=timeout, backend="gloo")
    _state.__init__(cfg.world_size, rank % cfg.tp_size, cfg.tp_size, tp_group, rank // cfg.tp_size,
                    cfg.pp_size, cfg.pp_layer_partition, data_group, cfg.ep_size, timeout)


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    _state.__init__()


def tp_rank() -> int:
    return _state.tp_rank


def tp_size() -> int:
    return _state.tp_size


def ep_rank() -> int:
    """This rank's part of the experts (its index in the tp group)."""
    return _state.tp_rank if _state.ep_size > 1 else 0


def ep_size() -> int:
    return _state.ep_size


def pp_rank() -> int:
    return _state.pp_rank


def pp_size() -> int:
    return _state.pp_size


def stage_layers(num_layers: int, stage: int | None = None) -> range:
    """The decoder layers a pipeline stage owns: contiguous, as even as they split, or as
    --pp-layer-partition gives them."""
    stage = _state.pp_rank if stage is None else stage
    return layer_partition(num_layers, _state.pp_size, _state.pp_layer_partition)[stage]


def layer_partition(num_layers: int, stages: int, counts: tuple[int, ...] | None = None) -> list[range]:
    """Layer ranges of every stage; ValueError naming the flags when they cannot be met."""
    if counts is None:
        if stages > num_layers:
            raise ValueError(f"--pp-size {stages}: the model has only {num_layers} layers; use at most that")
        counts = tuple(num_layers // stages + (s < num_layers % stages) for s in range(stages))
    if len(counts) != stages or sum(counts) != num_layers or min(counts) < 1:
        raise ValueError(f"--pp-layer-partition {','.join(map(str, counts))}: give {stages} positive layer "
                         f"counts (one per stage) that sum to the model's {num_layers} layers")
    starts = [sum(counts[:s]) for s in range(stages)]
    return [range(a, a + n) for a, n in zip(starts, counts)]


def is_first_stage() -> bool:
    return _state.pp_rank == 0


def is_last_stage() -> bool:
    return _state.pp_rank == _state.pp_size - 1


def stage_peer(stage: int) -> int:
    """The rank of `stage` with this rank's tensor-parallel index."""
    return stage * _state.tp_size + _state.tp_rank


class PendingSend:
    """A send in flight (a pipeline stage goes on with its next micro-batch meanwhile); it keeps
    the tensor alive until `wait`."""

    def __init__(self, x: torch.Tensor, dst: int):
        self.x = x.contiguous()
        _state.sent_bytes += self.x.numel() * self.x.element_size()
        self.work = dist.isend(self.x, dst, group=_state.data_group)

    def wait(self) -> None:
        self.work.wait(_state.timeout)


def recv(shape: tuple[int, ...], src: int) -> torch.Tensor:
    x = torch.empty(shape)
    dist.recv(x, src, group=_state.data_group)
    return x


def sent_bytes() -> int:
    """Payload bytes this rank has put into collectives and pipeline sends since it joined."""
    return _state.sent_bytes


def agree_min(values: list[int]) -> list[int]:
    """The smallest of every rank's values, on every rank (pool sizes that fit them all)."""
    if _state.world_size == 1:
        return values
    t = torch.tensor(values, dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_state.data_group)
    return t.tolist()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the tensor-parallel group, in place; nothing to do on one rank."""
    if _state.tp_size > 1:
        _state.sent_bytes += x.numel() * x.element_size()
        dist.all_reduce(x, group=_state.tp_group)
    return x


def tp_broadcast(x: torch.Tensor) -> torch.Tensor:
    """The tp group's rank 0's `x` on every rank of the group (the others pass a tensor of the
    same shape to receive into; in place). The driver hands its stage-0 peers the rows to run
    the LM head on (under pipeline parallel they do not have the final hidden rows)."""
    if _state.tp_size > 1:
        if _state.tp_rank == 0:
            _state.sent_bytes += x.numel() * x.element_size()
        src = _state.pp_rank * _state.tp_size
        dist.broadcast(x, src, group=_state.tp_group, async_op=True).wait(_state.timeout)
    return x


def tp_gather(x: torch.Tensor) -> torch.Tensor | None:
    """Every tp rank's `x` (all of one shape) concatenated along the last dimension in tp-rank
    order, on the group's rank 0; None on the others (the LM head's vocab slices)."""
    if _state.tp_size == 1:
        return x
    x = x.contiguous()
    dst = _state.pp_rank * _state.tp_size
    parts = [torch.empty_like(x) for _ in range(_state.tp_size)] if _state.tp_rank == 0 else None
    if _state.tp_rank != 0:
        _state.sent_bytes += x.numel() * x.element_size()
    dist.gather(x, parts, dst, group=_state.tp_group, async_op=True).wait(_state.timeout)
    return None if parts is None else torch.cat(parts, -1)


def broadcast_object(obj: object = None) -> object:
    """The driver's `obj` on every rank (the driver passes it, the others receive it). The
    others wait as long as it takes (an idle server sends nothing); the driver gives up after
    the collective timeout, so a hung rank fails requests instead of hanging them."""
    driver = dist.get_rank() == 0
    size = torch.zeros(1, dtype=torch.long)
    if driver:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size[0] = data.numel()
        _state.sent_bytes += data.numel()
    _wait(dist.broadcast(size, 0, async_op=True), driver)
    if not driver:
        data = torch.empty(int(size[0]), dtype=torch.uint8)
    _wait(dist.broadcast(data, 0, async_op=True), driver)
    return obj if driver else pickle.loads(data.numpy().tobytes())


def _wait(work, bounded: bool) -> None:
    if bounded:
        work.wait(_state.timeout)
    else:
        work.wait()
