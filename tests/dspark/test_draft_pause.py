"""Requests whose drafts have not paid for long go dark (scheduler/draft_pause.py): their rows stop
becoming draft context, decode forwards of only dark requests skip the target's taps, and a dark
request wakes when its batch shrinks, drafting from a context with its dark rows left out. Greedy
output stays plain decoding's; after every step the draft context of every row not left out equals
a fresh transformers forward's (check_draft_context)."""
from __future__ import annotations

import pytest
import torch
from dspark_fixtures import (
    assert_no_kv_leak,
    dspark_single_thread,  # noqa: F401 (autouse)
    engine,
    generate_ids,
    install_context_check,
    load_hf,
    make_oracle_draft,
    make_target,
    next_token_map,
    zero_attn_and_mlp_out,
)

from sparkserve.core.forward_batch import ForwardMode
from sparkserve.scheduler import draft_pause

MAX_NEW = [140, 140, 80]     # the third ends first: the batch shrinks from 3 to 2


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft_pause")
    path = make_target(str(root / "copier"), "llama", edit=zero_attn_and_mlp_out)
    return path, load_hf(path), str(root)


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])      # the Python draft pass; the native one
def test_dark_requests_skip_context_and_wake_lossless(target, dtype, monkeypatch):
    """A draft whose every proposal verifies nothing (threshold 1.0) for three requests: each goes
    dark after DARK_IDLE vain proposals (their rows stop being injected; decode steps then run
    without taps); when the shortest request ends the other two wake, and from then on every
    draft is verified (threshold 0), from contexts with their dark rows left out. The draft's
    Markov head knows the target's greedy next token (a copier target, make_oracle_draft), so
    blocks are accepted."""
    path, hf, root = target
    prompts = [[5 + i, 17, 33 + 2 * i, 9] for i in range(3)]
    params = [dict(temperature=0, max_new_tokens=m, ignore_eos=True) for m in MAX_NEW]
    ref = generate_ids(engine(path), prompts, params)
    draft = make_oracle_draft(path, f"{root}/draft_{dtype}", next_token_map(hf), block_size=4,
                              dtype=torch.float16 if dtype == "fp16" else None)
    eng = engine(path, draft, "threshold", speculative_dspark_confidence_threshold=1.0)
    sched = eng.scheduler
    stats = install_context_check(eng, hf)
    seen = {"taps_off": 0, "gapped_passes": 0, "dark": set()}
    runner_taps = sched.runner.taps

    def taps(on):
        seen["taps_off"] += not on
        return runner_taps(on)
    monkeypatch.setattr(sched.runner, "taps", taps)
    propose = sched.spec.propose

    def watched_propose(reqs, plain_tokens=0):
        if any(r.draft_gaps for r in reqs):
            seen["gapped_passes"] += 1
        return propose(reqs, plain_tokens)
    monkeypatch.setattr(sched.spec, "propose", watched_propose)
    step = sched.step

    def watched_step():
        for r in sched.running:
            if draft_pause.is_dark(r):
                seen["dark"].add(r.rid)
                sched.spec.planner.threshold = 0.0      # from now on every draft is verified
        return step()
    monkeypatch.setattr(sched, "step", watched_step)
    assert generate_ids(eng, prompts, params) == ref
    assert_no_kv_leak(eng)
    assert len(seen["dark"]) == 3, seen
    assert seen["taps_off"] > 0 and seen["gapped_passes"] > 0, seen
    assert stats["rows"] > 0
    assert sched.forward_count[ForwardMode.VERIFY] > 0
    assert sum(k * v for k, v in sched.accept_hist.items()) > 0, sched.accept_hist


def test_back_off_goes_dark_and_wakes():
    """The back-off schedule: 2, 4, .. 32 tokens, then DARK_BACKOFF (dark but for the last 32 rows
    before it drafts); a dark request in a smaller batch drafts after WAKE_ROWS rows; gaps merge
    and are trimmed where a prefill recomputes rows."""
    from sparkserve.core.req import Req
    from sparkserve.core.sampling_state import RequestSamplingState
    from sparkserve.sampling_params import SamplingParams
    params = SamplingParams(temperature=0.0, max_new_tokens=1000)
    req = Req("r", [1], params, RequestSamplingState(params))
    req.output_ids = [0] * 10
    waits, dark = [], []
    for idle in range(1, 9):
        req.spec_idle, req.spec_resume_at = idle, 0
        draft_pause.back_off(req)
        waits.append(req.spec_resume_at - 10 if req.spec_resume_at else 0)
        dark.append(draft_pause.is_dark(req))
    assert waits == [0, 2, 4, 8, 16, 32, draft_pause.DARK_BACKOFF, draft_pause.DARK_BACKOFF]
    assert dark == [False] * 6 + [True, True]
    req.spec_batch = 8
    draft_pause.wake_in_smaller_batch(req, 8)
    assert draft_pause.is_dark(req)
    draft_pause.wake_in_smaller_batch(req, 7)
    assert not draft_pause.is_dark(req) and req.spec_resume_at == 10 + draft_pause.WAKE_ROWS
    assert req.spec_idle == 1
    for p in (12, 13, 14, 20):
        draft_pause.note_gap(req, p, p + 1)
    assert req.draft_gaps == [[12, 15], [20, 21]]
    draft_pause.trim_gaps(req, 13)
    assert req.draft_gaps == [[12, 13]]
