"""NGRAM speculative decoding (SGLang's --speculative-algorithm NGRAM, as a linear chain): no draft
model; a request's drafts are what followed the longest earlier occurrence of its latest tokens in
its own prompt and output (prompt lookup). The scheduler verifies them as it does DSpark's, with
the same planner and accept rules; a draft is a point mass, so a sampled request's rejection
sampling accepts d with probability p(d) and resamples from p without d: the output keeps the
target's distribution exactly. Copy-heavy text (code edits, RAG, summaries) accepts long runs."""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from sparkserve.core.pool import Pool
from sparkserve.core.req import Req
from sparkserve.speculative.planner import VerifyPlanner
from sparkserve.speculative.worker import Proposal, SpecWorker

MATCH_TYPES = ("BFS", "PROB")
# Prior of a draft's acceptance odds after a match of k tokens, before verifies of such drafts were
# seen: k / (k + 1), worth PRIOR_SEEN drafts (a long match is likely a copy; a planner that started
# from odds too low to verify anything would never learn otherwise).
PRIOR_SEEN = 2.0


def longest_suffix_match(h: np.ndarray, n: int, min_len: int, max_len: int) -> tuple[int, np.ndarray]:
    """(k, ends): the longest k <= max_len such that the last k tokens of h[:n] occurred before,
    ending at each of `ends` (ascending, each < n - 1, so a token follows it); (0, []) when k <
    min_len. One pass over the history, then only over the surviving candidates."""
    none = np.empty(0, dtype=np.int64)
    if n < 2:
        return 0, none
    ends = np.flatnonzero(h[:n - 1] == h[n - 1])
    k = 1 if ends.size else 0
    while k and k < max_len and k < n - 1:
        more = ends[ends >= k]
        more = more[h[more - k] == h[n - 1 - k]]
        if not more.size:
            break
        ends, k = more, k + 1
    return (k, ends) if k >= max(min_len, 1) else (0, none)


def continuation(h: np.ndarray, n: int, ends: np.ndarray, count: int, by_frequency: bool) -> list[int]:
    """`count` tokens after the match. BFS (recency): what followed its latest occurrence. PROB
    (frequency): at each step the token that most occurrences still agreeing so far continue
    with (ties: the latest's). A continuation that runs into the match itself goes on as the
    drafts do (a period repeats), so a draft never stops short for want of history."""
    if not by_frequency:
        e = int(ends[-1])
        drafts = h[e + 1:min(n, e + 1 + count)].tolist()
        period = n - 1 - e
        while len(drafts) < count:
            drafts.append(drafts[len(drafts) - period])
        return drafts
    drafts: list[int] = []
    for i in range(count):
        pos = ends + 1 + i
        inside = pos < n
        vals = np.where(inside, h[np.minimum(pos, n - 1)],
                        np.asarray(drafts + [0], dtype=h.dtype)[np.clip(pos - n, 0, len(drafts))])
        if ends.size == 1:
            tok = int(vals[0])
        else:
            uniq, counts = np.unique(vals, return_counts=True)
            best = uniq[counts == counts.max()]
            tok = int(vals[np.flatnonzero(np.isin(vals, best))[-1]])   # the latest of the most frequent
            ends = ends[vals == tok]
        drafts.append(tok)
    return drafts


@dataclass
class _History:
    """A request's tokens (prompt + output) as a growing array, and its latest verified proposal."""
    buf: np.ndarray = field(default_factory=lambda: np.empty(256, dtype=np.int64))
    n: int = 0
    pending: tuple[Proposal, int, int] | None = None    # (proposal, output length then, match bucket)

    def sync(self, req: Req) -> None:
        ids_len = len(req.input_ids) + len(req.output_ids)
        if self.n > ids_len:                              # cannot happen: outputs only grow
            self.n = 0
        if self.n < ids_len:
            new = (req.input_ids + req.output_ids)[self.n:] if self.n < len(req.input_ids) \
                else req.output_ids[self.n - len(req.input_ids):]
            if ids_len > self.buf.size:
                grown = np.empty(max(ids_len, 2 * self.buf.size), dtype=np.int64)
                grown[:self.n] = self.buf[:self.n]
                self.buf = grown
            self.buf[self.n:ids_len] = new
            self.n = ids_len


class NgramWorker(SpecWorker):
    backs_off = False       # a lookup costs next to nothing: look again at every step
    def __init__(self, num_drafts: int, min_window: int, max_window: int, match_type: str,
                 planner: VerifyPlanner, vocab_size: int, device: torch.device = torch.device("cpu")):
        """`num_drafts`: most drafts a proposal holds; a match is min_window..max_window tokens
        long; `vocab_size`, `device`: of the target's logits (a sampled request's point-mass q)."""
        if match_type not in MATCH_TYPES:
            raise ValueError(f"match type {match_type!r} is not one of {MATCH_TYPES}")
        self.num_drafts = num_drafts
        self.min_window, self.max_window = min_window, max_window
        self.by_frequency = match_type == "PROB"
        self.match_type = match_type
        self.planner = planner
        self.vocab_size = vocab_size
        self.device = device
        self.histories: weakref.WeakKeyDictionary[Req, _History] = weakref.WeakKeyDictionary()
        # per match length (1..max_window): drafts verify reached / accepted
        self.reached = np.zeros(max_window + 1)
        self.accepted = np.zeros(max_window + 1)

    def describe(self) -> dict:
        return {"algorithm": "NGRAM", "verify_mode": self.planner.mode, "block_size": self.num_drafts,
                "min_match_window": self.min_window, "max_match_window": self.max_window,
                "match_type": self.match_type}

    # ---- no draft model: no context to keep ---------------------------------------------------
    def draft_pools(self) -> list[Pool]:
        return []

    def inject(self, taps, positions, slots) -> None:
        pass

    def defer(self, taps, positions, slots) -> None:
        pass

    def flush(self) -> None:
        pass

    # ---- planner ------------------------------------------------------------------------------
    def observe_draft(self, seconds: float, requests: int) -> None:
        self.planner.observe_draft(seconds, requests)

    def observe_cycle(self, seconds: float, requests: int, drafting: int, tokens: int) -> None:
        self.planner.observe_cycle(seconds, requests, drafting, tokens)

    def observe_plain(self, seconds: float, requests: int) -> None:
        self.planner.observe_plain(seconds, requests)

    def caps(self, reqs: list[Req]) -> list[int]:
        """Most drafts each request may verify: one token of its budget is the bonus."""
        return [max(0, min(self.num_drafts, r.params.max_new_tokens - len(r.output_ids) - 1)) for r in reqs]

    def may_pay(self, reqs: list[Req], plain_tokens: int = 0) -> bool:
        return self.planner.may_pay(self.caps(reqs), plain_tokens)

    # ---- proposals ----------------------------------------------------------------------------
    def propose(self, reqs: list[Req], plain_tokens: int = 0) -> list[Proposal]:
        caps = self.caps(reqs)
        found: list[tuple[list[int], int]] = []
        for req, cap in zip(reqs, caps):
            hist = self.histories.get(req)
            if hist is None:
                hist = self.histories[req] = _History()
            hist.sync(req)
            self._learn(req, hist)
            k, ends = longest_suffix_match(hist.buf, hist.n, self.min_window, self.max_window)
            drafts = continuation(hist.buf, hist.n, ends, cap, self.by_frequency) if k and cap else []
            found.append((drafts, k))
        confs = [self._confidence(k, len(d)) for d, k in found]
        lens = self.planner.plan(confs, [len(d) for d, _ in found], plain_tokens)
        out = []
        for req, (drafts, k), conf, n in zip(reqs, found, confs, lens):
            q = None if req.params.is_greedy or not n else self._point_mass(drafts[:n])
            p = Proposal(drafts, conf, q, n)
            self.histories[req].pending = (p, len(req.output_ids), k) if n else None
            out.append(p)
        return out

    def _point_mass(self, drafts: list[int]) -> torch.Tensor:
        """q of drafts that were not sampled: all mass on the draft (verify.py's rule then accepts
        d with probability p(d) and resamples from p without d)."""
        q = torch.zeros(len(drafts), self.vocab_size, device=self.device)
        q[torch.arange(len(drafts)), torch.tensor(drafts)] = 1.0
        return q

    def _confidence(self, match_len: int, count: int) -> torch.Tensor:
        """Per slot, the share of drafts after a match this long that were accepted once verify
        reached them, the same for every slot (one rate learns from every slot verified, so the
        planner's first short verifies teach it what longer ones would accept). Verify reads the
        LM head rows up front by these odds; adaptive verify plans with them."""
        prior = PRIOR_SEEN * match_len / (match_len + 1)
        rate = (self.accepted[match_len] + prior) / (self.reached[match_len] + PRIOR_SEEN)
        return torch.full((count,), float(rate))

    def _learn(self, req: Req, hist: _History) -> None:
        """The verdict on the request's previous proposal, read off the tokens it committed: the
        drafts equal to them were accepted (a rejected draft is never the token committed
        instead: greedy commits the argmax, sampling the residual, both other than the draft)."""
        if hist.pending is None:
            return
        prop, start, k = hist.pending
        hist.pending = None
        committed = req.output_ids[start:start + prop.verify_len]
        n = 0
        while n < len(committed) and committed[n] == prop.tokens[n]:
            n += 1
        if not committed:
            return
        self.reached[k] += min(n + 1, prop.verify_len)
        self.accepted[k] += n
