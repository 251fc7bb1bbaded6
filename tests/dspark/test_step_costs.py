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
    assert table.tokens == [1, 2, 4, 8, 16, 32, 64]                  # (128: extrapolated)
    assert table.seconds == sorted(table.seconds)                    # more tokens never cost less
    assert table.cost(1) < 20 * MS             # 10.5 ms, not the 30.5 ms at start or after a large one
    # Decode steps of 1, 2, 4 requests: 10.5, 16, 27 ms, where one request's 4 tokens take 12 ms.
    assert table.requests == [1, 2, 4] and table.request_seconds == sorted(table.request_seconds)
    assert abs(table.request_seconds[2] - 27 * MS) < 6 * MS
    assert table.request_seconds[2] > table.cost(4) + 8 * MS
    # 4 requests verifying 3 drafts in all: their decode step plus 3 rows
    assert abs(table.batch_cost(4, 7) - (table.request_seconds[2] + table.cost(4) - table.cost(1))) < 1e-12
    assert table.batch_cost(1, 5) == pytest.approx(table.cost(5))
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


class LoadedRunner(WarmingRunner):
    """Forwards of 2 ms + 0.1 ms a token + 1 ms a request after the first, on a shared CPU: the
    other processes' load comes and goes in spells of 1..6 forwards, each spell slowing every
    forward by 1x, 1.5x or 3x, with 5% jitter (seeded)."""

    def __init__(self, seed: int):
        import random
        super().__init__()
        self.busy_until, self.rng, self.left, self.load = 0.0, random.Random(seed), 0, 1.0

    def forward(self, batch):
        n, requests = batch
        if self.left <= 0:
            self.left, self.load = self.rng.randint(1, 6), self.rng.choice([1, 1, 1.5, 3])
        self.left -= 1
        CLOCK.now += (2 + 0.1 * n + (requests - 1)) * MS * self.load * self.rng.uniform(0.95, 1.05)


def test_noisy_load_does_not_price_the_rows():
    """Under a load that comes and goes (the machine is shared), what one more verified row costs
    relative to a decode step — the ratio every plan weighs — comes out within 10% of the truth
    (cost(2) / cost(1) = 2.2 / 2.1) for every one of 20 seeds: each size is priced by its ratio to
    the smallest one in the same round, so a spell of load that hits some sizes' repetitions more
    than others' cancels. (Medians of each size's own times put cost(2) at up to ~2.8x cost(1)
    here, and drafting then never looks worth it.) No size costs more than as many forwards of
    one token."""
    truth = 2.2 / 2.1
    for seed in range(20):
        cache = KVCacheManager(1024, 1, 4, 1024, disable_radix_cache=True)
        table = measure_step_costs(LoadedRunner(seed), cache, max_tokens=16, reps=3)
        assert abs(table.cost(2) / table.cost(1) / truth - 1) < 0.1, (seed, table.seconds)
        assert all(s <= n * table.seconds[0] + 1e-12 for n, s in zip(table.tokens, table.seconds))


def test_measurement_stops_at_the_largest_plannable_forward():
    """max_tokens 512 (64 requests' blocks) times one request's forwards up to 64 tokens only,
    and the table goes on beyond with its last slope; the forwards timed stay few (start-up)."""
    cache = KVCacheManager(4096, 1, 8, 4096, disable_radix_cache=True)
    runner = WarmingRunner()
    calls = []
    forward = runner.forward
    runner.forward = lambda b: calls.append(b) or forward(b)
    table = measure_step_costs(runner, cache, max_tokens=512, reps=3)
    assert table.tokens == [1, 2, 4, 8, 16, 32, 64]
    slope = (table.cost(64) - table.cost(32)) / 32
    assert table.cost(512) == pytest.approx(table.cost(64) + 448 * slope)
    assert max(n for n, _ in calls) == 64 and len(calls) < 80, len(calls)
