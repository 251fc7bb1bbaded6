"""What the scheduler asks of a speculative drafter (DSpark's draft model, NGRAM's suffix match):
context to keep, a proposal per request, and the timings the verify planner charges. The verify
forward and the accept rules (verify.py) are the scheduler's, the same for every drafter."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from sparkserve.core.pool import Pool
from sparkserve.core.req import Req


@dataclass
class Proposal:
    tokens: list[int]                    # drafts d_1..d_G (the verify length cuts them)
    confidence: torch.Tensor | None      # [G] P(slot accepted | prefix accepted); None: unknown
    q_probs: torch.Tensor | None         # [G, V] distributions the drafts were sampled from (target
                                         # vocab); None for a greedy request
    verify_len: int = 0


@runtime_checkable
class SpecWorker(Protocol):
    num_drafts: int                      # most drafts a proposal holds (decode memory is kept for them)
    # Whether a request whose proposals get nothing verified drafts less often for a while (the
    # scheduler's back-off): worth it where a proposal costs a draft pass, not a lookup.
    backs_off: bool

    def describe(self) -> dict:
        """What /server_info reports of the drafter (verify_mode, block_size at least)."""

    def draft_pools(self) -> list[Pool]:
        """Pools of per-request draft state, moved with a request's prompt under PD."""

    def inject(self, taps: list[torch.Tensor], positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Target rows (their taps, positions and slots) become draft context now."""

    def defer(self, taps: list[torch.Tensor], positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Committed rows that may become draft context later (at the next flush)."""

    def flush(self) -> None:
        """Every row kept back becomes draft context (a request drafts, or one leaves)."""

    def may_pay(self, reqs: list[Req], plain_tokens: int = 0) -> bool:
        """Whether drafting for `reqs` (beside `plain_tokens` plain rows) can pay at all now."""

    def propose(self, reqs: list[Req], plain_tokens: int = 0) -> list[Proposal]:
        """One proposal per request, its verify_len chosen (0: decode plainly this step)."""

    def observe_draft(self, seconds: float, requests: int) -> None:
        """A draft pass (propose) for `requests` requests took `seconds`."""

    def observe_cycle(self, seconds: float, requests: int, drafting: int, tokens: int) -> None:
        """A verify cycle after its draft pass took `seconds`."""

    def observe_plain(self, seconds: float, requests: int) -> None:
        """A plain decode step of `requests` requests took `seconds`."""
