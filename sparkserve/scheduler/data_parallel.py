"""DP attention's schedulers (SGLang's data-parallel controller and per-group schedulers).

Each attention group has its own Scheduler, KV pool and prefix cache, run by the group's first
rank (its driver); its other ranks mirror that driver's forwards as under plain tensor parallel.
The groups' forwards meet in every layer's MLP (layers/dp_attention.py), so the drivers step in
lock step: rank 0, whose process also serves (Engine, HTTP scheduler process), sends every other
driver one command per step — the requests it assigned to that group and the aborts — and each
driver then runs exactly one forward, an IDLE one when its group has nothing to run, and sends
back what its requests produced. Rank 0 keeps a copy of each request another group runs, updated
from those outputs, so the Engine and the scheduler process read requests as they do with one
scheduler. A request goes to the group it names (routed_dp_rank) or by --load-balance-method."""
from __future__ import annotations

import logging

from sparkserve.args import ServerArgs
from sparkserve.config import ModelConfig
from sparkserve.core.finish_reason import FINISH_ABORT
from sparkserve.core.req import Req
from sparkserve.distributed import parallel_state as ps
from sparkserve.frontend.tokenizer import Tokenizer
from sparkserve.messages import GenerateReq, ReqOutput, SchedulerLoad
from sparkserve.scheduler.req_outputs import OutputTracker, apply_output, message_from_req, req_from_message
from sparkserve.scheduler.runtime import build_scheduler
from sparkserve.scheduler.scheduler import Scheduler

log = logging.getLogger(__name__)


def step_in_lockstep(scheduler: Scheduler) -> list[Req]:
    """One step with exactly one forward: the scheduler's, or an IDLE one when it ran none."""
    before = scheduler.num_forwards
    advanced = scheduler.step() if scheduler.has_work() else []
    if scheduler.num_forwards == before:
        scheduler.runner.idle_forward()
    return advanced


class DataParallelScheduler:
    """Rank 0's view of every attention group: group 0's Scheduler is local, the others' run in
    their drivers' processes (run_dp_driver). Offers what the Engine and the scheduler process
    use of a Scheduler."""

    def __init__(self, local: Scheduler, dp_size: int, method: str):
        self.local = local
        self.dp_size = dp_size
        self.method = method
        self.remote: dict[str, tuple[Req, int]] = {}    # rid -> (request, group), until it finishes
        self.new: list[list[GenerateReq]] = [[] for _ in range(dp_size)]
        self.aborts: list[str] = []
        self.loads: list[SchedulerLoad] = [SchedulerLoad() for _ in range(dp_size)]
        self.next_group = 0
        self.eos_ids = local.eos_ids
        self.device = local.device
        self.max_sequence_tokens = local.max_sequence_tokens
        self.spec = local.spec
        self.cache = local.cache

    # ---- requests -----------------------------------------------------------------------------
    def queued(self, group: int) -> int:
        """Requests `group` holds now, queued or running (shortest_queue compares these)."""
        if group == 0:
            return self.local.num_running + len(self.local.waiting)
        return sum(1 for _, g in self.remote.values() if g == group)

    def pick_group(self, req: Req) -> int:
        if req.routed_dp_rank is not None:
            if not 0 <= req.routed_dp_rank < self.dp_size:
                raise ValueError(f"routed_dp_rank {req.routed_dp_rank}: use 0..{self.dp_size - 1} "
                                 f"(--dp-size {self.dp_size})")
            return req.routed_dp_rank
        if self.method == "shortest_queue":
            return min(range(self.dp_size), key=self.queued)
        group, self.next_group = self.next_group, (self.next_group + 1) % self.dp_size
        return group

    def add_request(self, req: Req) -> bool:
        group = self.pick_group(req)
        if group == 0:
            return self.local.add_request(req)
        if Scheduler.ends_at_once(req):
            return False
        self.new[group].append(message_from_req(req))
        self.remote[req.rid] = (req, group)
        return True

    def abort(self, rid: str) -> bool:
        held = self.remote.pop(rid, None)
        if held is None:
            return self.local.abort(rid)
        held[0].finished_reason = FINISH_ABORT()
        self.aborts.append(rid)
        return True

    def has_work(self) -> bool:
        return self.local.has_work() or bool(self.remote) or bool(self.aborts)

    @property
    def num_running(self) -> int:
        return self.load().num_running_reqs

    # ---- steps --------------------------------------------------------------------------------
    def step(self) -> list[Req]:
        """Every group's step; the requests that advanced, in every group."""
        ps.dp_broadcast_object(("step", self.new, self.aborts))
        self.new, self.aborts = [[] for _ in range(self.dp_size)], []
        advanced = step_in_lockstep(self.local)
        reports = ps.dp_gather_object(None)
        for group, (outputs, load) in enumerate(reports[1:], 1):
            self.loads[group] = load
            for out in outputs:
                held = self.remote.get(out.rid)
                if held is None:              # aborted here since
                    continue
                apply_output(held[0], out)
                if held[0].finished:
                    del self.remote[out.rid]
                advanced.append(held[0])
        return advanced

    def flush_cache(self) -> bool:
        if self.has_work():
            return False
        ps.dp_broadcast_object(("flush",))
        flushed = ps.dp_gather_object(self.local.flush_cache())
        return all(flushed)

    def load(self) -> SchedulerLoad:
        """Every group's load, summed (the remote ones as of the last step)."""
        total = self.local.load()
        for load in self.loads[1:]:
            for name in ("num_running_reqs", "num_queue_reqs", "num_used_tokens", "num_cached_tokens",
                         "max_total_num_tokens", "num_retractions", "num_preemptions"):
                setattr(total, name, getattr(total, name) + getattr(load, name))
            for k, v in load.spec_accept_hist.items():
                total.spec_accept_hist[k] = total.spec_accept_hist.get(k, 0) + v
        return total

    def close(self) -> None:
        """The other drivers stop (and their ranks), then this group's."""
        try:
            ps.dp_broadcast_object(None)
        except RuntimeError as e:             # a driver is gone already
            log.warning("DP attention drivers could not be told to stop: %s", e)
        self.local.close()


def build_driver_scheduler(args: ServerArgs, tokenizer: Tokenizer | None
                           ) -> tuple[Scheduler | DataParallelScheduler, ModelConfig]:
    """Rank 0's scheduler: with DP attention, every group's through group 0's."""
    scheduler, cfg = build_scheduler(args, tokenizer)
    dp = args.parallel_config().dp_size
    if dp == 1:
        return scheduler, cfg
    return DataParallelScheduler(scheduler, dp, args.load_balance_method), cfg


def run_dp_driver(scheduler: Scheduler) -> None:
    """A group's driver other than rank 0: take rank 0's commands until told to stop."""
    tracker = OutputTracker()
    while (msg := ps.dp_broadcast_object()) is not None:
        if msg[0] == "flush":
            ps.dp_gather_object(scheduler.flush_cache())
            continue
        _, new, aborts = msg
        outputs: list[ReqOutput] = []
        for m in new[ps.dp_rank()]:
            req = req_from_message(m, scheduler.eos_ids)
            if scheduler.add_request(req):
                tracker.hold(req)
        for rid in aborts:
            if tracker.drop(rid) is not None:
                scheduler.abort(rid)
        outputs += [tracker.output(r) for r in step_in_lockstep(scheduler)]
        ps.dp_gather_object((outputs, scheduler.load()))
    scheduler.close()
