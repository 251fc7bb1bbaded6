"""Verify length per request (DSpark's confidence-driven variable-length verification).

full: verify every draft. threshold: verify the leading drafts whose confidence is >= the
threshold. adaptive (the paper's Alg. 1): rank every (request, slot) of the batch by its
survival a = prod of confidences up to that slot, and admit slots while the expected tokens
per second  tau / (draft + s * cost(R, B))  rises, with tau = R + sum_r sum_{j<=l_r} a_rj over
the forward's R requests, B = R + sum_r l_r its tokens, cost(R, B) the seconds of such a forward
measured at start-up, s what recent plain steps took per second of their table forward (what a step
adds to its forward, and the load now against the load then: `scale`) and `draft` what drafting
adds: the draft pass, the LM head rows acceptance reads (the table's draft_seconds, or the
scheduler's measurements if larger). When even the best plan yields fewer tokens per second than
plain decoding (R / (s * cost(R, R))), it verifies
nothing, so the scheduler backs the requests off drafting for a while; and where that would be so
with drafts sure to pass (`may_pay`), the scheduler does not run the draft pass at all. The
survivals are scaled by how many drafts recent cycles accepted per draft they expected
(`calibration`), so a confidence head that promises too much (or too little) is corrected by what
the target actually accepted."""
from __future__ import annotations

import bisect
import json
import operator
import statistics
from collections import deque
from dataclasses import dataclass, field
from itertools import accumulate

import torch

MODES = ("full", "threshold", "adaptive")
# How many recent steps the running cost estimates look at.
RECENT_STEPS = 32
# Neutral evidence the acceptance calibration starts from (drafts expected and accepted alike):
# a few cycles' worth, so one unlucky block does not reprice the draft.
CALIBRATION_PRIOR = 4.0
# Neutral evidence (drafts expected and accepted alike) a plan that verifies nothing adds.
AGEING_EVIDENCE = 0.25
# Most drafting steps in a row before one plain step re-measures what a step costs now.
PROBE_EVERY = 32


def _piecewise(xs: list[int], ys: list[float], x: float) -> float:
    """Linear interpolation through (xs, ys), flat below xs[0], the last slope beyond xs[-1]."""
    if x <= xs[0] or len(xs) == 1:
        return ys[0]
    i = min(bisect.bisect_left(xs, x), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class StepCostTable:
    """Seconds of one target forward: of one request over `tokens` tokens, and of a decode step of
    `requests` requests with a token each (piecewise linear); plus a fixed per-cycle draft cost.
    Many requests' decode step costs more than one request's as many tokens (an attention context
    and an LM head row each), and a table without `requests` takes them as the same."""
    tokens: list[int]
    seconds: list[float]
    draft_seconds: float = 0.0
    requests: list[int] = field(default_factory=list)
    request_seconds: list[float] = field(default_factory=list)
    # measured by this process at start-up (profile.py): its seconds are scaled to what steps take
    # now (VerifyPlanner.scale); a table given as a file is taken as it is
    measured: bool = False

    def cost(self, n: int) -> float:
        """One request's forward over n tokens."""
        return _piecewise(self.tokens, self.seconds, n)

    def batch_cost(self, requests: int, tokens: int) -> float:
        """A forward of `requests` requests over `tokens` tokens in all: their decode step, plus the
        rows beyond one a request as one request's extra rows cost."""
        decode = (_piecewise(self.requests, self.request_seconds, requests) if self.requests
                  else self.cost(requests))
        return decode + self.cost(1 + tokens - requests) - self.cost(1)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({"tokens": self.tokens, "seconds": self.seconds, "draft_seconds": self.draft_seconds,
                       "requests": self.requests, "request_seconds": self.request_seconds}, f)

    @classmethod
    def load(cls, path: str) -> "StepCostTable":
        with open(path) as f:
            d = json.load(f)
        if len(d.get("tokens", [])) < 2 or len(d["tokens"]) != len(d.get("seconds", [])):
            raise ValueError(f"{path}: a step cost table needs matching 'tokens' and 'seconds' lists of >= 2 "
                             f"points")
        if len(d.get("requests", [])) != len(d.get("request_seconds", [])):
            raise ValueError(f"{path}: 'requests' and 'request_seconds' must have the same length")
        return cls(list(d["tokens"]), list(d["seconds"]), float(d.get("draft_seconds", 0.0)),
                   list(d.get("requests", [])), list(d.get("request_seconds", [])))


class VerifyPlanner:
    def __init__(self, mode: str, threshold: float = 0.0, costs: StepCostTable | None = None):
        if mode not in MODES:
            raise ValueError(f"verify mode {mode!r} is not one of {MODES}")
        if mode == "adaptive" and costs is None:
            raise ValueError("adaptive verify needs a step cost table")
        self.mode, self.threshold, self.costs = mode, threshold, costs
        # Recent plain steps' seconds per second of the table's forward (scale); recent costs per
        # request of a draft pass (whether or not its drafts were then verified) and of a verify
        # cycle beyond what the scaled table gives its forward, the draft pass left out.
        self._plain: deque[float] = deque(maxlen=RECENT_STEPS)
        self._since_plain = PROBE_EVERY         # drafting steps since the latest plain one
        self._drafts: deque[float] = deque(maxlen=RECENT_STEPS)
        self._cycles: deque[float] = deque(maxlen=RECENT_STEPS)
        self._first_cycle = True
        # (drafts the confidences expected to be accepted, drafts accepted) of recent verify cycles
        self._accepts: deque[tuple[float, int]] = deque(maxlen=RECENT_STEPS)

    def observe_plain(self, seconds: float, requests: int) -> None:
        """A plain decode step of `requests` requests took `seconds`."""
        self._since_plain = 0
        if self.costs is not None and self.costs.measured:
            self._plain.append(seconds / self.costs.batch_cost(requests, requests))

    def observe_draft(self, seconds: float, requests: int) -> None:
        """A draft pass (propose) for `requests` requests took `seconds`."""
        self._since_plain += 1
        self._drafts.append(seconds / requests)

    def observe_cycle(self, seconds: float, requests: int, drafting: int, tokens: int) -> None:
        """A verify cycle after its draft pass (forward, acceptance, commits) took `seconds`; its
        forward ran `requests` requests over `tokens` tokens, `drafting` of them verifying drafts.
        The first one is not kept: it also paid for what the kernels set up on first use."""
        if self._first_cycle:
            self._first_cycle = False
            return
        beyond = seconds - self.step_cost(requests, tokens)
        self._cycles.append(max(0.0, beyond) / drafting)

    def observe_acceptance(self, expected: float, accepted: int) -> None:
        """A verify cycle accepted `accepted` drafts where its plans' survivals summed to `expected`."""
        self._accepts.append((expected, accepted))

    def calibration(self) -> float:
        """Drafts accepted per draft the confidence head expected, over recent cycles (1 before
        any): a head that promises more than the target grants (traffic unlike its training data,
        code where it learnt chat) would have every plan verify rows that do not pay. The plans
        scale each survival by it."""
        expected = sum(e for e, _ in self._accepts)
        accepted = sum(a for _, a in self._accepts)
        return (accepted + CALIBRATION_PRIOR) / (expected + CALIBRATION_PRIOR)

    def scale(self) -> float:
        """Seconds recent plain steps took per second the table gives their forward (median; 1
        before any): what a step adds to its forward (sampling, commits, scheduling), and the
        machine's load now against the load the table was measured under. Draft passes and cycles
        are timed now, so the table is too: on a shared CPU whose load came and went since
        start-up, unscaled it made drafting look cheap (the table measured under load) or dear."""
        return statistics.median(self._plain) if self._plain else 1.0     # (empty: a table file)

    def step_cost(self, requests: int, tokens: int) -> float:
        """Seconds a step whose forward runs `requests` requests over `tokens` tokens takes now,
        drafting left out (0 without a table)."""
        return self.scale() * self.costs.batch_cost(requests, tokens) if self.costs is not None else 0.0

    def draft_seconds(self, requests: int) -> float:
        """What drafting for `requests` requests adds to a step: the draft pass, plus what a verify
        cycle costs beyond a plain step (more LM head rows, acceptance, injecting at once). Medians
        of recent ones: a slow one (another process took the core) does not steer the plans, and
        while the cycles look dear, proposals confident enough to pay anyway keep measuring them."""
        passes = statistics.median(self._drafts) if self._drafts else 0.0
        verify = statistics.median(self._cycles) if self._cycles else 0.0
        table = self.costs.draft_seconds if self.costs is not None else 0.0
        return max(table, requests * (passes + verify))

    def plan(self, confidences: list[torch.Tensor | None], caps: list[int],
             plain_tokens: int = 0) -> list[int]:
        """Drafts to verify per request. confidences[r]: [G] per slot (None: no confidence
        head -> full). caps[r]: most drafts allowed (max tokens left). plain_tokens: rows of
        non-speculating requests in the same forward (they count towards B)."""
        if self.mode == "full" or any(c is None for c in confidences):
            return list(caps)
        if self.mode == "threshold":
            out = []
            for c, cap in zip(confidences, caps):
                below = (c[:cap] < self.threshold).nonzero()
                out.append(int(below[0]) if len(below) else cap)
            return out
        return self._adaptive(confidences, caps, plain_tokens)

    def may_pay(self, caps: list[int], plain_tokens: int = 0) -> bool:
        """Whether a draft pass for requests with these caps can pay at all (adaptive mode): the
        plan it would make were every draft sure to pass beats plain decoding. Where even that
        plan verifies nothing (a large batch, whose forward is bound by the arithmetic of its rows),
        the pass would cost its time and come to nothing, and the scheduler skips it. The batch, not
        the draft, decides this, so it does not back the requests off drafting.
        It is asked at every decode step, so it is priced without building a plan: k sure drafts
        bring k tokens for cost(R, R + k), and on each linear piece of the table that rate is
        monotone in k, so only the pieces' ends need a look (a handful of lookups, where the plan
        ranked every slot of the batch). Every PROBE_EVERY drafting steps (and before the first) it
        says no once, so that a plain step re-measures what steps cost now (`scale`)."""
        if self.mode != "adaptive":
            return True
        drafts = sum(caps)
        if not drafts or (self.costs.measured and self._since_plain >= PROBE_EVERY):
            return False
        R = len(caps) + plain_tokens
        draft = self.draft_seconds(len(caps))
        plain_rate = R / self.step_cost(R, R)
        ends = {1, drafts, *(n - 1 for n in self.costs.tokens if 1 < n <= drafts + 1)}
        return any((R + k) / (draft + self.step_cost(R, R + k)) > plain_rate for k in ends)

    def _adaptive(self, confidences, caps, plain_tokens) -> list[int]:
        k = self.calibration()
        survival = [[min(1.0, a * k) for a in accumulate(c[:cap].tolist(), operator.mul)]
                    for c, cap in zip(confidences, caps)]
        ranked = sorted(((a, r, j) for r, s in enumerate(survival) for j, a in enumerate(s)),
                        key=lambda x: (-x[0], x[2]))
        lens = [0] * len(caps)
        R = len(caps) + plain_tokens            # the forward's requests, a token each before drafts
        tau, B = float(R), R
        draft = self.draft_seconds(len(caps))
        plain_rate = tau / self.step_cost(R, B)
        best = tau / (draft + self.step_cost(R, B))
        for a, r, j in ranked:
            if j != lens[r]:          # survival is non-increasing along a block: keep prefixes
                continue
            theta = (tau + a) / (draft + self.step_cost(R, B + 1))
            if theta <= best:
                break
            lens[r] += 1
            tau += a
            B += 1
            best = theta
        if best > plain_rate:
            return lens
        # Nothing verified, so no cycle will say what the target now accepts: a calibration left
        # where a past stretch of traffic put it could bar drafting for good. Each such plan adds
        # a little neutral evidence, so the plans try again after a few back-offs.
        self._accepts.append((AGEING_EVIDENCE, AGEING_EVIDENCE))
        return [0] * len(caps)
