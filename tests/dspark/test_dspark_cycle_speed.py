"""What makes a DSpark cycle cheaper must not change what it computes.

Lazy verify logits (speculative/verify.py): accept_batch gives exactly what the accept rules give on
fully computed logits (greedy, and seeded rejection sampling draw for draw), while the LM head
never scores a row after a request's first rejection and runs at most twice per cycle. In the
engine (tiny llama, a draft fitted to the target's greedy bigrams, so verifies reject mid-block):
VERIFY forwards take the multi-query attention kernel, score fewer LM-head rows than they verify,
and greedy output still equals plain decoding."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from dspark_fixtures import (
    assert_no_kv_leak,
    dspark_single_thread,  # noqa: F401 (autouse)
    engine,
    generate_ids,
    make_oracle_draft,
    make_target,
)

from sparkserve.core.sampling_state import RequestSamplingState
from sparkserve.sampling_params import SamplingParams
from sparkserve.speculative.verify import (
    VerifyLogits,
    accept_batch,
    accept_greedy,
    accept_sampling,
    first_rows,
)


class CountingHead:
    def __init__(self, weight: torch.Tensor):
        self.weight, self.calls, self.rows = weight, 0, 0

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.rows += h.shape[0]
        return (h[:, None, :] * self.weight[None]).sum(-1)       # row by row: exact for any M


def test_accept_batch_equals_full_logits_and_skips_rejected_rows():
    g = torch.Generator().manual_seed(0)
    V, d, L = 11, 6, 5
    head = CountingHead(torch.randn(V, d, generator=g) * 3)
    # requests: greedy ones rejecting at slot 0, 2 and never (all L accepted), sampling ones,
    # and one with no drafts; 'first' varies (1: anchor row only, up to every row).
    kinds = [("greedy", 0, 1), ("greedy", 2, 1), ("greedy", L, 1), ("greedy", 2, 4), ("greedy", 1, L + 1),
             ("sample", None, 1), ("sample", None, 3), ("sample", None, 1), ("greedy", 0, 1)]
    lens = [L + 1] * (len(kinds) - 1) + [1]
    hidden = torch.randn(sum(lens), d, generator=g)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    full = head(hidden)
    head.calls = head.rows = 0
    items, ref = {}, {}
    for i, (kind, reject_at, first) in enumerate(kinds):
        rows = full[starts[i]:starts[i] + lens[i]]
        n_drafts = lens[i] - 1
        if kind == "greedy":
            best = rows.argmax(-1).tolist()
            drafts = [best[k] if k != reject_at else (best[k] + 1) % V for k in range(n_drafts)]
            params = SamplingParams(temperature=0.0)
            q = None
            ref[i] = accept_greedy(drafts, rows)
        else:
            params = SamplingParams(temperature=1.0, seed=100 + i)
            q = torch.softmax(torch.randn(n_drafts, V, generator=g), -1)
            drafts = [int(torch.multinomial(q[k], 1, generator=g)) for k in range(n_drafts)]
            ref[i] = accept_sampling(drafts, q, rows, params, torch.Generator().manual_seed(100 + i))
        req = SimpleNamespace(params=params, sampling=RequestSamplingState(params))
        items[i] = (req, drafts, q, first)
    logits = VerifyLogits(head, hidden, starts, lens)
    got = accept_batch(items, logits)
    for i, (n, bonus) in ref.items():
        assert got[i] == (n, items[i][1][:n] + [bonus]), (i, kinds[i])
        rows = logits.rows[i]
        assert torch.equal(rows, full[starts[i]:starts[i] + rows.shape[0]])     # the right rows
        if kinds[i][0] == "greedy":   # rows after the first rejection are never scored
            reject_at, first = kinds[i][1], kinds[i][2]
            assert rows.shape[0] == min(first if reject_at < first else L + 1, lens[i]), (i, kinds[i])
    assert head.calls == 2
    assert head.rows < sum(lens)


def test_first_rows_follows_confidence():
    assert first_rows(None, 4) == 5
    assert first_rows(torch.tensor([0.9, 0.3, 0.3, 0.9]), 4) == 3       # survival .9 .27 .081 ..
    assert first_rows(torch.tensor([0.05, 1.0]), 2) == 1
    assert first_rows(torch.tensor([0.9, 0.9, 0.9]), 0) == 1


def test_engine_verify_uses_kernel_and_lazy_head(tmp_path, monkeypatch):
    from sparkserve.layers import attention as attention_mod
    from sparkserve.scheduler import scheduler as sched_mod
    target = make_target(str(tmp_path / "t"), "llama")
    plain = engine(target)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 17, 40, 9)]
    params = dict(temperature=0, max_new_tokens=24)
    ref = generate_ids(plain, prompts, params)
    bigram = [0] * 256
    for p, o in zip(prompts, ref):
        seq = p[-1:] + o
        for a, b in zip(seq, seq[1:]):
            bigram[a] = b
    draft = make_oracle_draft(target, str(tmp_path / "d"), bigram, block_size=4)
    eng = engine(target, draft, "full")

    ext = attention_mod.load_extension()
    q_lens_seen = []

    class Spy:           # the extension, noting the decode kernel's longest query block
        def decode_attention(self, *args):
            q_lens_seen.append(max(args[8]) if len(args) > 8 else 1)
            return ext.decode_attention(*args)

        def __getattr__(self, name):
            return getattr(ext, name)
    monkeypatch.setattr(attention_mod, "load_extension", lambda: Spy())

    stats = {"verified": 0, "scored": 0}
    orig = sched_mod.Scheduler._verify_forward

    def counting(self, fb, sched):
        logits = orig(self, fb, sched)
        stats["verified"] += sum(logits.lens)
        head = logits.head

        def h(x):
            stats["scored"] += x.shape[0]
            return head(x)
        logits.head = h
        return logits
    monkeypatch.setattr(sched_mod.Scheduler, "_verify_forward", counting)
    out = generate_ids(eng, prompts, params)
    assert out == ref
    hist = eng.scheduler.accept_hist
    committed = sum((k + 1) * v for k, v in hist.items())
    # VERIFY blocks (anchor + 4 drafts) take the kernel; so do the 3- and 9-token prompts of the
    # first prefill, split from the longer ones
    assert 5 in q_lens_seen, "VERIFY blocks (anchor + 4 drafts) did not take the kernel"
    assert hist.get(0, 0) > 0 and max(hist) >= 2, hist           # rejections and multi-token accepts
    assert committed <= stats["scored"] < stats["verified"], (stats, committed)
    assert_no_kv_leak(eng)


def test_adaptive_plan_counts_the_draft_and_backs_off():
    """With what drafting measurably adds to a step (the draft pass; a verify cycle's cost beyond
    a plain step's) in the cost, a weak draft's best plan is slower than plain decoding: the
    planner verifies nothing (so the scheduler backs off drafting); without it, or with a strong
    draft, it verifies. What plain steps take per second of their table forward (what a step adds,
    the load now against the load at start-up) scales the table on both sides."""
    from sparkserve.speculative.planner import StepCostTable, VerifyPlanner
    planner = VerifyPlanner("adaptive", costs=StepCostTable([1, 2, 8], [0.018, 0.021, 0.041], measured=True))
    weak, strong = [torch.full((7,), 0.28)], [torch.full((7,), 0.9)]
    assert planner.plan(weak, [7]) == [1]          # (1 + .28) / 21 ms > 1 / 18 ms
    for _ in range(3):                             # plain steps take 24 ms for an 18 ms forward
        planner.observe_plain(0.024, 1)
    assert planner.scale() == pytest.approx(4 / 3)
    assert planner.plan(weak, [7]) == [1]          # (1 + .28) / (21 * 4/3) ms > 1 / 24 ms
    planner.observe_cycle(0.5, 1, 1, 2)            # the first cycle also set the kernels up: not kept
    assert planner.plan(weak, [7]) == [1]
    planner.observe_cycle(0.034, 1, 1, 2)          # 6 ms beyond its forward's 28 ms (scaled)
    assert planner.plan(weak, [7]) == [0]          # (1 + .28) / (6 + 28) ms < 1 / 24 ms
    assert planner.plan(strong, [7]) == [7]
    for _ in range(3):                             # 1 ms: the median of recent cycles counts
        planner.observe_cycle(0.029, 1, 1, 2)
    assert planner.plan(weak, [7]) == [1]
    planner.observe_cycle(0.5, 1, 1, 2)            # so a slow one (the core was taken) stops nothing
    assert planner.plan(weak, [7]) == [1]
    for _ in range(3):                             # draft passes of 5 ms
        planner.observe_draft(0.005, 1)
    assert planner.draft_seconds(1) == pytest.approx(0.006)
    assert planner.draft_seconds(4) == pytest.approx(0.024)      # a pass per request
    assert planner.plan(weak, [7]) == [0]          # (1 + .28) / (6 + 28) ms < 1 / 24 ms
    assert planner.plan(strong, [7]) == [7]

def test_adaptive_runs_no_draft_pass_that_cannot_pay():
    """Where a forward's rows cost so much beside a batch's decode step that even drafts sure to
    pass would not pay (here from 4 requests up: a request's decode step adds 0.05 s, a verified
    row 0.3 s), `may_pay` says so, and no plan of any confidences verifies there; the other modes
    always draft."""
    from sparkserve.speculative.planner import StepCostTable, VerifyPlanner
    costs = StepCostTable([1, 64], [1.0, 1.0 + 63 * 0.3], requests=[1, 6], request_seconds=[1.0, 1.25],
                          measured=True)
    planner = VerifyPlanner("adaptive", costs=costs)
    assert not planner.may_pay([7])       # before any plain step: one, to measure what steps cost
    planner.observe_plain(1.0, 1)
    assert [planner.may_pay([7] * r) for r in range(1, 7)] == [True] * 3 + [False] * 3
    assert not planner.may_pay([7], plain_tokens=3)       # plain rows of the batch count
    assert not planner.may_pay([0])                        # no draft allowed: nothing to pay for
    g = torch.Generator().manual_seed(3)
    for r in range(1, 7):
        for _ in range(20):
            confs = [torch.rand(7, generator=g) ** 0.2 for _ in range(r)]
            if any(planner.plan(confs, [7] * r)):
                assert planner.may_pay([7] * r)
    for mode in ("full", "threshold"):
        assert VerifyPlanner(mode, 0.5).may_pay([7] * 6)
