"""Priority preemption (SGLang's, under --enable-priority-scheduling): a waiting request that
finds the running slots or the KV pool full preempts a running one it outranks by more than
--priority-scheduling-preemption-threshold. The preempted request goes back to the queue with
its output so far and resumes where it stopped: its tokens equal transformers' greedy decoding,
its outputs as a caller receives them (OutputTracker) hold each token once, and the pool ends
where it started. --disable-priority-preemption (or a threshold the gap does not beat) keeps the
old behaviour: the high-priority request waits until the long one finishes."""
from __future__ import annotations

import pytest
from conftest import assert_no_kv_leak, hf_greedy

from sparkserve import Engine
from sparkserve.core.req import Req
from sparkserve.core.sampling_state import RequestSamplingState
from sparkserve.sampling_params import SamplingParams
from sparkserve.scheduler.req_outputs import OutputTracker

LOW_PROMPT, LOW_TOKENS = [5, 9, 13, 17, 21, 25, 29, 33], 40
HIGH_PROMPT, HIGH_TOKENS = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55], 4


SEEDED = dict(temperature=1.0, top_p=0.9, seed=11)      # a sampled request with its own stream


def make_req(rid: str, prompt: list[int], n: int, priority: int, **sp) -> Req:
    params = SamplingParams(max_new_tokens=n, ignore_eos=True, **{"temperature": 0, **sp})
    return Req(rid, list(prompt), params, RequestSamplingState(params, prompt, set()), priority=priority)


def run_low_then_high(eng: Engine, high_priority: int, low_first: bool = False, **low_sp) -> dict:
    """A long low-priority request runs; after 30 of its tokens a short high-priority one arrives.
    Returns each request's tokens, the tokens a caller received, the step of high's first token
    and of low's finish."""
    sched = eng.scheduler
    start_free = sched.cache.allocator.free_slots + sched.cache.radix.evictable_size
    low = make_req("low", LOW_PROMPT, LOW_TOKENS, 0, **low_sp)
    high = make_req("high", HIGH_PROMPT, HIGH_TOKENS, high_priority)
    tracker, received = OutputTracker(), {"low": [], "high": []}
    tracker.hold(low)
    sched.add_request(low)
    steps, first_high, low_done = 0, None, None
    while sched.has_work():
        if len(low.output_ids) >= 30 and high.rid not in tracker.sent and not high.finished:
            tracker.hold(high)
            sched.add_request(high)
        for r in sched.step():
            received[r.rid] += tracker.output(r).new_token_ids
        steps += 1
        if first_high is None and high.output_ids:
            first_high = steps
        if low_done is None and low.finished:
            low_done = steps
    assert_no_kv_leak(sched.cache)
    assert sched.cache.allocator.free_slots + sched.cache.radix.evictable_size == start_free
    return {"low": low.output_ids, "high": high.output_ids, "received": received,
            "first_high": first_high, "low_done": low_done}


@pytest.fixture(scope="module")
def reference(hf_tiny):
    return {"low": hf_greedy(hf_tiny["llama"], LOW_PROMPT, LOW_TOKENS),
            "high": hf_greedy(hf_tiny["llama"], HIGH_PROMPT, HIGH_TOKENS)}


# full: one running slot (max_running_requests 1); kv: slots to spare but a pool that holds
# low's 38 tokens with too little room left for high's prompt
FULL = {"slots": dict(max_total_tokens=1024, max_running_requests=1),
        "kv": dict(max_total_tokens=LOW_TOKENS + len(LOW_PROMPT), max_running_requests=8)}


@pytest.mark.parametrize("full", list(FULL))
@pytest.mark.parametrize("low_first", [False, True])
def test_high_priority_preempts_and_the_preempted_request_resumes(llama_dir, reference, full, low_first):
    eng = Engine(llama_dir, enable_priority_scheduling=True, schedule_low_priority_values_first=low_first,
                 **FULL[full])
    out = run_low_then_high(eng, -20 if low_first else 20, low_first)
    assert eng.scheduler.num_preemptions == 1
    assert out["first_high"] < out["low_done"]               # it did not wait for the long one
    assert out["low"] == reference["low"] and out["high"] == reference["high"]
    assert out["received"] == {"low": reference["low"], "high": reference["high"]}   # each token once


@pytest.mark.parametrize("full", list(FULL))
@pytest.mark.parametrize("flags", [dict(disable_priority_preemption=True),
                                   dict(priority_scheduling_preemption_threshold=20)])
def test_without_preemption_the_high_priority_request_waits(llama_dir, reference, full, flags):
    """The same requests with preemption off, or a gap (20) the threshold does not beat."""
    eng = Engine(llama_dir, enable_priority_scheduling=True, **flags, **FULL[full])
    out = run_low_then_high(eng, 20)
    assert eng.scheduler.num_preemptions == 0
    assert out["first_high"] > out["low_done"]
    assert out["low"] == reference["low"] and out["high"] == reference["high"]


def test_retraction_under_priority_takes_the_lowest_priority_first(llama_dir, reference):
    """KV running out while decoding retracts the lowest-priority request, not the newest one."""
    eng = Engine(llama_dir, enable_priority_scheduling=True, disable_priority_preemption=True,
                 max_total_tokens=len(LOW_PROMPT) + len(HIGH_PROMPT) + 30, max_running_requests=8)
    sched = eng.scheduler
    low, high = make_req("low", LOW_PROMPT, LOW_TOKENS, 0), make_req("high", HIGH_PROMPT, HIGH_TOKENS + 20, 5)
    sched.add_request(low)
    sched.step()
    sched.add_request(high)                      # the newest running request
    while sched.has_work():
        sched.step()
        assert high.finished or high in sched.running
    assert sched.num_retractions > 0
    assert low.output_ids == reference["low"]
    assert_no_kv_leak(sched.cache)


@pytest.mark.parametrize("flags,message", [
    (dict(disable_priority_preemption=True),
     "--disable-priority-preemption needs --enable-priority-scheduling"),
    (dict(priority_scheduling_preemption_threshold=3),
     "--priority-scheduling-preemption-threshold needs --enable-priority-scheduling"),
    (dict(enable_priority_scheduling=True, disable_priority_preemption=True,
          priority_scheduling_preemption_threshold=3),
     "--priority-scheduling-preemption-threshold with --disable-priority-preemption"),
    (dict(enable_priority_scheduling=True, priority_scheduling_preemption_threshold=-1),
     "--priority-scheduling-preemption-threshold must be >= 0"),
])
def test_invalid_flag_combinations_fail_at_start_up(llama_dir, flags, message):
    with pytest.raises(ValueError, match=message):
        Engine(llama_dir, max_total_tokens=256, **flags)


def run_alone(eng: Engine, req: Req) -> list[int]:
    eng.scheduler.add_request(req)
    while eng.scheduler.has_work():
        eng.scheduler.step()
    return req.output_ids


@pytest.mark.parametrize("full", list(FULL))
def test_a_preempted_seeded_sampled_request_keeps_its_random_stream(llama_dir, full):
    """A seeded sampled request gives the same tokens whether or not it was preempted: its
    generator goes on from where it stood (the resumed request does not draw afresh)."""
    alone = run_alone(Engine(llama_dir, **FULL[full]), make_req("low", LOW_PROMPT, LOW_TOKENS, 0, **SEEDED))
    eng = Engine(llama_dir, enable_priority_scheduling=True, **FULL[full])
    out = run_low_then_high(eng, 20, **SEEDED)
    assert eng.scheduler.num_preemptions == 1 and out["first_high"] < out["low_done"]
    assert out["low"] == alone and out["received"]["low"] == alone
    other = run_alone(Engine(llama_dir, **FULL[full]),
                      make_req("low", LOW_PROMPT, LOW_TOKENS, 0, **dict(SEEDED, seed=12)))
    assert other != alone                          # the seed decides the tokens


def test_a_retracted_seeded_sampled_request_keeps_its_random_stream(llama_dir):
    kw = dict(max_total_tokens=len(LOW_PROMPT) + len(HIGH_PROMPT) + 30, max_running_requests=8)
    alone = run_alone(Engine(llama_dir, **kw), make_req("low", LOW_PROMPT, LOW_TOKENS, 0, **SEEDED))
    eng = Engine(llama_dir, **kw)
    sched = eng.scheduler
    low = make_req("low", LOW_PROMPT, LOW_TOKENS, 0, **SEEDED)
    sched.add_request(low)
    sched.step()
    sched.add_request(make_req("high", HIGH_PROMPT, HIGH_TOKENS + 20, 0))
    while sched.has_work():
        sched.step()
    assert sched.num_retractions > 0 and low.output_ids == alone
    assert_no_kv_leak(sched.cache)


# Preempt only a set of running requests that makes room. Three run (C outranks the newcomer's
# threshold, A and B do not); the newcomer's prompt is sized from the pool as it stands: fits
# once A goes, once A and B go, or not even then (C keeps its KV): then nobody is preempted.
FIT = {"A": 1, "A+B": 2, "none": 0}


@pytest.mark.parametrize("case", list(FIT))
@pytest.mark.parametrize("slots", [3, 8])
def test_preempts_only_a_set_that_makes_room(llama_dir, hf_tiny, case, slots):
    eng = Engine(llama_dir, enable_priority_scheduling=True, max_total_tokens=168, max_running_requests=slots)
    sched, cache = eng.scheduler, eng.scheduler.cache
    prompts = {"C": [7, 8, 9, 10, 11, 12, 13, 14], "A": [20, 21, 22, 23, 24, 25, 26, 27],
               "B": [30, 31, 32, 33, 34, 35, 36, 37]}
    reqs = {k: make_req(k, p, 48, {"C": 25}.get(k, 0)) for k, p in prompts.items()}
    sched.add_request(reqs["C"])
    sched.add_request(reqs["B"])
    sched.step()                                    # A is the newest: first to go among equals
    sched.add_request(reqs["A"])
    while len(reqs["A"].output_ids) < 10:
        sched.step()
    assert not sched.waiting and len(sched.running) == 3
    avail = cache.allocator.free_slots + cache.radix.evictable_size
    a, b = reqs["A"].kv_len, reqs["B"].kv_len        # each holds its own prompt and output alone
    size = {"A": avail + a // 2, "A+B": avail + a + b // 2, "none": avail + a + b + 4}[case]
    high = make_req("high", [100 + i for i in range(size)], 4, 30)
    sched.add_request(high)
    sched.step()
    assert sched.num_preemptions == FIT[case]
    assert [r.rid for r in sched.running if r.rid != "high"] == \
        {"A": ["C", "B"], "A+B": ["C"], "none": ["C", "B", "A"]}[case]
    while sched.has_work():
        sched.step()
    assert sched.num_preemptions == FIT[case]
    for r in [*reqs.values(), high]:
        assert r.output_ids == hf_greedy(hf_tiny["llama"], r.input_ids, r.params.max_new_tokens), r.rid
    assert_no_kv_leak(cache)


def test_a_preempted_seeded_request_under_dspark_keeps_its_stream(llama_dir, tmp_path):
    """With DSpark the resumed request decodes its last token in a verify as it would have
    unpreempted (its prefill stops before it), so its drafts and its draws come in the same order:
    the same tokens. (Before, the resumed request drew that token in its prefill and the streams
    parted there.)"""
    from dspark_fixtures import make_oracle_draft
    from parallel_fixtures import bigram_of
    greedy = run_alone(Engine(llama_dir, max_total_tokens=1024), make_req("g", LOW_PROMPT, LOW_TOKENS, 0))
    draft = make_oracle_draft(llama_dir, str(tmp_path / "draft"), bigram_of([LOW_PROMPT], [greedy], 320))
    kw = dict(speculative_algorithm="DSPARK", speculative_draft_model_path=draft,
              speculative_dspark_verify_mode="full", **FULL["slots"])
    sp = dict(SEEDED, temperature=0.3, top_p=1.0)
    req = make_req("low", LOW_PROMPT, LOW_TOKENS, 0, **sp)
    alone = run_alone(Engine(llama_dir, **kw), req)
    assert 0 < req.spec_accept_token_num < req.spec_draft_token_num      # drafts kept and refused
    eng = Engine(llama_dir, enable_priority_scheduling=True, **kw)
    out = run_low_then_high(eng, 20, **sp)
    assert eng.scheduler.num_preemptions == 1 and out["first_high"] < out["low_done"]
    assert out["low"] == alone and out["received"]["low"] == alone
