"""The scheduler's waiting queue: its order (first come, first served, or by SGLang's `priority`
under --enable-priority-scheduling; admission takes the head, so the order is set when a request
joins), and the shared-prefix test by which a request waits a step (in-batch prefix caching)."""
from __future__ import annotations

from collections import deque

from sparkserve.core.req import Req


def enqueue(waiting: deque[Req], req: Req, by_priority: bool, low_first: bool) -> None:
    """At the back of the queue; by priority, behind every waiting request that ranks as high or
    higher (higher values first, or lower ones with `low_first`; first come, first served among
    equals). Retracted requests go back to the front elsewhere: they were running."""
    if not by_priority:
        waiting.append(req)
        return
    sign = 1 if low_first else -1
    i = len(waiting)
    while i > 0 and sign * waiting[i - 1].priority > sign * req.priority:
        i -= 1
    waiting.insert(i, req)


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
