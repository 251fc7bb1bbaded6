"""RequestSamplingState: what sampling keeps per request between steps (its RNG, penalty counts,
min_new_tokens ban), beside the Req that owns it. The draws themselves are executor/sampler.py's."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from sparkserve.sampling_params import SamplingParams


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
