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


def preemption_victims(running: list[Req], req: Req, threshold: int, low_first: bool) -> list[Req]:
    """The running requests waiting `req` may preempt, the first to go first: those it outranks by
    more than `threshold`, lowest-ranked first (the newest among equals). A threshold >= 0 means
    a preempted request never preempts back the one it gave way to."""
    order = sorted(reversed(running), key=lambda r: urgency(r, low_first))    # stable: newest first
    return [r for r in order if urgency(req, low_first) - urgency(r, low_first) > threshold]


def slot_free(sched: Scheduler, batch) -> bool:
    return len(sched.running) + len(batch) < sched.cfg.max_running_requests


def running_slot(sched: Scheduler, req: Req, batch) -> bool:
    """Whether waiting `req` (the head) may go on to admission: a running slot is free, or there is
    a running request it could preempt for one (not while its grammar compiles or it would wait a
    step for a shared prefix anyway). Nothing is preempted here: `preempt_for` does, once the KV
    the request needs is known."""
    if slot_free(sched, batch):
        return True
    if (req.grammar is not None and not req.grammar.ready) or sched._shares_prefix_in_batch(req, batch):
        return False
    cfg = sched.cfg
    return cfg.preemption_threshold is not None and bool(
        preemption_victims(sched.running, req, cfg.preemption_threshold, cfg.low_priority_first))


def preempt_for(sched: Scheduler, req: Req, batch, need: int, slot: bool = True) -> bool:
    """Make room for waiting `req` by preempting the fewest running requests it outranks by more
    than the threshold (lowest-ranked first): after their release it must have a running slot
    (`slot`: it is to join the running ones), a table row, and `need` KV slots while every other
    running request (and each of `batch`, admitted this step) keeps its decode reserve. When even
    all of them would not do, none is preempted: False. The preempted go back to the waiting
    queue (behind `req`), their KV to the prefix cache, their output kept."""
    cfg, cache = sched.cfg, sched.cache
    if cfg.preemption_threshold is None:
        return False
    candidates = preemption_victims(sched.running, req, cfg.preemption_threshold, cfg.low_priority_first)
    others = sched.running + [item[0] for item in batch]
    need_one = (slot and not slot_free(sched, batch)) or req.row is None
    victims: list[Req] = []
    while True:
        if victims or not need_one:
            rest = [(r, r.params.max_new_tokens - len(r.output_ids)) for r in others if r not in victims]
            if cache.room(need, rest, cache.freed_by(victims)):
                break
        if len(victims) == len(candidates):
            return False
        victims.append(candidates[len(victims)])
    if not victims:                   # it fits already (the caller's own allocation lacked no room)
        return False
    for victim in victims:
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
