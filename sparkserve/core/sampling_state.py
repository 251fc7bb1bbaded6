"""RequestSamplingState: what sampling keeps per request between steps (its RNG, penalty counts,
min_new_tokens ban), beside the Req that owns it. The draws themselves are executor/sampler.py's."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from sparkserve.sampling_params import SamplingParams


class IdCounts:
    """How often each id was seen, in order of first sight: O(1) per id, read as two arrays. A
    request's penalties touch the few hundred ids it has seen, not the whole vocabulary."""

    def __init__(self, ids: Sequence[int] = ()) -> None:
        self._pos: dict[int, int] = {}
        self._ids = np.empty(max(16, len(ids)), dtype=np.int64)
        self._counts = np.empty(len(self._ids), dtype=np.int64)
        self._len = 0
        for t in ids:
            self.add(t)

    def add(self, token_id: int) -> None:
        p = self._pos.get(token_id)
        if p is None:
            if self._len == len(self._ids):
                self._ids = np.resize(self._ids, 2 * self._len)
                self._counts = np.resize(self._counts, 2 * self._len)
            p = self._pos[token_id] = self._len
            self._ids[p], self._counts[p] = token_id, 0
            self._len += 1
        self._counts[p] += 1

    def ids(self) -> np.ndarray:
        return self._ids[:self._len]

    def counts(self) -> np.ndarray:
        return self._counts[:self._len]


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
        self._resume_state: torch.Tensor | None = None   # PD: where another scheduler left the RNG
        self.num_generated = 0
        self.uses_repetition = params.repetition_penalty != 1.0
        self.uses_counts = params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
        self.has_penalty = self.uses_repetition or self.uses_counts
        self.has_bias = params.logit_bias is not None
        # min_new_tokens bans every id that would end the request: eos and the request's stop ids.
        self.min_tokens_ban = sorted(set(eos_token_ids) | set(params.stop_token_ids or []))
        self._static_fast = (params.is_greedy and not self.has_penalty and not self.has_bias
                             and not params.return_logprob)
        self.seen = IdCounts(prompt_token_ids if self.uses_repetition else ())   # repetition: prompt + output
        self.generated = IdCounts()                                              # frequency / presence
        self._ban_ids: Tensor | None = None
        self._bias: tuple[Tensor, Tensor] | None = None

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
            if self._resume_state is not None:
                self._generator.set_state(self._resume_state)
        elif self._generator.device.type != torch.device(device).type:
            raise RuntimeError(f"request RNG lives on {self._generator.device}, logits on {device}")
        return self._generator

    def rng_state(self) -> torch.Tensor | None:
        """Where the request's RNG stands (None: it has not drawn yet), so another scheduler can
        go on drawing from there (PD disaggregation: the decode side after the prefill side's
        first token)."""
        return None if self._generator is None else self._generator.get_state()

    def resume_rng(self, state: torch.Tensor | None) -> None:
        """Draw next from `state` (rng_state's, from another scheduler), on whatever device the
        request's logits turn out to live."""
        self._resume_state = state

    def observe(self, token_id: int) -> None:
        """Record an accepted token (O(1))."""
        self.num_generated += 1
        if self.uses_repetition:
            self.seen.add(token_id)
        if self.uses_counts:
            self.generated.add(token_id)

    def ban_ids(self, device: torch.device) -> Tensor:
        if self._ban_ids is None or self._ban_ids.device != device:
            self._ban_ids = torch.tensor(self.min_tokens_ban, dtype=torch.long, device=device)
        return self._ban_ids

    def bias(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """logit_bias as (token ids, values) on `device`."""
        if self._bias is None or self._bias[0].device != device:
            bias = self.params.logit_bias or {}
            self._bias = (torch.tensor(list(bias), dtype=torch.long, device=device),
                          torch.tensor(list(bias.values()), dtype=torch.float32, device=device))
        return self._bias
