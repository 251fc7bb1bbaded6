"""Batched sampler for one decode step: every row is a different request with its own params.

The distribution a token is drawn from is defined once, in `processed_probs` (after penalties from
`apply_penalties`), and drawn once, in `sample_from_probs`; speculative verification calls the same two
functions, so accept/reject sees exactly what plain decoding would have sampled from. On CPU the
kernels' `sample_rows` makes the same draw from the same distribution without building it over the
whole vocabulary (tests/engine/test_sample_kernel.py holds the two together).

Draws invert each row's cumulative distribution at one uniform draw from the row's own request's
generator, so a seeded request gives the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from sparkserve.constrained.bitmask import GrammarMask
from sparkserve.core.sampling_state import IdCounts, RequestSamplingState
from sparkserve.kernels import argmax_rows, logprob_rows, sample_rows
from sparkserve.sampling_params import SamplingParams

__all__ = [
    "SampleOutput",
    "Sampler",
    "apply_penalties",
    "processed_probs",
    "sample_from_probs",
]


@dataclass
class SampleOutput:
    next_token_ids: list[int]
    logprobs: list[float | None]  # log_softmax(raw logits, grammar-masked) at the chosen id; None unless
    top_logprobs: list[list[tuple[int, float]] | None]  # return_logprob; top_logprobs_num best of them


def processed_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """The distribution sampling draws from: temperature, top_k, top_p, min_p (HF order), softmax.

    Greedy params give a one-hot at the argmax. Rows of the result sum to 1.
    """
    x = logits.float()
    if params.is_greedy:
        return torch.zeros_like(x).scatter_(-1, x.argmax(-1, keepdim=True), 1.0)
    if params.temperature != 1.0:
        x = x / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:  # ties with the k-th value are kept, as in HF
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = x.softmax(-1)
    if params.top_p < 1.0:
        probs = nucleus(probs, params.top_p)
    if params.min_p > 0.0:
        remove = probs < params.min_p * probs.amax(-1, keepdim=True)  # never removes the max
        probs = probs.masked_fill(remove, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


# Candidate set sizes tried before a full sort: a nucleus usually lies within the best few dozen
# tokens, and top-k of a 50k vocabulary costs a small fraction of sorting it.
TOP_P_CANDIDATES = (64, 1024)
CDF_BLOCK = 256                 # ids per block of a row's two-level cumulative sum


def nucleus(probs: Tensor, top_p: float) -> Tensor:
    """probs [N, V] cut to their top-p nucleus and renormalized (HF's rule: a token stays while the
    mass of the tokens ranked above it is below top_p; the best one always stays). A row is ranked
    only within its k best tokens when they hold at least top_p of its mass: every token outside
    them is then cut whatever their order. Rows that need more go on to the next k, then a sort."""
    vocab = probs.shape[-1]
    out = torch.zeros_like(probs)
    rows = None                                             # None: all of them
    for k in (*(c for c in TOP_P_CANDIDATES if c < vocab), vocab):
        sub = probs if rows is None else probs[rows]
        vals, idx = sub.topk(k, dim=-1) if k < vocab else torch.sort(sub, dim=-1, descending=True)
        fits = vals.sum(-1) >= top_p if k < vocab else torch.ones_like(vals[:, 0], dtype=torch.bool)
        kept = vals.masked_fill(vals.cumsum(-1) - vals >= top_p, 0.0)
        kept[:, 0] = vals[:, 0]
        kept = kept / kept.sum(-1, keepdim=True)
        if rows is None and bool(fits.all()):
            return out.scatter_(-1, idx, kept)
        rows = torch.arange(len(probs), device=probs.device) if rows is None else rows
        out[rows[fits]] = out[rows[fits]].scatter_(-1, idx[fits], kept[fits])
        rows = rows[~fits]
        if not len(rows):
            break
    return out


def sample_from_probs(
    probs: Tensor, generator: torch.Generator | Sequence[torch.Generator | None] | None
) -> Tensor:
    """Draw one id per row of `probs` [N, V]; `generator` is one for all rows or one per row."""
    return invert_probs(probs, uniform_draws(probs.shape[0], generator, probs.device))


def invert_probs(probs: Tensor, u: Tensor) -> Tensor:
    """Per row of `probs` [N, V], the first id whose cumulative mass exceeds u * total (u [N] in
    [0, 1), one draw per row: a draw per vocabulary entry would cost more than the rest of sampling
    together). The row is summed in blocks first, so that only the block holding the draw is summed
    entry by entry; the sums are float64 and the draw stays below each total, so a zero-mass block
    or id is never the first to exceed it."""
    n, vocab = probs.shape
    p = probs.float()
    if vocab % CDF_BLOCK:
        p = torch.nn.functional.pad(p, (0, CDF_BLOCK - vocab % CDF_BLOCK))
    blocks = p.view(n, -1, CDF_BLOCK)
    mass = blocks.sum(-1).double()                                  # [n, blocks]
    block, rest = _invert(mass, u)
    within = blocks[torch.arange(n, device=probs.device), block].double()    # [n, CDF_BLOCK]
    return block * CDF_BLOCK + _invert(within, rest / mass.gather(1, block[:, None])[:, 0])[0]


def uniform_draws(n: int, generator: torch.Generator | Sequence[torch.Generator | None] | None,
                  device: torch.device) -> Tensor:
    """n float64 draws in [0, 1): the one a row's token is drawn at, from one generator or one per
    row (each row then the same draw whatever else is in the batch)."""
    if generator is None or isinstance(generator, torch.Generator):
        return torch.rand(n, generator=generator, dtype=torch.float64, device=device)
    assert len(generator) == n, "need one generator per row"
    return torch.cat([torch.rand(1, generator=g, dtype=torch.float64, device=device) for g in generator])


def _invert(weights: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
    """Per row of weights [n, m] (float64, >= 0, some > 0): the first index whose cumulative sum
    exceeds u * total, and how far past the sum before that index u * total lies."""
    cdf = weights.cumsum(-1)
    total = cdf[:, -1:]
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    index = torch.searchsorted(cdf, target, right=True)
    return index[:, 0], (target - (cdf.gather(1, index) - weights.gather(1, index)))[:, 0]


def apply_penalties(logits: Tensor, states: Sequence[RequestSamplingState]) -> Tensor:
    """Repetition (HF), frequency/presence (OpenAI), logit_bias (OpenAI) and min_new_tokens masking.

    Returns `logits` itself when no row needs them, else a new float32 tensor (the raw logits are
    kept intact for logprobs).
    """
    rep_rows = [i for i, s in enumerate(states) if s.uses_repetition]
    cnt_rows = [i for i, s in enumerate(states) if s.uses_counts]
    ban_rows = [i for i, s in enumerate(states) if s.min_tokens_active]
    bias_rows = [i for i, s in enumerate(states) if s.has_bias]
    if not (rep_rows or cnt_rows or ban_rows or bias_rows):
        return logits
    x = logits.float().clone()
    vocab, dev = x.shape[-1], x.device
    if rep_rows:                    # HF's rule: a seen id's logit is divided (or, if < 0, multiplied)
        r, c, _, pen = _penalty_pairs([(i, states[i].seen, (states[i].params.repetition_penalty,))
                                       for i in rep_rows], vocab, dev)
        v = x[r, c]
        x[r, c] = torch.where(v < 0, v * pen[0], v / pen[0])
    if cnt_rows:                    # OpenAI's: minus frequency * count and presence (each id was seen)
        r, c, n, (freq, pres) = _penalty_pairs(
            [(i, states[i].generated, (states[i].params.frequency_penalty, states[i].params.presence_penalty))
             for i in cnt_rows], vocab, dev)
        x[r, c] -= freq * n + pres
    for i in bias_rows:             # after the penalties, as vLLM and SGLang apply it
        ids, values = states[i].bias(dev)
        x[i, ids] += values
    for i in ban_rows:
        ids = states[i].ban_ids(dev)
        x[i, ids[ids < vocab]] = float("-inf")
    return x


def _penalty_pairs(rows: list[tuple[int, IdCounts, tuple[float, ...]]], vocab: int,
                   device: torch.device) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """The (row, id) pairs the penalties touch, each id's count, and each row's factors spread
    over its pairs (ids past the model's vocabulary dropped)."""
    rs, cs, ns, fs = [], [], [], []
    for i, seen, factors in rows:
        ids, counts = seen.ids(), seen.counts()
        keep = (ids >= 0) & (ids < vocab)
        ids, counts = ids[keep], counts[keep]
        rs.append(np.full(len(ids), i, dtype=np.int64))
        cs.append(ids)
        ns.append(counts)
        fs.append(np.tile(np.asarray(factors, dtype=np.float32), (len(ids), 1)))
    row_t, id_t = (torch.from_numpy(np.concatenate(a)).to(device) for a in (rs, cs))
    n = torch.from_numpy(np.concatenate(ns).astype(np.float32)).to(device)
    return row_t, id_t, n, list(torch.from_numpy(np.concatenate(fs)).to(device).unbind(1))


class Sampler:
    """Turns one decode step's logits [B, V] into next tokens (+ logprobs) for B requests."""

    def sample(self, logits: Tensor, states: Sequence[RequestSamplingState],
               grammar: GrammarMask | None = None) -> SampleOutput:
        """`grammar`: the constrained rows' token masks. Their disallowed tokens go to -inf before
        anything else, so the draw, and the logprobs reported, are the masked distribution's."""
        batch = logits.shape[0]
        assert batch == len(states), f"{batch} logit rows for {len(states)} requests"
        if grammar is not None:
            logits = grammar.apply(logits)
        if all(s.fast_greedy for s in states):  # the common case: one argmax, nothing else
            return SampleOutput(argmax_rows(logits).tolist(), [None] * batch, [None] * batch)

        x = apply_penalties(logits, states)
        dev = x.device
        greedy = [i for i, s in enumerate(states) if s.params.is_greedy]
        if len(greedy) == batch:
            next_ids = argmax_rows(x)
        else:
            next_ids = torch.empty(batch, dtype=torch.long, device=dev)
            if greedy:
                idx = torch.tensor(greedy, device=dev)
                next_ids[idx] = argmax_rows(x[idx])
            drawn = [i for i, s in enumerate(states) if not s.params.is_greedy]
            u = uniform_draws(len(drawn), [states[i].generator(dev) for i in drawn], dev)
            params = [states[i].params for i in drawn]
            ids = sample_rows(x, drawn, [p.temperature for p in params], [p.top_k for p in params],
                              [p.top_p for p in params], [p.min_p for p in params], u)
            if ids is None:
                ids = self._draw_with_torch(x, drawn, params, u)
            if len(drawn) == batch:
                next_ids = ids
            else:
                next_ids[torch.tensor(drawn, device=dev)] = ids
        return self._with_logprobs(logits, next_ids, states)

    @staticmethod
    def _draw_with_torch(x: Tensor, rows: list[int], params: list[SamplingParams], u: Tensor) -> Tensor:
        """sample_rows's ids where the kernels cannot take x: processed_probs per group of rows
        that share their params, each row drawn at its u."""
        groups: dict[tuple[float, int, float, float], list[int]] = {}
        for j, p in enumerate(params):
            groups.setdefault((p.temperature, p.top_k, p.top_p, p.min_p), []).append(j)
        ids = torch.empty(len(rows), dtype=torch.long, device=x.device)
        for members in groups.values():
            if len(members) == len(rows) == x.shape[0]:     # one group of every row: no copies
                return invert_probs(processed_probs(x, params[0]), u)
            at = torch.tensor(members, device=x.device)
            picked = x[torch.tensor([rows[j] for j in members], device=x.device)]
            ids[at] = invert_probs(processed_probs(picked, params[members[0]]), u[at])
        return ids

    @staticmethod
    def _with_logprobs(logits: Tensor, next_ids: Tensor,
                       states: Sequence[RequestSamplingState]) -> SampleOutput:
        batch = len(states)
        logprobs: list[float | None] = [None] * batch
        tops: list[list[tuple[int, float]] | None] = [None] * batch
        rows = [i for i, s in enumerate(states) if s.params.return_logprob]
        if not rows:
            return SampleOutput(next_ids.tolist(), logprobs, tops)
        k = max(states[i].params.top_logprobs_num for i in rows)
        ids_l = next_ids.tolist()
        found = logprob_rows(logits, rows, [ids_l[i] for i in rows], k)
        if found is None:
            idx = torch.tensor(rows, device=logits.device)
            raw = torch.log_softmax(logits[idx].float(), dim=-1)
            chosen = raw.gather(1, next_ids[idx, None])[:, 0]
            found = (chosen, *(raw.topk(k, dim=-1) if k else (raw[:, :0], raw[:, :0].long())))
        chosen_l, tv_l, ti_l = (t.tolist() for t in found)
        for j, i in enumerate(rows):
            logprobs[i] = chosen_l[j]
            n = states[i].params.top_logprobs_num
            if n:
                tops[i] = list(zip(ti_l[j][:n], tv_l[j][:n]))
        return SampleOutput(ids_l, logprobs, tops)
