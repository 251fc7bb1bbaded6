"""Measure the target's step cost per number of verified tokens and of requests (for adaptive verify)."""
from __future__ import annotations

import statistics
import time

from sparkserve.core.forward_batch import ForwardMode
from sparkserve.executor.model_runner import ModelRunner, ScheduledReq
from sparkserve.mem.cache_manager import KVCacheManager
from sparkserve.speculative.planner import StepCostTable


def _doublings(top: int) -> list[int]:
    sizes = [1]
    while sizes[-1] < top:
        sizes.append(min(sizes[-1] * 2, top))
    return sizes


# Forwards of fewer tokens are cheap, and they are what the plans weigh against each other (a
# block of drafts, a few requests' decode step): timed over more rounds, taking turns.
SMALL_TOKENS = 32
SMALL_ROUNDS = 9
# Largest forward timed: beyond it the table goes on with its last slope. What a plan weighs is a
# few requests' blocks of drafts; a verify of hundreds of rows never pays, and timing forwards of
# 256 and 512 rows took most of the start-up's measurement (seconds on a loaded CPU).
MAX_MEASURED_TOKENS = 64


def _timed(runner: ModelRunner, batches: dict[int, list[ScheduledReq]], reps: int,
           floor: float = 0.0) -> list[float]:
    """Median seconds of each batch's forward, in the dict's key order, made non-decreasing from
    `floor`.
    Small forwards run slower right after other work (start-up, a large forward on torch's OpenMP
    threads, whose workers go on spinning), and a cost(1) above cost(2) made drafting look cheaper
    than plain decoding: so the batches run from the largest down, each once untimed first, as a
    decode step follows decode steps. The small ones then take turns over SMALL_ROUNDS rounds, and
    each is priced by its ratio to the smallest one's time in the same round (the median of the
    rounds' ratios): the machine's drift (a shared CPU's load comes and goes) slows a round's
    forwards alike and cancels in the ratio, so it does not decide what one more verified row
    seems to cost. A forward over more never costs less."""
    def once(key: int) -> float:
        fb = runner.build_batch(ForwardMode.VERIFY, batches[key])
        t = time.perf_counter()
        runner.forward(fb)
        runner.synchronize()
        return time.perf_counter() - t

    median = {}
    small = [key for key in reversed(list(batches)) if _tokens(batches[key]) < SMALL_TOKENS]
    for key in reversed(list(batches)):
        if key not in small:
            times = [once(key) for _ in range(reps + 1)]
            median[key] = sorted(times[1:])[reps // 2]       # the first one warms up
    rounds = [[once(key) for key in small] for _ in range(max(reps, SMALL_ROUNDS) + 1)][1:]
    if small:
        base = statistics.median(r[-1] for r in rounds)        # the smallest batch's own time
        for i, key in enumerate(small):
            median[key] = base * statistics.median(r[i] / r[-1] for r in rounds)
    out: list[float] = []
    for key in batches:
        out.append(max(median[key], out[-1] if out else floor))
    return out


def _tokens(reqs: list[ScheduledReq]) -> int:
    return sum(len(r.tokens) for r in reqs)


def measure_step_costs(runner: ModelRunner, cache: KVCacheManager, max_tokens: int, context: int = 64,
                       reps: int = 3, max_requests: int = 1) -> StepCostTable:
    """Time forwards of one request over n = 1, 2, 4, ... max_tokens tokens (at most
    MAX_MEASURED_TOKENS: larger ones are extrapolated), and decode steps of
    r = 1, 2, 4, ... max_requests requests, after a `context`-token prefix each, with the LM head
    over one row a request: a verify scores the rows after the anchor's only as far as its drafts
    are accepted (speculative/verify.py), so an unaccepted slot costs just its forward."""
    free = cache.allocator.free_slots
    if cache.split:                   # the windowed layers' slots are allocated alongside
        free = min(free, cache.allocator.swa_free_slots)
    top = min(max_tokens, MAX_MEASURED_TOKENS)
    sizes = [n for n in _doublings(top) if context + n <= min(free, cache.req_to_token.table.shape[1])]
    sizes = sizes or [1]
    counts = [r for r in _doublings(max_requests)
              if (r - 1) * (context + 1) <= free - context - sizes[-1] and r <= cache.req_to_token.available]
    rows, held = [], []
    try:
        for i in range(counts[-1]):
            rows.append(cache.req_to_token.alloc())
            n = context + (sizes[-1] if i == 0 else 1)
            held.append(cache.allocator.alloc(0, n, 0))
            cache.req_to_token.table[rows[-1], :n] = held[-1]
        one = {n: [ScheduledReq(rows[0], context, [0] * n, held[0][context:context + n], logit_rows=1)]
               for n in sizes}
        seconds = _timed(runner, one, reps)
        many = {r: [ScheduledReq(rows[i], context, [0], held[i][context:context + 1], logit_rows=1)
                    for i in range(r)] for r in counts if r > 1}
        request_seconds = [seconds[0], *_timed(runner, many, reps, seconds[0])] if many else []
    finally:
        for slots in held:
            cache.allocator.free(slots)
        for row in rows:
            cache.req_to_token.free(row)
    # n tokens in one forward never cost more than n forwards of one (each reads every weight):
    # a table above that is noise, and it would price every draft out.
    seconds = [min(s, n * seconds[0]) for n, s in zip(sizes, seconds)]
    if len(sizes) == 1:
        sizes, seconds = [1, 2], [seconds[0], seconds[0]]
    return StepCostTable(sizes, seconds, requests=[1, *many] if many else [],
                         request_seconds=request_seconds, measured=True)
