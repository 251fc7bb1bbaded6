"""Batched sampler for one decode step: every row is a different request with its own params.

The distribution a token is drawn from is defined once, in `processed_probs` (after penalties from
`apply_penalties`), and drawn once, in `sample_from_probs`; speculative verification calls the same two
functions, so accept/reject sees exactly what plain decoding would have sampled from.

Draws use the exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. picks index i with probability
p_i. Each row draws its noise from its own request's generator, then one batched argmax samples all
rows, so a seeded request gives the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from sparkserve.core.sampling_state import RequestSamplingState
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
    logprobs: list[float | None]  # log_softmax(raw logits) at the chosen id; None unless return_logprob
    top_logprobs: list[list[tuple[int, float]] | None]  # top_logprobs_num best of the raw distribution


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
    if params.top_p < 1.0:
        x = x.masked_fill(outside_top_p(x, params.top_p), float("-inf"))
    if params.min_p > 0.0:
        probs = x.softmax(-1)
        remove = probs < params.min_p * probs.amax(-1, keepdim=True)  # never removes the max
        x = x.masked_fill(remove, float("-inf"))
    return x.softmax(-1)


# Candidate set sizes tried before a full sort: a nucleus usually lies within the best few dozen
# tokens, and top-k of a 50k vocabulary costs a small fraction of sorting it.
TOP_P_CANDIDATES = (64, 1024)


def outside_top_p(x: Tensor, top_p: float) -> Tensor:
    """Bool mask of the tokens top-p sampling removes (HF's rule: a token stays while the mass of
    the tokens ranked above it is below top_p; the best one always stays). The ranking is sorted
    only within the k best tokens when, in every row, they hold at least top_p of the mass: every
    token outside them is then removed whatever their order."""
    probs = x.softmax(-1)
    vocab = x.shape[-1]
    for k in TOP_P_CANDIDATES:
        if k >= vocab:
            break
        vals, idx = probs.topk(k, dim=-1)                   # descending
        if bool((vals.sum(-1) >= top_p).all()):
            keep = vals.cumsum(-1) - vals < top_p
            keep[..., 0] = True
            return torch.ones_like(probs, dtype=torch.bool).scatter(-1, idx, ~keep)
    sorted_x, order = torch.sort(x, dim=-1)  # ascending, as HF
    remove = sorted_x.softmax(-1).cumsum(-1) <= 1 - top_p
    remove[..., -1] = False  # always keep the most likely token
    return remove.scatter(-1, order, remove)


def sample_from_probs(
    probs: Tensor, generator: torch.Generator | Sequence[torch.Generator | None] | None
) -> Tensor:
    """Draw one id per row of `probs` [N, V]; `generator` is one for all rows or one per row."""
    noise = torch.empty_like(probs, dtype=torch.float32)
    if generator is None or isinstance(generator, torch.Generator):
        noise.exponential_(generator=generator)
    else:
        assert len(generator) == probs.shape[0], "need one generator per row"
        for row, gen in zip(noise, generator):
            row.exponential_(generator=gen)
    # Exp(1) can round to 0; 0/0 would be NaN and argmax would pick a banned token.
    noise.clamp_min_(torch.finfo(torch.float32).tiny)
    return (probs.float() / noise).argmax(-1)


def apply_penalties(logits: Tensor, states: Sequence[RequestSamplingState]) -> Tensor:
    """Repetition (HF), frequency/presence (OpenAI) and min_new_tokens masking.

    Returns `logits` itself when no row needs them, else a new float32 tensor (the raw logits are
    kept intact for logprobs).
    """
    rep_rows = [i for i, s in enumerate(states) if s.uses_repetition]
    cnt_rows = [i for i, s in enumerate(states) if s.uses_counts]
    ban_rows = [i for i, s in enumerate(states) if s.min_tokens_active]
    if not (rep_rows or cnt_rows or ban_rows):
        return logits
    x = logits.float().clone()
    vocab, dev = x.shape[-1], x.device
    if rep_rows:
        idx = torch.tensor(rep_rows, device=dev)
        seen = torch.stack([states[i].penalty_tensors(vocab, dev)[0] for i in rep_rows])  # type: ignore[misc]
        pen = torch.tensor([states[i].params.repetition_penalty for i in rep_rows], device=dev)[:, None]
        sub = x[idx]
        x[idx] = torch.where(seen, torch.where(sub < 0, sub * pen, sub / pen), sub)
    if cnt_rows:
        idx = torch.tensor(cnt_rows, device=dev)
        # type: ignore[misc]
        counts = torch.stack([states[i].penalty_tensors(vocab, dev)[1] for i in cnt_rows]).float()
        freq = torch.tensor([states[i].params.frequency_penalty for i in cnt_rows], device=dev)[:, None]
        pres = torch.tensor([states[i].params.presence_penalty for i in cnt_rows], device=dev)[:, None]
        x[idx] -= freq * counts + pres * (counts > 0).float()
    for i in ban_rows:
        ids = states[i].ban_ids(dev)
        x[i, ids[ids < vocab]] = float("-inf")
    return x


class Sampler:
    """Turns one decode step's logits [B, V] into next tokens (+ logprobs) for B requests."""

    def sample(self, logits: Tensor, states: Sequence[RequestSamplingState]) -> SampleOutput:
        batch = logits.shape[0]
        assert batch == len(states), f"{batch} logit rows for {len(states)} requests"
        if all(s.fast_greedy for s in states):  # the common case: one argmax, nothing else
            return SampleOutput(logits.argmax(-1).tolist(), [None] * batch, [None] * batch)

        x = apply_penalties(logits, states)
        dev = x.device
        greedy = [i for i, s in enumerate(states) if s.params.is_greedy]
        if len(greedy) == batch:
            next_ids = x.argmax(-1)
        else:
            next_ids = torch.empty(batch, dtype=torch.long, device=dev)
            if greedy:
                idx = torch.tensor(greedy, device=dev)
                next_ids[idx] = x[idx].argmax(-1)
            groups: dict[tuple[float, int, float, float], list[int]] = {}
            for i, s in enumerate(states):
                if not s.params.is_greedy:
                    p = s.params
                    groups.setdefault((p.temperature, p.top_k, p.top_p, p.min_p), []).append(i)
            for rows in groups.values():
                idx = torch.tensor(rows, device=dev)
                probs = processed_probs(x[idx], states[rows[0]].params)
                gens = [states[i].generator(dev) for i in rows]
                next_ids[idx] = sample_from_probs(probs, gens)
        return self._with_logprobs(logits, next_ids, states)

    @staticmethod
    def _with_logprobs(logits: Tensor, next_ids: Tensor,
                       states: Sequence[RequestSamplingState]) -> SampleOutput:
        batch = len(states)
        logprobs: list[float | None] = [None] * batch
        tops: list[list[tuple[int, float]] | None] = [None] * batch
        rows = [i for i, s in enumerate(states) if s.params.return_logprob]
        if not rows:
            return SampleOutput(next_ids.tolist(), logprobs, tops)
        idx = torch.tensor(rows, device=logits.device)
        raw = torch.log_softmax(logits[idx].float(), dim=-1)
        chosen = raw.gather(1, next_ids[idx, None])[:, 0]
        k = max(states[i].params.top_logprobs_num for i in rows)
        top_v, top_i = raw.topk(k, dim=-1) if k else (raw[:, :0], raw[:, :0].long())
        ids_l, chosen_l, tv_l, ti_l = next_ids.tolist(), chosen.tolist(), top_v.tolist(), top_i.tolist()
        for j, i in enumerate(rows):
            logprobs[i] = chosen_l[j]
            n = states[i].params.top_logprobs_num
            if n:
                tops[i] = list(zip(ti_l[j][:n], tv_l[j][:n]))
        return SampleOutput(ids_l, logprobs, tops)
