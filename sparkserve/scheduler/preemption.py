"""Which running request gives way: to a waiting one of higher priority (SGLang's priority
preemption), or when decode memory runs out (retraction). Either way it goes back to the waiting
queue with its output so far and its KV in the prefix cache, and resumes from there."""
from __future__ import annotations

from sparkserve.core.req import Req
from sparkserve.scheduler.waiting_queue import urgency


def lowest_ranked(running: list[Req], low_first: bool) -> Req:
    """The running request that ranks lowest, the newest among equals (it has the least work done)."""
    return min(reversed(running), key=lambda r: urgency(r, low_first))


def preemption_victim(running: list[Req], req: Req, threshold: int, low_first: bool) -> Req | None:
    """The running request waiting `req` preempts: the lowest-ranked one, when `req` outranks it by
    more than `threshold` (--priority-scheduling-preemption-threshold); else None. A threshold
    >= 0 means a preempted request never preempts back the one it gave way to."""
    if not running:
        return None
    victim = lowest_ranked(running, low_first)
    return victim if urgency(req, low_first) - urgency(victim, low_first) > threshold else None
