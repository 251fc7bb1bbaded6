"""The scheduler's waiting queue: its order (first come, first served, or by SGLang's `priority`
under --enable-priority-scheduling; admission takes the head, so the order is set when a request
joins), and the shared-prefix test by which a request waits a step (in-batch prefix caching)."""
from __future__ import annotations

from collections import deque

from sparkserve.core.req import Req


def urgency(req: Req, low_first: bool) -> int:
    """How soon `req` runs under priority scheduling: higher values first, or lower ones with
    --schedule-low-priority-values-first."""
    return -req.priority if low_first else req.priority


def enqueue(waiting: deque[Req], req: Req, by_priority: bool, low_first: bool) -> None:
    """At the back of the queue; by priority, behind every waiting request that ranks as high or
    higher (first come, first served among equals)."""
    if not by_priority:
        waiting.append(req)
        return
    i = len(waiting)
    while i > 0 and urgency(waiting[i - 1], low_first) < urgency(req, low_first):
        i -= 1
    waiting.insert(i, req)


def requeue(waiting: deque[Req], req: Req, by_priority: bool, low_first: bool) -> None:
    """A request that was running (retracted or preempted) goes back ahead of every waiting one it
    ranks as high as: the front, first come first served; by priority, behind those that outrank it."""
    if not by_priority:
        waiting.appendleft(req)
        return
    i = 0
    while i < len(waiting) and urgency(waiting[i], low_first) > urgency(req, low_first):
        i += 1
    waiting.insert(i, req)


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
