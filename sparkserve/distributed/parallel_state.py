"""The one place that builds parallel groups from the world and the flags (SGLang's names:
--tp-size, --pp-size, --nnodes, --node-rank, --dist-init-addr), on torch.distributed: gloo on
CPU. One process per rank; global rank 0 is the driver (it schedules), the others mirror its
forwards. Layers ask `tp_rank()` / `tp_size()` while they are built and `all_reduce` in forward;
both are the single-process values when nothing was initialised. `tp_broadcast` / `tp_gather`
carry the LM head's input rows out from the driver and its vocab slices back."""
from __future__ import annotations

import contextlib
import datetime
import pickle
import threading
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from sparkserve.addresses import check_rendezvous_ip, split_host_port
from sparkserve.args import ParallelConfig
from sparkserve.distributed import interface, rendezvous
from sparkserve.distributed.world import init_world

# Waiting for the driver's next command may last as long as a server is idle; a collective
# inside a forward may not (a hung rank must fail requests, not hang them).
CONTROL_TIMEOUT = datetime.timedelta(days=365)


def tp_group_ranks(world_size: int, tp_size: int) -> list[list[int]]:
    """A tp group is tp_size consecutive ranks: one pipeline stage. (Stage s, tp rank t is
    global rank s * tp_size + t; pipeline messages go between the same t of neighbouring stages.)"""
    return [list(range(s * tp_size, (s + 1) * tp_size)) for s in range(world_size // tp_size)]


@dataclass(frozen=True)
class Group:
    """Ranks this rank works with: its index among them, their count, the torch group (None:
    the default, every rank) and their global ranks; the first is the group's leader."""
    rank: int = 0
    size: int = 1
    handle: object = None
    ranks: tuple[int, ...] = (0,)

    @property
    def leader(self) -> int:
        return self.ranks[0]


def _new_group(ranks: list[int], timeout: datetime.timedelta) -> object:
    return _connected(lambda: dist.new_group(ranks, timeout=timeout, backend="gloo"))


def _group(ranks: list[int], me: int, timeout: datetime.timedelta) -> Group | None:
    """Every rank creates every group (torch.distributed's rule); members get theirs."""
    handle = _new_group(ranks, timeout)
    return Group(ranks.index(me), len(ranks), handle, tuple(ranks)) if me in ranks else None


@dataclass
class _State:
    world_size: int = 1
    # The tensor-parallel group of this rank's scheduler: attention (and embedding, LM head)
    # split over it. With DP attention, the attention group: tp_size / dp_size ranks.
    tp: Group = Group()
    # What the MLP / MoE splits over: the whole stage (tp_size ranks); tp itself without DP attention.
    mlp: Group = Group()
    building: Group | None = None   # mlp inside mlp_scope(): what layers being built split over
    control: Group = Group()        # the driver (leader) and the ranks that mirror its forwards
    dp: Group = Group()             # DP attention: the groups' drivers; rank = this group's index
    dp_data: Group | None = None    # the same ranks, with the collective timeout (drivers only)
    cp: Group = Group()             # context parallel: the attention group's ranks, which split prefills
    pp_rank: int = 0
    pp_size: int = 1
    pp_layer_partition: tuple[int, ...] | None = None
    data_group: object = None       # every rank, with the collective timeout: pipeline sends
    ep_size: int = 1                # experts split over the mlp group (1: every rank has them all)
    timeout: datetime.timedelta = datetime.timedelta(seconds=300)
    sent_bytes: int = 0             # payload this rank put into collectives and sends (benchmarks)
    moe_a2a: bool = False           # --moe-a2a-backend a2a: MoE tokens dispatched to their experts' ranks


_state = _State()


_BUSY = ("this process already drives a parallel engine (--tp-size/--pp-size > 1); shut that one down "
         "first (Engine.shutdown())")


def check_free() -> None:
    """Refuse a second engine in a process that drives a parallel one: the rank state is that
    engine's (a single-rank engine would wait in its collectives). A process group of someone
    else's (train-draft's DDP ranks) is no engine's."""
    if _state.world_size > 1:
        raise ValueError(_BUSY)


@dataclass(frozen=True)
class StartupWatch:
    """The watch the process that started the other ranks keeps on them while the world forms
    (entrypoints/ranks.py): rank 0's rendezvous store goes through `wrap` (its waits give up once a
    rank has died), and `check` raises, naming the rank, once one has."""
    wrap: Callable[[dist.Store], dist.Store]
    check: Callable[[], None]


_watch: StartupWatch | None = None
WATCH_POLL_S = 0.02
CONNECT_GRACE_S = 3.0


@contextlib.contextmanager
def watch_rendezvous(watch: StartupWatch) -> Iterator[None]:
    """Inside: rank 0 forms the world and its groups under `watch`."""
    global _watch
    _watch, saved = watch, _watch
    try:
        yield
    finally:
        _watch = saved


def _connected(make: Callable[[], object]) -> object:
    """make() (a gloo group's construction), given up as soon as the watch sees a rank dead. Gloo
    connects a group's pairs after every rank has put its address in the store: a rank that dies
    in between leaves this rank's connect to it retrying (or waiting for it) for the group's whole
    timeout (the world's is a year) inside C++, where no store wait polls the watch. So make() runs
    in a thread while this one polls; after a death that thread is left to its timeout (a daemon:
    it keeps no process alive) and the start fails now."""
    if _watch is None:
        return make()
    done = threading.Event()
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["group"] = make()
        except BaseException as e:  # noqa: BLE001 - raised in the waiting thread
            out["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name="sparkserve-group-connect", daemon=True).start()
    while not done.wait(WATCH_POLL_S):
        try:
            _watch.check()
        except BaseException:
            # A connect that fails on its own (refused, gloo's few retries) ends within moments:
            # let it, since a thread that leaves C++ while the interpreter exits aborts the process.
            done.wait(CONNECT_GRACE_S)
            raise
    if "error" in out:
        raise out["error"]
    return out.get("group")


def init_distributed(cfg: ParallelConfig, rank: int, init_addr: str, timeout_s: float) -> None:
    """Join the world as `rank` and build every group (each rank builds all of them, in order).
    With DP attention or context parallel (pp 1), rank r is in attention group r // (tp / dp),
    whose first rank drives it (runs its scheduler); its ranks split the attention heads or, with
    --attn-cp-size, the tokens of long prefills (cp group); the attention groups together are the
    one tp group of the MLP. The ranks meet at `init_addr` (refused on a wildcard or public address
    unless cfg.allow_public_bind) and talk over the interface `interface.gloo_interface` picks."""
    if dist.is_initialized():
        raise ValueError(_BUSY)
    host, port = split_host_port(init_addr)
    with contextlib.suppress(OSError):         # a name that does not resolve: the store says so
        check_rendezvous_ip(host, interface.resolve(host), cfg.allow_public_bind)
    choice = interface.gloo_interface(host, cfg.socket_ifname)
    with rendezvous.env(interface.IFNAME_ENV, choice.ifname):
        store = rendezvous.join(cfg, rank, host, port, timeout_s, choice,
                                _watch.wrap if _watch is not None and rank == 0 else None)
        _connected(lambda: init_world("gloo", store=store, rank=rank, world_size=cfg.world_size,
                                      timeout=CONTROL_TIMEOUT))
        _build_groups(cfg, rank, timeout_s)


def _build_groups(cfg: ParallelConfig, rank: int, timeout_s: float) -> None:
    """Every group, in the same order on every rank."""
    timeout = datetime.timedelta(seconds=timeout_s)
    def mine(groups: list[list[int]], t: datetime.timedelta) -> Group:
        return [g for ranks in groups if (g := _group(ranks, rank, t))][0]

    mlp = mine(tp_group_ranks(cfg.world_size, cfg.tp_size), timeout)
    data_group = _new_group(list(range(cfg.world_size)), timeout)
    tp, dp, dp_data = mlp, Group(), None
    control = Group(rank, cfg.world_size, None, tuple(range(cfg.world_size)))
    cp = Group()
    if cfg.dp_size > 1 or cfg.attn_cp_size > 1:
        n = cfg.group_size
        attn = [list(range(d * n, (d + 1) * n)) for d in range(cfg.dp_size)]
        control = mine(attn, CONTROL_TIMEOUT)
        tp = mine(attn, timeout) if cfg.attn_cp_size == 1 else Group()
        cp = mine(attn, timeout) if cfg.attn_cp_size > 1 else Group()
        drivers = [a[0] for a in attn]
        dp = _group(drivers, rank, CONTROL_TIMEOUT) or Group(rank // n, cfg.dp_size)
        dp_data = _group(drivers, rank, timeout)
    _state.__init__(cfg.world_size, tp, mlp, None, control, dp, dp_data, cp, rank // cfg.tp_size, cfg.pp_size,
                    cfg.pp_layer_partition, data_group, cfg.ep_size, timeout,
                    moe_a2a=cfg.moe_a2a_backend == "a2a" and cfg.ep_size > 1)


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    _state.__init__()


def layer_group() -> Group:
    """The group a layer being built now splits over: the MLP's inside mlp_scope(), none inside
    replicated_scope(), else the tp group (a layer keeps it for its all-reduce)."""
    return _state.building or _state.tp


def tp_rank() -> int:
    return layer_group().rank


def tp_size() -> int:
    return layer_group().size


@contextlib.contextmanager
def mlp_scope():
    """Build a decoder layer's MLP / MoE inside this: it splits over the whole stage (the mlp
    group), which with DP attention is wider than the attention's tp group."""
    _state.building = _state.mlp
    try:
        yield
    finally:
        _state.building = None


@contextlib.contextmanager
def replicated_scope():
    """Build layers whole on every rank inside this (the shared experts of an all-to-all MoE,
    which each rank runs on its own tokens)."""
    saved, _state.building = _state.building, Group()
    try:
        yield
    finally:
        _state.building = saved


def moe_a2a() -> bool:
    """Whether MoE layers dispatch their tokens to the experts' ranks (--moe-a2a-backend a2a)."""
    return _state.moe_a2a


def ep_rank() -> int:
    """This rank's part of the experts (its index in the mlp group)."""
    return _state.mlp.rank if _state.ep_size > 1 else 0


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
    return stage * _state.mlp.size + _state.mlp.rank


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


def count_sent(nbytes: int) -> None:
    _state.sent_bytes += nbytes


def group_of(kind: str) -> Group:
    """This rank's group of `kind`: "tp", "mlp" or "cp" (for the collectives of other modules)."""
    return {"tp": _state.tp, "mlp": _state.mlp, "cp": _state.cp}[kind]


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


def all_reduce(x: torch.Tensor, group: Group | None = None) -> torch.Tensor:
    """Sum over `group` (the tp group by default), in place; nothing to do on one rank."""
    g = group or _state.tp
    if g.size > 1:
        _state.sent_bytes += x.numel() * x.element_size()
        dist.all_reduce(x, group=g.handle)
    return x


def tp_broadcast(x: torch.Tensor) -> torch.Tensor:
    """The tp group's rank 0's `x` on every rank of the group (the others pass a tensor of the
    same shape to receive into; in place). The driver hands its stage-0 peers the rows to run
    the LM head on (under pipeline parallel they do not have the final hidden rows)."""
    tp = _state.tp
    if tp.size > 1:
        if tp.rank == 0:
            _state.sent_bytes += x.numel() * x.element_size()
        dist.broadcast(x, tp.leader, group=tp.handle, async_op=True).wait(_state.timeout)
    return x


def tp_gather(x: torch.Tensor) -> torch.Tensor | None:
    """Every tp rank's `x` (all of one shape) concatenated along the last dimension in tp-rank
    order, on the group's rank 0; None on the others (the LM head's vocab slices)."""
    tp = _state.tp
    if tp.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp.size)] if tp.rank == 0 else None
    if tp.rank != 0:
        _state.sent_bytes += x.numel() * x.element_size()
    dist.gather(x, parts, tp.leader, group=tp.handle, async_op=True).wait(_state.timeout)
    return None if parts is None else torch.cat(parts, -1)


def broadcast_object(obj: object = None) -> object:
    """The driver's `obj` on every rank that mirrors its forwards (the driver passes it, the
    others receive it). The others wait as long as it takes (an idle server sends nothing); the
    driver gives up after the collective timeout, so a hung rank fails requests instead of
    hanging them."""
    return _broadcast_object(obj, _state.control)


def _broadcast_object(obj: object, g: Group) -> object:
    driver = g.rank == 0
    size = torch.zeros(1, dtype=torch.long)
    if driver:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size[0] = data.numel()
        _state.sent_bytes += data.numel()
    _wait(dist.broadcast(size, g.leader, group=g.handle, async_op=True), driver)
    if not driver:
        data = torch.empty(int(size[0]), dtype=torch.uint8)
    _wait(dist.broadcast(data, g.leader, group=g.handle, async_op=True), driver)
    return obj if driver else pickle.loads(data.numpy().tobytes())


def control_gather_object(obj: object) -> list | None:
    """Every mirroring rank's `obj` on the driver, in rank order (None on the others)."""
    g = _state.control
    out = [None] * g.size if g.rank == 0 else None
    dist.gather_object(obj, out, dst=g.leader, group=g.handle)
    return out


def control_scatter_object(objs: list | None = None) -> object:
    """The driver's objs[i] on the i-th mirroring rank (the others pass nothing)."""
    g = _state.control
    out = [None]
    dist.scatter_object_list(out, objs if g.rank == 0 else None, src=g.leader, group=g.handle)
    return out[0]


# ---- DP attention ----------------------------------------------------------------------------
def dp_rank() -> int:
    """This rank's attention data-parallel group (0 without DP attention)."""
    return _state.dp.rank


def dp_size() -> int:
    return _state.dp.size


def is_driver() -> bool:
    """Whether this rank runs a scheduler: global rank 0, or a DP attention group's first rank."""
    return _state.control.rank == 0


def dp_broadcast_object(obj: object = None) -> object:
    """Rank 0's `obj` on every group's driver (DP attention's per-step command)."""
    return _broadcast_object(obj, _state.dp)


def dp_gather_object(obj: object) -> list | None:
    """Every driver's `obj` on rank 0, in group order (None on the others)."""
    g = _state.dp_data
    out = [None] * g.size if g.rank == 0 else None
    dist.gather_object(obj, out, dst=g.leader, group=g.handle)
    return out


def mlp_gathers() -> bool:
    """Whether the ranks of the MLP group hold different tokens (DP attention, context
    parallel): each layer then gathers them before the MLP and keeps its own after."""
    return _state.dp.size > 1 or _state.cp.size > 1


def mlp_row_counts(contributed: int) -> list[int]:
    """Every rank's count of rows it brings to this forward's MLPs, in rank order (a rank whose
    rows another rank of its attention group brings brings 0; an idle group 0)."""
    counts = [torch.zeros(1, dtype=torch.long) for _ in range(_state.mlp.size)]
    dist.all_gather(counts, torch.tensor([contributed]), group=_state.mlp.handle)
    return [int(c) for c in counts]


def gather_rows(x: torch.Tensor, counts: list[int], group: Group) -> torch.Tensor:
    """Every rank's first counts[r] rows of x, concatenated in rank order, on every rank of
    `group` (an all-gather of rows padded to the largest count)."""
    padded = x.new_zeros(max(counts), *x.shape[1:])
    padded[:x.shape[0]] = x[:padded.shape[0]]
    parts = [torch.empty_like(padded) for _ in range(group.size)]
    _state.sent_bytes += padded.numel() * padded.element_size()
    dist.all_gather(parts, padded, group=group.handle)
    return torch.cat([p[:n] for p, n in zip(parts, counts)])


def mlp_gather(x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The MLP's input: every rank's brought rows, in rank order."""
    return gather_rows(x, counts, _state.mlp)


def mlp_scatter(y: torch.Tensor, counts: list[int], source: int) -> torch.Tensor:
    """This rank's rows of y, the MLP output over every rank's rows (already summed over the mlp
    group by its all-reduce, so the scatter is a slice): those rank `source` (its index in the
    mlp group: itself, or the rank of its attention group that brought its rows) brought."""
    start = sum(counts[:source])
    return y[start:start + counts[source]]


def group_leader_index() -> int:
    """The mlp-group index of this rank's attention group's first rank."""
    return _state.mlp.rank - _state.control.rank if mlp_gathers() else 0


def mlp_index() -> int:
    return _state.mlp.rank


def _wait(work, bounded: bool) -> None:
    if bounded:
        work.wait(_state.timeout)
    else:
        work.wait()
