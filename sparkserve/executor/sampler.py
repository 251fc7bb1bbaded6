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

from sparkserve.sampling_params import SamplingParams

__all__ = [
    "RequestSamplingState",
    "SampleOutput",
    "Sampler",
    "apply_penalties",
    "processed_probs",
    "sample_from_probs",
]


class RequestSamplingState:
    """Per-request sampler state: the RNG and penalty counts, updated in O(1) per accepted token."""

    def __init__(
        self,
        params: SamplingParams,
        prompt_token_ids: Sequence[int] = (),
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.params = params
        # Unseeded requests draw their seed from the global RNG so `torch.manual_seed` reproduces runs.
        self.seed: int = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        self._generator: torch.Generator | None = None
        self.num_generated = 0
        self.uses_repetition = params.repetition_penalty != 1.0
        self.uses_counts = params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
        self.has_penalty = self.uses_repetition or self.uses_counts
        # min_new_tokens bans every id that would end the request: eos and the request's stop ids.
        self.min_tokens_ban = sorted(set(eos_token_ids) | set(params.stop_token_ids or []))
        self._static_fast = params.is_greedy and not self.has_penalty and not params.return_logprob
        # Python lists only until the first sample tells us vocab size and device.
        self._prompt: list[int] = list(prompt_token_ids) if self.uses_repetition else []
        self._pending: list[int] = []
        self._seen: Tensor | None = None  # bool[V]: prompt + generated ids (repetition penalty)
        self._counts: Tensor | None = None  # int32[V]: generated ids only (frequency/presence)
        self._ban_ids: Tensor | None = None

    @property
    def min_tokens_active(self) -> bool:
        return self.num_generated < self.params.min_new_tokens and bool(self.min_tokens_ban)

    @property
    def fast_greedy(self) -> bool:
        """True when this row's token is just argmax of the raw logits."""
        return self._static_fast and self.num_generated >= self.params.min_new_tokens

    def generator(self, device: torch.device) -> torch.Generator:
        """The request's RNG, made once on the device of its first logits (re-seeding would repeat draws)."""
        if self._generator is None:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.seed)
        elif self._generator.device.type != torch.device(device).type:
            raise RuntimeError(f"request RNG lives on {self._generator.device}, logits on {device}")
        return self._generator

    def observe(self, token_id: int) -> None:
        """Record an accepted token (O(1): one element update, no vocab-sized rebuild)."""
        self.num_generated += 1
        if not self.has_penalty:
            return
        if self._seen is None and self._counts is None:
            self._pending.append(token_id)
            return
        if self._seen is not None and token_id < self._seen.numel():
            self._seen[token_id] = True
        if self._counts is not None and token_id < self._counts.numel():
            self._counts[token_id] += 1

    def penalty_tensors(self, vocab_size: int, device: torch.device) -> tuple[Tensor | None, Tensor | None]:
        """(seen, counts) on `device`, allocated on first use from the prompt and pending tokens."""
        if self.has_penalty and self._seen is None and self._counts is None:
            gen = torch.tensor([t for t in self._pending if 0 <= t < vocab_size], dtype=torch.long)
            if self.uses_repetition:
                ids = torch.tensor([t for t in self._prompt if 0 <= t < vocab_size], dtype=torch.long)
                seen = torch.zeros(vocab_size, dtype=torch.bool)
                seen[torch.cat([ids, gen])] = True
                self._seen = seen.to(device)
            if self.uses_counts:
                self._counts = torch.bincount(gen, minlength=vocab_size).to(torch.int32).to(device)
            self._prompt, self._pending = [], []
        return self._seen, self._counts

    def ban_ids(self, device: torch.device) -> Tensor:
        if self._ban_ids is None or self._ban_ids.device != device:
            self._ban_ids = torch.tensor(self.min_tokens_ban, dtype=torch.long, device=device)
        return self._ban_ids


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
        sorted_x, order = torch.sort(x, dim=-1)  # ascending, as HF
        remove = sorted_x.softmax(-1).cumsum(-1) <= 1 - params.top_p
        remove[..., -1] = False  # always keep the most likely token
        x = x.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    if params.min_p > 0.0:
        probs = x.softmax(-1)
        remove = probs < params.min_p * probs.amax(-1, keepdim=True)  # never removes the max
        x = x.masked_fill(remove, float("-inf"))
    return x.softmax(-1)


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
        counts = torch.stack([states[i].penalty_tensors(vocab, dev)[1] for i in cnt_rows]).float()  # type: ignore[misc]
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
    def _with_logprobs(logits: Tensor, next_ids: Tensor, states: Sequence[RequestSamplingState]) -> SampleOutput:
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
