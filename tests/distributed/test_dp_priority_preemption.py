"""Priority preemption under DP attention (--enable-dp-attention --dp-size 2 --tp-size 2, gloo,
1 torch thread per rank, one running slot per group): in each group a long low-priority request
runs (group 0, whose scheduler is rank 0's own: greedy; group 1, run in its driver's process:
seeded sampled), and after 20 of its tokens a high-priority one routed to the same group preempts
it. In both groups the high one's first token comes before the low one finishes, each request's
tokens equal the single-process engine's run alone (rank 0's copy of group 1's request holds each
token once: its driver sends only tokens past those sent), and both groups' pools end free."""
from __future__ import annotations

from conftest import assert_no_kv_leak, hf_greedy
from parallel_fixtures import COMMON

from sparkserve import Engine
from sparkserve.core.req import Req
from sparkserve.core.sampling_state import RequestSamplingState
from sparkserve.sampling_params import SamplingParams

DP2 = dict(tp_size=2, dp_size=2, enable_dp_attention=True)
LOW_PROMPT, LOW_TOKENS = [5, 9, 13, 17, 21, 25, 29, 33], 40
HIGH_PROMPT, HIGH_TOKENS = list(range(40, 56)), 4
SAMPLED = dict(temperature=1.0, top_p=0.9, seed=3)


def make_req(rid: str, prompt: list[int], n: int, priority: int, group: int | None = None, **sp) -> Req:
    params = SamplingParams(max_new_tokens=n, ignore_eos=True, **{"temperature": 0, **sp})
    return Req(rid, list(prompt), params, RequestSamplingState(params, prompt, set()), priority=priority,
               routed_dp_rank=group)


def test_priority_preemption_in_both_dp_attention_groups(llama_dir, hf_tiny):
    alone = Engine(llama_dir, **COMMON)
    lows = {0: make_req("low0", LOW_PROMPT, LOW_TOKENS, 0, 0),
            1: make_req("low1", LOW_PROMPT, LOW_TOKENS, 0, 1, **SAMPLED)}
    want_sampled = make_req("alone", LOW_PROMPT, LOW_TOKENS, 0, **SAMPLED)
    alone.scheduler.add_request(want_sampled)
    while alone.scheduler.has_work():
        alone.scheduler.step()
    want = {0: hf_greedy(hf_tiny["llama"], LOW_PROMPT, LOW_TOKENS), 1: want_sampled.output_ids}
    want_high = hf_greedy(hf_tiny["llama"], HIGH_PROMPT, HIGH_TOKENS)
    highs = {g: make_req(f"high{g}", HIGH_PROMPT, HIGH_TOKENS, 20, g) for g in (0, 1)}
    kw = dict(COMMON, max_running_requests=1, enable_priority_scheduling=True)
    with Engine(llama_dir, **DP2, **kw) as eng:
        sched = eng.scheduler
        for r in lows.values():
            sched.add_request(r)
        steps, added, first_high, low_done = 0, False, {}, {}
        while sched.has_work():
            if not added and all(len(r.output_ids) >= 20 for r in lows.values()):
                for r in highs.values():
                    sched.add_request(r)
                added = True
            sched.step()
            steps += 1
            for g in (0, 1):
                if g not in first_high and highs[g].output_ids:
                    first_high[g] = steps
                if g not in low_done and lows[g].finished:
                    low_done[g] = steps
        load = sched.load()
        assert load.num_preemptions == 2, load
        assert load.num_used_tokens == 0
        assert_no_kv_leak(sched.local.cache)
    for g in (0, 1):
        assert first_high[g] < low_done[g], (g, first_high, low_done)
        assert lows[g].output_ids == want[g], g
        assert highs[g].output_ids == want_high, g
