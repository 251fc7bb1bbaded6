"""The adaptive planner corrects its confidence head by what the target accepted: a head that
promises more than the target grants (traffic unlike its training data) would have every plan
verify rows that do not pay, and one that promises less would leave speed unused."""
from __future__ import annotations

from itertools import accumulate

import pytest
import torch

from sparkserve.speculative.planner import StepCostTable, VerifyPlanner

# One request's forward: 10 ms, and 1 ms per row beyond the first (a CPU's decode step).
TABLE = StepCostTable([1, 2, 4, 8], [0.010, 0.011, 0.013, 0.017], measured=True)


def survivals(confidence: torch.Tensor, n: int) -> float:
    return float(torch.cumprod(confidence[:n], 0).sum())


def test_an_overconfident_head_is_corrected_by_what_was_accepted():
    """Confidences of 0.8 per slot make a long verify look worth it; when cycles accept none of
    the drafts the plans expected, the planner verifies fewer (here none: plain decoding is
    faster), and once the target accepts what the head says again, it verifies as before."""
    planner = VerifyPlanner("adaptive", costs=TABLE)
    conf = [torch.full((7,), 0.8)]
    before = planner.plan(conf, [7])
    assert before[0] >= 4, before
    for _ in range(16):
        planner.observe_acceptance(survivals(conf[0], before[0]), 0)
    assert planner.calibration() < 0.1
    assert planner.plan(conf, [7]) == [0]
    planner.observe_plain(0.010, 1)
    assert planner.may_pay([7])              # whether the batch lets drafts pay is another matter
    # No cycle then says what the target accepts now: each plan that verifies nothing ages the
    # evidence, so after some back-offs the planner tries again (not at once).
    tries = next(n for n in range(1, 500) if planner.plan(conf, [7]) != [0])
    assert 4 < tries < 100, tries
    for _ in range(16):
        planner.observe_acceptance(survivals(conf[0], before[0]), 0)
    for _ in range(32):                      # the recent window: the head is right again
        planner.observe_acceptance(survivals(conf[0], before[0]), round(survivals(conf[0], before[0])))
    assert abs(planner.calibration() - 1) < 0.1
    assert planner.plan(conf, [7]) == before


def test_an_underconfident_head_is_trusted_more():
    """Confidences of 0.3 verify at most a draft or two; cycles that accept twice what they
    expected make the plans verify more (survivals scaled up, never above 1)."""
    planner = VerifyPlanner("adaptive", costs=TABLE)
    conf = [torch.full((7,), 0.3)]
    before = planner.plan(conf, [7])[0]
    for _ in range(16):
        planner.observe_acceptance(0.4, 1)
    assert planner.calibration() > 1.5
    assert planner.plan(conf, [7])[0] > before


def test_full_and_threshold_modes_are_not_calibrated():
    planner = VerifyPlanner("threshold", threshold=0.5)
    for _ in range(8):
        planner.observe_acceptance(3.0, 0)
    assert planner.plan([torch.tensor([0.9, 0.6, 0.4])], [3]) == [2]
    assert VerifyPlanner("full").plan([torch.tensor([0.1, 0.1])], [2]) == [2]


def test_may_pay_prices_sure_drafts_exactly():
    """may_pay (asked at every decode step) without building a plan: for random tables and
    batches it says yes exactly when some number k of sure drafts, k = 1 .. all the caps, gives
    more tokens per second than plain decoding (R + k over cost(R, R + k), every k tried as the
    reference); a table where a row costs as much as a decode step (and the draft pass something)
    never pays, a flat one does."""
    import random
    rng = random.Random(0)
    for _ in range(300):
        tokens = [1, 2, 4, 8, 16, 32, 64]
        steps = [rng.uniform(0, 0.012) * (b - a) for a, b in zip(tokens, tokens[1:])]
        seconds = list(accumulate([0.01] + steps))
        costs = StepCostTable(tokens, seconds, rng.choice([0.0, 0.002]), [1, 4, 16],
                              sorted(rng.uniform(0.01, 0.05) for _ in range(3)), measured=True)
        costs.request_seconds[0] = 0.01
        planner = VerifyPlanner("adaptive", costs=costs)
        for _ in range(1 + rng.randrange(3)):
            planner.observe_plain(rng.uniform(0.01, 0.02), 1)
        caps = [rng.randrange(8) for _ in range(rng.randint(1, 6))]
        plain = rng.randrange(3)
        R = len(caps) + plain
        scale, draft = planner.scale(), planner.draft_seconds(len(caps))
        plain_rate = R / (scale * costs.batch_cost(R, R))
        want = any((R + k) / (draft + scale * costs.batch_cost(R, R + k)) > plain_rate
                   for k in range(1, sum(caps) + 1))
        assert planner.may_pay(caps, plain) == want, (seconds, caps, plain)
    dear, flat = (VerifyPlanner("adaptive", costs=StepCostTable([1, 8], [0.01, x], 0.001, measured=True))
                  for x in (0.08, 0.01))
    for planner in (dear, flat):
        planner.observe_plain(0.01, 1)
    assert not dear.may_pay([7]) and flat.may_pay([7])


def test_a_table_measured_under_load_is_scaled_to_the_steps_now():
    """The step costs were measured while the shared CPU ran 3x slower (30 ms a forward); draft
    passes are timed now (6 ms). Unscaled, a draft pass looks a fifth of a step and a draft of
    0.5 confidence looks worth verifying; once plain steps show what a step takes now (10 ms) the
    table is scaled by it, and the same draft does not pay. Every PROBE_EVERY drafting steps one
    plain step re-measures it (may_pay says no once), and before the first one too. (A table given
    as a file is taken as it is.)"""
    from sparkserve.speculative.planner import PROBE_EVERY
    planner = VerifyPlanner("adaptive", costs=StepCostTable([1, 2, 8], [0.030, 0.033, 0.051],
                                                                      measured=True))
    conf = [torch.full((7,), 0.5)]
    assert not planner.may_pay([7])
    for _ in range(3):
        planner.observe_draft(0.006, 1)
    assert planner.plan(conf, [7])[0] >= 1         # (1 + .5) / (6 + 33) ms > 1 / 30 ms
    for _ in range(3):
        planner.observe_plain(0.010, 1)
    assert planner.scale() == pytest.approx(1 / 3)
    assert planner.plan(conf, [7]) == [0]          # (1 + .5) / (6 + 11) ms < 1 / 10 ms, and longer too
    assert planner.may_pay([7])                    # drafts sure to pass would
    for _ in range(PROBE_EVERY):
        planner.observe_draft(0.006, 1)
    assert not planner.may_pay([7])                # a plain step is due
    planner.observe_plain(0.010, 1)
    assert planner.may_pay([7])
    file_table = VerifyPlanner("adaptive", costs=StepCostTable([1, 2, 8], [0.030, 0.033, 0.051]))
    file_table.observe_plain(0.010, 1)
    assert file_table.scale() == 1 and file_table.may_pay([7])
