"""--enable-priority-scheduling (SGLang's): the waiting queue admits higher `priority` values first
(lower first with --schedule-low-priority-values-first), first come, first served among equals;
without the flag a priority other than 0 is refused, never ignored. With one request running at a
time, the order requests finish in is the order they were admitted in."""
from __future__ import annotations

import pytest

from sparkserve import Engine
from sparkserve.core.req import Req
from sparkserve.core.sampling_state import RequestSamplingState
from sparkserve.sampling_params import SamplingParams
from tests.conftest import assert_no_kv_leak

PRIORITIES = [0, 5, -3, 5, 0, 9, -3, 1]


def finish_order(eng: Engine, priorities: list[int]) -> list[int]:
    """Queue one short request per priority (all before any step), run them; their finish order."""
    params = SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True)
    reqs = [Req(str(i), [3 + i, 7, 11], params, RequestSamplingState(params, [3 + i, 7, 11], set()),
                priority=p) for i, p in enumerate(priorities)]
    for r in reqs:
        eng.scheduler.add_request(r)
    order: list[int] = []
    while eng.scheduler.has_work():
        for r in eng.scheduler.step():
            if r.finished and int(r.rid) not in order:
                order.append(int(r.rid))
    assert_no_kv_leak(eng.scheduler.cache)
    return order


@pytest.mark.parametrize("low_first", [False, True])
def test_waiting_queue_orders_by_priority(llama_dir, low_first):
    eng = Engine(llama_dir, max_total_tokens=1024, max_running_requests=1, enable_priority_scheduling=True,
                 schedule_low_priority_values_first=low_first)
    sign = 1 if low_first else -1
    want = sorted(range(len(PRIORITIES)), key=lambda i: sign * PRIORITIES[i])    # stable: FCFS among equals
    assert finish_order(eng, PRIORITIES) == want
    # the public API takes it too, and a request with priority 0 still runs
    assert eng.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 1}, priority=4)["output_ids"]


def test_without_the_flag_the_queue_is_fcfs_and_priority_is_refused(llama_dir):
    eng = Engine(llama_dir, max_total_tokens=1024, max_running_requests=1)
    assert finish_order(eng, [0] * 5) == list(range(5))
    with pytest.raises(ValueError, match="priority: 3 needs enable_priority_scheduling"):
        eng.generate(input_ids=[1, 2, 3], priority=3)
    assert eng.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 1}, priority=0)["output_ids"]
    with pytest.raises(ValueError, match="--schedule-low-priority-values-first needs --enable-priority"):
        Engine(llama_dir, max_total_tokens=1024, schedule_low_priority_values_first=True)
