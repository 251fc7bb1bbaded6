"""The adaptive planner's step cost table (speculative/profile.py): what it measures must rank
sizes as serving sees them, or the planner drafts where plain decoding is faster."""
from __future__ import annotations

import time

from sparkserve.mem.cache_manager import KVCacheManager
from sparkserve.speculative.profile import measure_step_costs

MS = 1e-3


class WarmingRunner:
    """A forward of n tokens takes 10 ms + 0.5 ms per token, and 20 ms more within 60 ms of the
    runner's start or of the end of a large forward (>= 32 tokens: torch's OpenMP workers go on
    spinning beside the small forward's threads): the behaviour a CPU showed, scaled up so that
    a busy test machine's scheduling noise stays small beside it."""

    def __init__(self):
        self.busy_until = time.perf_counter() + 60 * MS

    def build_batch(self, mode, reqs):
        return len(reqs[0].tokens)

    def forward(self, n):
        slow = time.perf_counter() < self.busy_until
        end = time.perf_counter() + (10 + 0.5 * n + (20 if slow else 0)) * MS
        while time.perf_counter() < end:
            pass
        if n >= 32:
            self.busy_until = end + 60 * MS


def test_step_costs_rank_sizes_as_decode_steps_see_them():
    cache = KVCacheManager(1024, 1, 2, 1024, disable_radix_cache=True)
    free = cache.allocator.free_slots
    table = measure_step_costs(WarmingRunner(), cache, max_tokens=128, reps=3)
    assert table.tokens == [1, 2, 4, 8, 16, 32, 64, 128]
    assert table.seconds == sorted(table.seconds)                    # more tokens never cost less
    assert table.cost(1) < 20 * MS             # 10.5 ms, not the 30.5 ms at start or after a large one
    assert cache.allocator.free_slots == free                        # the slots went back
