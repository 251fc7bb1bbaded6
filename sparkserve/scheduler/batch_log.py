"""One info line per scheduled batch, as SGLang logs them, so a user sees the server working:
every prefill batch, and one decode batch in `decode_log_interval` with the generation rate
since the last decode line."""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sparkserve.scheduler.scheduler import Scheduler

log = logging.getLogger("sparkserve.scheduler")


class BatchLog:
    def __init__(self, decode_log_interval: int):
        self.interval = max(1, decode_log_interval)
        self.decode_steps = 0
        self.tokens = 0
        self.since = time.monotonic()

    @staticmethod
    def _usage(sched: "Scheduler") -> tuple[int, float]:
        cache = sched.cache
        used = cache.num_slots - cache.available_tokens
        return used, used / cache.num_slots if cache.num_slots else 0.0

    def prefill(self, sched: "Scheduler", batch: list) -> None:
        if not log.isEnabledFor(logging.INFO):
            return
        new_tokens = sum(n for _, _, n in batch)
        cached = sum(req.cached_tokens for req, _, _ in batch)
        _, usage = self._usage(sched)
        log.info("Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
                 "#running-req: %d, #queue-req: %d", len(batch), new_tokens, cached, usage,
                 len(sched.running), len(sched.waiting))

    def decode(self, sched: "Scheduler", new_tokens: int) -> None:
        self.decode_steps += 1
        self.tokens += new_tokens
        if self.decode_steps % self.interval or not log.isEnabledFor(logging.INFO):
            return
        now = time.monotonic()
        rate = self.tokens / max(now - self.since, 1e-9)
        self.tokens, self.since = 0, now
        used, usage = self._usage(sched)
        log.info("Decode batch. #running-req: %d, #token: %d, token usage: %.2f, gen throughput (token/s): "
                 "%.2f, #queue-req: %d", len(sched.running), used, usage, rate, len(sched.waiting))
