"""Engine.generate_many's `priority` (one for all, or one per prompt): with one request running
at a time and every prompt in flight, requests finish in priority order (first come, first served
among equals), as test_priority_scheduling's queue does, while results still come in input order
and equal a plain generate of each prompt; without enable_priority_scheduling it is refused."""
from __future__ import annotations

import pytest

from sparkserve import Engine
from tests.conftest import assert_no_kv_leak

PRIORITIES = [0, 5, -3, 5, 9, 1]
PROMPTS = [[3 + i, 7, 11] for i in range(len(PRIORITIES))]
PARAMS = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}


def run(eng: Engine, **kw) -> tuple[list[dict], list[int]]:
    """generate_many's results and the order (prompt index) the requests finished in."""
    finished: list[int] = []
    step = eng.scheduler.step

    def recording():
        out = step()
        finished.extend(PROMPTS.index(list(r.input_ids)) for r in out if r.finished)
        return out
    eng.scheduler.step = recording
    try:
        results = list(eng.generate_many(PROMPTS, PARAMS, max_in_flight=len(PROMPTS), **kw))
    finally:
        eng.scheduler.step = step
    return results, list(dict.fromkeys(finished))


def test_generate_many_runs_higher_priority_first(llama_dir):
    eng = Engine(llama_dir, max_total_tokens=1024, max_running_requests=1, enable_priority_scheduling=True)
    ref = [eng.generate(input_ids=p, sampling_params=PARAMS)["output_ids"] for p in PROMPTS]
    results, order = run(eng, priority=PRIORITIES)
    assert [r["output_ids"] for r in results] == ref
    assert order == sorted(range(len(PROMPTS)), key=lambda i: -PRIORITIES[i])
    _, fcfs = run(eng, priority=4)                     # one for all: first come, first served
    assert fcfs == list(range(len(PROMPTS)))
    with pytest.raises(ValueError, match="priority: 2 values for 6 prompts"):
        list(eng.generate_many(PROMPTS, PARAMS, priority=[1, 2]))
    assert_no_kv_leak(eng.scheduler.cache)


def test_generate_many_priority_needs_the_flag(llama_dir):
    eng = Engine(llama_dir, max_total_tokens=1024)
    with pytest.raises(ValueError, match="priority: 3 needs enable_priority_scheduling"):
        list(eng.generate_many(PROMPTS, PARAMS, priority=3))
    with pytest.raises(ValueError, match="priority: 5 needs enable_priority_scheduling"):
        list(eng.generate_many(PROMPTS, PARAMS, priority=PRIORITIES))
    assert [r["output_ids"] for r in eng.generate_many(PROMPTS[:2], PARAMS, priority=0)]
