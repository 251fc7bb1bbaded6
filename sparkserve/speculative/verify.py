"""Accept rules for speculative verification (lossless).

Greedy: accept the longest prefix of drafts equal to the target's argmax; the bonus token is
the target's argmax at the first mismatch (or after the last draft).
Sampling: standard rejection sampling — accept draft d_k with probability min(1, p_k(d)/q_k(d));
on the first rejection resample from norm(max(p_k - q_k, 0)); if all pass, draw the bonus from
p_{L+1}. p and q are the *processed* distributions (temperature, top-k/p, min-p) of target and
draft, so the output has exactly the target's sampling distribution.

Both rules read the target's rows in order and stop at the first rejection, so the rows after it
are never needed: `accept_batch` computes the LM head lazily (VerifyLogits), in at most two head
calls per cycle — the rows the draft's confidence says may well be read, then the rest for the
requests that got that far. (For 8 rows a big-vocab LM head costs more than twice what it does for
one, and most drafts of a weak draft are rejected at the first slot.)"""
from __future__ import annotations

from collections.abc import Callable, Generator

import torch

from sparkserve.constrained.bitmask import mask_rows
from sparkserve.executor.sampler import processed_probs, sample_from_probs
from sparkserve.kernels import argmax_rows
from sparkserve.sampling_params import SamplingParams

# A row is scored in the first head call when the draft's confidence gives at least these odds that
# acceptance reads it: a second call streams the head's whole weight matrix again, which costs
# several times what one more row of the first call does.
UP_FRONT_SURVIVAL = 0.1

# An accept rule as a generator: it yields how many target logits rows (a prefix) it needs, and
# is sent every row computed so far (at least that many); it returns (number accepted, bonus).
Steps = Generator[int, torch.Tensor, tuple[int, int]]


class VerifyLogits:
    """Target logits of one VERIFY forward, computed on demand: `head` maps hidden rows to logits;
    request i owns the flat rows starts[i] .. starts[i] + lens[i] - 1 of `hidden`."""

    def __init__(self, head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                 starts: list[int], lens: list[int]):
        self.head, self.hidden, self.starts, self.lens = head, hidden, starts, lens
        self.rows: list[torch.Tensor | None] = [None] * len(starts)
        # constrained decoding: request i's rows are masked by masks[i] (bitmask row per logits row)
        self.masks: dict[int, torch.Tensor] = {}

    def have(self, i: int) -> int:
        return 0 if self.rows[i] is None else self.rows[i].shape[0]

    @torch.inference_mode()
    def fill(self, want: dict[int, int]) -> None:
        """Make rows 0 .. want[i] - 1 of each request i available, in one head call."""
        idx, parts = [], []
        for i, m in want.items():
            h, m = self.have(i), min(m, self.lens[i])
            if m > h:
                idx.extend(range(self.starts[i] + h, self.starts[i] + m))
                parts.append((i, m - h))
        if not idx:
            return
        out = self.head(self.hidden[torch.tensor(idx)])
        for (i, _), new in zip(parts, out.split([n for _, n in parts])):
            if i in self.masks:
                h = self.have(i)
                new = mask_rows(new, self.masks[i][h:h + new.shape[0]])
            self.rows[i] = new if self.rows[i] is None else torch.cat([self.rows[i], new])


def accept_steps(req, drafts: list[int], q_probs: torch.Tensor | None) -> Steps:
    """One request's accept rule (greedy or rejection sampling) as a generator."""
    if req.params.is_greedy:
        return greedy_steps(drafts)
    return sampling_steps(drafts, q_probs[:len(drafts)], req.params, req.sampling)


def first_rows(confidence: torch.Tensor | None, num_drafts: int) -> int:
    """Rows to compute up front: the anchor's and those of the drafts that the confidence head
    gives at least UP_FRONT_SURVIVAL odds of passing; all of them without a confidence head."""
    if confidence is None:
        return num_drafts + 1
    rows, survival = 1, 1.0
    for c in confidence[:num_drafts].tolist():      # a few slots: plain floats beat torch calls
        survival *= c
        if survival < UP_FRONT_SURVIVAL:
            break
        rows += 1
    return rows


def accept_batch(items: dict[int, tuple], logits: VerifyLogits,
                 plain: list[int] = ()) -> dict[int, tuple[int, list[int]]]:
    """Verify each items[i] = (req, drafts, q_probs, first) on lazily computed logits (request
    i of `logits`): the first head call computes its `first` leading rows (and row 0 of each
    request in `plain`), a second one the rest for the requests whose rules read further.
    Returns per request (accepted, accepted drafts + bonus)."""
    steps = {i: accept_steps(req, d, q) for i, (req, d, q, _) in items.items()}
    need = {i: next(st) for i, st in steps.items()}
    logits.fill({**{i: 1 for i in plain}, **{i: max(m, items[i][3]) for i, m in need.items()}})
    out = {}
    while need:
        logits.fill(need)
        nxt = {}
        for i in need:
            try:
                nxt[i] = steps[i].send(logits.rows[i])
            except StopIteration as stop:
                n, bonus = stop.value
                out[i] = (n, items[i][1][:n] + [bonus])
        need = nxt
    return out


def _drive(steps: Steps, logits: torch.Tensor) -> tuple[int, int]:
    """Run an accept rule on fully computed logits."""
    try:
        m = next(steps)
        while True:
            if m > logits.shape[0]:
                raise ValueError(f"accept rule needs {m} target rows, got {logits.shape[0]}")
            m = steps.send(logits)
    except StopIteration as stop:
        return stop.value


def raw_logprobs(rows: torch.Tensor, toks: list[int], params: SamplingParams) -> tuple[list[float], list]:
    """Logprobs of committed tokens under the raw target distribution (as plain decoding reports)."""
    if not params.return_logprob:
        return [], []
    lsm = torch.log_softmax(rows.float(), dim=-1)
    lps = lsm[torch.arange(len(toks)), torch.tensor(toks)].tolist()
    k = params.top_logprobs_num
    tops = []
    for r in range(len(toks)):
        if k:
            v, ids = lsm[r].topk(k)
            tops.append(list(zip(ids.tolist(), v.tolist())))
        else:
            tops.append([])
    return lps, tops


def accept_greedy(drafts: list[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """drafts d_1..d_L, target_logits [L+1, V] (row k scores the token after d_k / the anchor).
    Returns (number accepted, bonus token)."""
    return _drive(greedy_steps(drafts), target_logits)


def greedy_steps(drafts: list[int]) -> Steps:
    n, rows = 0, (yield 1)
    while True:
        best = argmax_rows(rows).tolist()
        while n < min(len(best), len(drafts)) and drafts[n] == best[n]:
            n += 1
        if n < len(best):           # a mismatch, or every draft matched and the bonus row is here
            return n, best[n]
        rows = yield len(drafts) + 1


def accept_sampling(drafts: list[int], draft_probs: torch.Tensor, target_logits: torch.Tensor,
                    params: SamplingParams, generator: torch.Generator) -> tuple[int, int]:
    """draft_probs [L, V]: q_k the drafts were sampled from; target_logits [L+1, V]."""
    return _drive(sampling_steps(drafts, draft_probs, params, generator), target_logits)


def sampling_steps(drafts: list[int], draft_probs: torch.Tensor, params: SamplingParams, rng) -> Steps:
    """rng: a torch.Generator, or a request's sampling state (its generator lives on the logits'
    device). The draws are the same whichever rows arrive when."""
    L = len(drafts)
    p = processed_probs((yield 1), params)                          # [rows so far, V]
    generator = rng if isinstance(rng, torch.Generator) else rng.generator(p.device)
    if L:
        u = torch.rand(L, generator=generator, dtype=torch.promote_types(p.dtype, draft_probs.dtype),
                       device=p.device)
        for k in range(L):
            if k >= p.shape[0]:                                     # d_k is reached: its row
                p = processed_probs((yield L + 1), params)
            if u[k] >= p[k, drafts[k]] / draft_probs[k, drafts[k]].clamp_min(1e-30):   # reject d_k
                resid = (p[k] - draft_probs[k]).clamp_min(0)
                total = resid.sum()
                dist = resid / total if total > 0 else p[k]
                return k, int(sample_from_probs(dist[None], generator)[0])
    if p.shape[0] <= L:
        p = processed_probs((yield L + 1), params)
    return L, int(sample_from_probs(p[L:L + 1], generator)[0])
