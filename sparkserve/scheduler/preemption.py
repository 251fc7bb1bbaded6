"""Which running request gives way: to a waiting one of higher priority (SGLang's priority
preemption, under --enable-priority-scheduling: when the running slots or the KV pool are full,
the lowest-ranked running request, the newest among equals, if the waiting one outranks it by more
than --priority-scheduling-preemption-threshold), or when decode memory runs out (retraction: the
newest, or under priority scheduling the lowest-ranked). Either way it goes back to the waiting
queue with its output so far and its KV in the prefix cache, and resumes from there."""
from __future__ import annotations

from typing import TYPE_CHECKING

from sparkserve.core.req import Req
from sparkserve.scheduler.waiting_queue import requeue, urgency

if TYPE_CHECKING:
    from sparkserve.scheduler.scheduler import Scheduler


def lowest_ranked(running: list[Req], low_first: bool) -> Req:
    """The running request that ranks lowest, the newest among equals (it has the least work done)."""
    return min(reversed(running), key=lambda r: urgency(r, low_first))


def preemption_victim(running: list[Req], req: Req, threshold: int, low_first: bool) -> Req | None:
    """The running request waiting `req` preempts: the lowest-ranked one, when `req` outranks it by
    more than `threshold`; else None. A threshold >= 0 means a preempted request never preempts
    back the one it gave way to."""
    if not running:
        return None
    victim = lowest_ranked(running, low_first)
    return victim if urgency(req, low_first) - urgency(victim, low_first) > threshold else None


def running_slot(sched: Scheduler, req: Req, batch) -> bool:
    """Whether waiting `req` (the head) may join the running requests: a slot is free, or it
    preempts a running request for one (not while its grammar compiles or it would wait a step for
    a shared prefix anyway)."""
    if len(sched.running) + len(batch) < sched.cfg.max_running_requests:
        return True
    if (req.grammar is not None and not req.grammar.ready) or sched._shares_prefix_in_batch(req, batch):
        return False
    return preempt_for(sched, req)


def preempt_for(sched: Scheduler, req: Req) -> bool:
    """Preempt the running request `req` outranks by more than the threshold: back to the waiting
    queue (behind `req`), its KV to the prefix cache, its output kept. False when there is none."""
    cfg = sched.cfg
    if cfg.preemption_threshold is None:
        return False
    victim = preemption_victim(sched.running, req, cfg.preemption_threshold, cfg.low_priority_first)
    if victim is None:
        return False
    sched.running.remove(victim)
    sched._release(victim)
    sched.num_preemptions += 1
    requeue(sched.waiting, victim, True, cfg.low_priority_first)
    return True


def ensure_decode_memory(sched: Scheduler, speculating: set[Req]) -> set[Req]:
    """Retract running requests (the newest; under priority scheduling the lowest-ranked) until
    every running one can take its next tokens; when memory is short, requests drop their drafts
    first. Returns who still speculates."""
    cache, cfg = sched.cache, sched.cfg
    page = cache.allocator.page_size
    extra = sched.spec.num_drafts if sched.spec is not None else 0
    speculating = set(speculating)
    while True:
        need = page * sum(cache.pages_needed(r, 1 + (extra if r in speculating else 0))
                          for r in sched.running)
        if cache.room(need):
            return speculating
        if speculating:                   # plain decode needs fewer slots than a verify
            speculating.pop()
            continue
        if sched.chunked is not None:     # a half-prefilled request pins KV too: retract it first
            victim, sched.chunked = sched.chunked, None
        elif len(sched.running) > 1:
            victim = lowest_ranked(sched.running, cfg.low_priority_first) if cfg.priority_scheduling \
                else sched.running[-1]
            sched.running.remove(victim)
        else:
            return speculating
        sched._release(victim)
        sched.num_retractions += 1
        requeue(sched.waiting, victim, cfg.priority_scheduling, cfg.low_priority_first)
