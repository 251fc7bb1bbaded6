"""The adaptive planner's step cost table (speculative/profile.py): what it measures must rank
sizes as serving sees them, or the planner drafts where plain decoding is faster."""
from __future__ import annotations

import pytest

from sparkserve.mem.cache_manager import KVCacheManager
from sparkserve.speculative import profile
from sparkserve.speculative.profile import measure_step_costs

MS = 1e-3


class Clock:
    """The time the measurement reads, moved only by the runners' forwards: what a loaded test
    machine's scheduler does to a busy loop cannot move the table."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


CLOCK = Clock()


@pytest.fixture(autouse=True)
def virtual_clock(monkeypatch):
    monkeypatch.setattr(profile, "time", CLOCK)


class WarmingRunner:
    """A forward of n tokens takes 10 ms + 0.5 ms per token + 5 ms per request after the first,
    and 20 ms more within 60 ms of the runner's start or of the end of a large forward (>= 32
    tokens: torch's OpenMP workers go on spinning beside the small forward's threads): the
    behaviour a CPU showed."""

    def __init__(self):
        self.busy_until = CLOCK.now + 60 * MS

    def build_batch(self, mode, reqs):
        return sum(len(r.tokens) for r in reqs), len(reqs)

    def forward(self, batch):
        n, requests = batch
        slow = CLOCK.now < self.busy_until
        CLOCK.now += (10 + 0.5 * n + 5 * (requests - 1) + (20 if slow else 0)) * MS
        if n >= 32:
            self.busy_until = CLOCK.now + 60 * MS

    def synchronize(self):
        pass


def test_step_costs_rank_sizes_as_decode_steps_see_them():
    cache = KVCacheManager(1024, 1, 4, 1024, disable_radix_cache=True)
    free, rows = cache.allocator.free_slots, cache.req_to_token.available
    table = measure_step_costs(WarmingRunner(), cache, max_tokens=128, reps=3, max_requests=4)
    assert table.tokens == [1, 2, 4, 8, 16, 32, 64, 128]
    assert table.seconds == sorted(table.seconds)                    # more tokens never cost less
    assert table.cost(1) < 20 * MS             # 10.5 ms, not the 30.5 ms at start or after a large one
    # Decode steps of 1, 2, 4 requests: 10.5, 16, 27 ms, where one request's 4 tokens take 12 ms.
    assert table.requests == [1, 2, 4] and table.request_seconds == sorted(table.request_seconds)
    assert abs(table.request_seconds[2] - 27 * MS) < 6 * MS
    assert table.request_seconds[2] > table.cost(4) + 8 * MS
    # 4 requests verifying 3 drafts in all: their decode step plus 3 rows
    assert abs(table.batch_cost(4, 7) - (table.request_seconds[2] + table.cost(4) - table.cost(1))) < 1e-12
    assert table.batch_cost(1, 5) == table.cost(5)
    assert cache.allocator.free_slots == free and cache.req_to_token.available == rows   # all went back


def test_table_file_round_trip_and_refusal(tmp_path):
    """A table saved with its decode steps of several requests loads the same; request lists of
    different lengths are refused, naming them; a table without them (an older file) takes R
    requests' decode step as one request's R tokens."""
    import json

    from sparkserve.speculative.planner import StepCostTable
    table = StepCostTable([1, 2, 8], [0.01, 0.012, 0.02], 0.001, [1, 4], [0.01, 0.03])
    path = str(tmp_path / "sps.json")
    table.save(path)
    assert StepCostTable.load(path) == table
    assert table.batch_cost(4, 6) == pytest.approx(0.03 + table.cost(3) - table.cost(1))
    with open(path, "w") as f:
        json.dump({"tokens": [1, 2], "seconds": [0.01, 0.02], "requests": [1, 2],
                   "request_seconds": [0.01]}, f)
    with pytest.raises(ValueError, match="request_seconds"):
        StepCostTable.load(path)
    old = StepCostTable([1, 2, 8], [0.01, 0.012, 0.02])
    assert old.batch_cost(4, 4) == old.cost(4)


class DriftingRunner(WarmingRunner):
    """As WarmingRunner from the start, but a third of the forwards, in runs of four, take 8 ms
    more: another process takes the core now and then, whatever size is being timed."""

    def __init__(self):
        super().__init__()
        self.busy_until = 0.0
        self.calls = 0

    def forward(self, batch):
        slow = (self.calls // 4) % 3 == 0
        self.calls += 1
        super().forward(batch)
        CLOCK.now += 8 * MS if slow else 0


def test_small_sizes_take_turns_so_drift_does_not_price_a_row():
    """The sizes a batch-1 plan compares (one request's forward over 1..16 tokens) are timed in
    turns: a run of slow forwards lands on every size alike, so one more row costs what it does
    (0.5 ms here), not a spell of load that fell on one size's repetitions."""
    cache = KVCacheManager(1024, 1, 4, 1024, disable_radix_cache=True)
    table = measure_step_costs(DriftingRunner(), cache, max_tokens=16, reps=3)
    assert table.tokens == [1, 2, 4, 8, 16]
    for n, s in zip(table.tokens, table.seconds):
        assert abs(s - (10 + 0.5 * n) * MS) < 2 * MS, (n, s)
