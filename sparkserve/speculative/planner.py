"""Verify length per request (DSpark's confidence-driven variable-length verification).

full: verify every draft. threshold: verify the leading drafts whose confidence is >= the
threshold. adaptive (the paper's Alg. 1): rank every (request, slot) of the batch by its
survival a = prod of confidences up to that slot, and admit slots while the expected tokens
per second  tau / (draft + cost(B))  rises, with tau = sum_r (1 + sum_{j<=l_r} a_rj), B = sum_r (1 + l_r),
cost(B) the measured seconds of one step that verifies B tokens and `draft` what a cycle costs
beyond that forward: the draft pass, the LM head rows acceptance reads, acceptance and commits
(the table's draft_seconds, or the scheduler's running measurement of whole cycles if larger).
When even the best plan yields fewer tokens per second than plain decoding (tau0 / cost(B0)), it
verifies nothing, so the scheduler backs the requests off drafting for a while."""
from __future__ import annotations

import bisect
import json
from dataclasses import dataclass

import torch

MODES = ("full", "threshold", "adaptive")


@dataclass
class StepCostTable:
    """Seconds of one target forward over `tokens` tokens (piecewise linear), plus the fixed
    per-cycle draft cost."""
    tokens: list[int]
    seconds: list[float]
    draft_seconds: float = 0.0

    def cost(self, n: int) -> float:
        t, s = self.tokens, self.seconds
        if n <= t[0]:
            return s[0]
        i = bisect.bisect_left(t, n)
        if i == len(t):            # extrapolate with the last segment's slope
            i = len(t) - 1
        x0, x1, y0, y1 = t[i - 1], t[i], s[i - 1], s[i]
        return y0 + (y1 - y0) * (n - x0) / (x1 - x0)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({"tokens": self.tokens, "seconds": self.seconds,
                       "draft_seconds": self.draft_seconds}, f)

    @classmethod
    def load(cls, path: str) -> "StepCostTable":
        with open(path) as f:
            d = json.load(f)
        if len(d.get("tokens", [])) < 2 or len(d["tokens"]) != len(d.get("seconds", [])):
            raise ValueError(f"{path}: a step cost table needs matching 'tokens' and 'seconds' lists of >= 2 "
                             f"points")
        return cls(list(d["tokens"]), list(d["seconds"]), float(d.get("draft_seconds", 0.0)))


class VerifyPlanner:
    def __init__(self, mode: str, threshold: float = 0.0, costs: StepCostTable | None = None):
        if mode not in MODES:
            raise ValueError(f"verify mode {mode!r} is not one of {MODES}")
        if mode == "adaptive" and costs is None:
            raise ValueError("adaptive verify needs a step cost table")
        self.mode, self.threshold, self.costs = mode, threshold, costs
        self.cycle_seconds = 0.0          # running mean of a cycle's cost beyond its target forward

    def observe_cycle(self, seconds: float, tokens: int) -> None:
        """A whole speculative cycle took `seconds` and its target forward ran `tokens` tokens."""
        extra = max(0.0, seconds - (self.costs.cost(tokens) if self.costs is not None else 0.0))
        self.cycle_seconds = extra if not self.cycle_seconds else 0.8 * self.cycle_seconds + 0.2 * extra

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

    def _adaptive(self, confidences, caps, plain_tokens) -> list[int]:
        survival = [torch.cumprod(c[:cap].double(), 0).tolist() for c, cap in zip(confidences, caps)]
        ranked = sorted(((a, r, j) for r, s in enumerate(survival) for j, a in enumerate(s)),
                        key=lambda x: (-x[0], x[2]))
        lens = [0] * len(caps)
        tau = float(len(caps))
        B = len(caps) + plain_tokens
        draft = max(self.costs.draft_seconds, self.cycle_seconds)
        plain_rate = tau / self.costs.cost(B)
        best = tau / (draft + self.costs.cost(B))
        for a, r, j in ranked:
            if j != lens[r]:          # survival is non-increasing along a block: keep prefixes
                continue
            theta = (tau + a) / (draft + self.costs.cost(B + 1))
            if theta <= best:
                break
            lens[r] += 1
            tau += a
            B += 1
            best = theta
        return lens if best > plain_rate else [0] * len(caps)
