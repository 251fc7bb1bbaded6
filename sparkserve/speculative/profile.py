"""Measure the target's step cost per number of verified tokens (for adaptive verify)."""
from __future__ import annotations

import time

from sparkserve.core.forward_batch import ForwardMode
from sparkserve.executor.model_runner import ModelRunner, ScheduledReq
from sparkserve.mem.cache_manager import KVCacheManager
from sparkserve.speculative.planner import StepCostTable


def measure_step_costs(runner: ModelRunner, cache: KVCacheManager, max_tokens: int, context: int = 64,
                       reps: int = 3) -> StepCostTable:
    """Time forwards of n = 1, 2, 4, ... tokens after a `context`-token prefix (median of reps),
    with the LM head over one row: a verify scores the rows after the anchor's only as far as
    its drafts are accepted (speculative/verify.py), so an unaccepted slot costs just its forward.
    Small forwards run slower right after other work (start-up, a large forward on torch's OpenMP
    threads, whose workers go on spinning), and a cost(1) above cost(2) made drafting look cheaper
    than plain decoding: so the sizes go from the largest down, each once untimed first, as a
    decode step follows decode steps. A forward over more tokens never costs less, so the table
    is made non-decreasing."""
    sizes = [1]
    while sizes[-1] < max_tokens:
        sizes.append(min(sizes[-1] * 2, max_tokens))
    total = context + sizes[-1]
    free = cache.allocator.free_slots
    if cache.split:                   # the windowed layers' slots are allocated alongside
        free = min(free, cache.allocator.swa_free_slots)
    free = min(free, cache.req_to_token.table.shape[1])   # and one request's positions fit its row
    if total > free:
        sizes = [n for n in sizes if context + n <= free] or [1]
    row = cache.req_to_token.alloc()
    slots = cache.allocator.alloc(0, context + sizes[-1], 0)
    cache.req_to_token.table[row, :len(slots)] = slots
    seconds = []
    try:
        median = {}
        for n in reversed(sizes):
            sr = ScheduledReq(row, context, [0] * n, slots[context:context + n], logit_rows=1)
            times = []
            for _ in range(reps + 1):
                fb = runner.build_batch(ForwardMode.VERIFY, [sr])
                t = time.perf_counter()
                runner.forward(fb)
                times.append(time.perf_counter() - t)
            median[n] = sorted(times[1:])[reps // 2]       # the first one warms up
        for n in sizes:
            seconds.append(max(median[n], seconds[-1] if seconds else 0.0))
    finally:
        cache.allocator.free(slots)
        cache.req_to_token.free(row)
    if len(sizes) == 1:
        sizes, seconds = [1, 2], [seconds[0], seconds[0]]
    return StepCostTable(sizes, seconds)
