"""Req: one generation request as the scheduler sees it (tokens, KV bookkeeping, finish).
Requests are tracked as objects (eq=False: identity), never by id() across dicts."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from sparkserve.core.finish_reason import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_MATCHED_STR,
    FINISH_MATCHED_TOKEN,
    BaseFinishReason,
)
from sparkserve.core.sampling_state import RequestSamplingState
from sparkserve.sampling_params import SamplingParams

HiddenPart = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


@dataclass(eq=False)
class Req:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    sampling: RequestSamplingState
    output_ids: list[int] = field(default_factory=list)
    # KV bookkeeping (KVCacheManager): table row, tokens with KV, leading tokens owned by the cache.
    row: int | None = None
    kv_len: int = 0
    cached_len: int = 0
    last_node: Any = None
    lock_start: int = 0             # the cache nodes locked are those from this position to last_node
                                    # (split pool: for the windowed layers; full ones lock the path)
    window_start: int = 0           # sliding window: positions before it gave their pages up (slot 0;
                                    # split pool: their windowed slots)
    cached_tokens: int = 0          # prompt tokens served from the prefix cache (usage)
    finished_reason: BaseFinishReason | None = None
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # prompt logprobs (params.logprob_start_len >= 0): of prompt positions logprob_start_len..,
    # None for position 0 (nothing before it); filled chunk by chunk as the prompt is computed
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    # DSpark, as SGLang's meta_info counts them: verify cycles, drafts they verified, drafts accepted.
    spec_verify_ct: int = 0
    spec_draft_token_num: int = 0
    spec_accept_token_num: int = 0
    spec_idle: int = 0               # consecutive proposals whose verify budget came out 0
    spec_resume_at: int = 0          # draft again once len(output_ids) reaches this (back-off)
    spec_batch: int = 0              # running requests when its latest proposal verified nothing
    # [start, end) positions of committed rows never made draft context (a dark request's:
    # scheduler/draft_pause.py); the draft pass leaves them out of its context
    draft_gaps: list[list[int]] = field(default_factory=list)
    # return_hidden_states: (positions, final normed hidden, concatenated aux taps) of every
    # forward that computed rows of this request; a recomputed position (retraction) comes again.
    hidden_parts: list[HiddenPart] | None = None
    routed_dp_rank: int | None = None   # DP attention: the group asked for (None: load balancing)
    hands_off: bool = False          # PD prefill side: ends after its first token, a decode server goes on
    priority: int = 0                # --enable-priority-scheduling: the waiting queue's order
    # constrained decoding: its GrammarMatcher (sparkserve/constrained), made by the scheduler
    grammar: Any = None

    @property
    def fill_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def wants_input_logprobs(self) -> bool:
        return self.params.return_logprob and self.params.logprob_start_len >= 0

    @property
    def logprob_next(self) -> int:
        """The next prompt position whose logprob is owed (len(input_ids): none owed)."""
        if not self.wants_input_logprobs:
            return len(self.input_ids)
        return self.params.logprob_start_len + len(self.input_logprobs)

    @property
    def prefill_end(self) -> int:
        """Where its prefill stops: the whole sequence for a new request (the last row's logits
        pick the first output); before the last output token for one that resumes (retracted or
        preempted, its output kept), which then decodes that token as a running request does, so
        it draws its next tokens (and drafts) exactly as it would have unpreempted: a seeded
        sampled request gives the same tokens."""
        return len(self.input_ids) + max(0, len(self.output_ids) - 1)

    @property
    def resumes(self) -> bool:
        return bool(self.output_ids)

    @property
    def max_cached_prefix(self) -> int:
        """The longest prefix the prefix cache may serve: one token of the prefill is always
        computed, and no row whose logits give an owed prompt logprob is skipped (SGLang's rule:
        positions from logprob_start_len are computed again)."""
        return min(self.prefill_end - 1, max(0, self.logprob_next - 1))

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def prefill_only(self) -> bool:
        """max_new_tokens 0 with hidden states or prompt logprobs asked for: the prompt runs,
        nothing is generated."""
        wanted = self.hidden_parts is not None or self.wants_input_logprobs
        return self.params.max_new_tokens == 0 and wanted

    def pop_hidden_states(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(final [n, d], aux taps [n, n_taps*d] or None) for positions 0..n-1, n = prompt +
        output - 1: the last output token is sampled, never run through the model (n = prompt
        when there is no output: a prefill-only request). Rows computed again after a
        retraction replace the first ones. None unless hidden states were asked for; the rows
        are handed out once."""
        if self.hidden_parts is None:
            return None
        parts, self.hidden_parts = self.hidden_parts, None
        n = len(self.input_ids) + max(0, len(self.output_ids) - 1)
        final = torch.full((n, parts[0][1].shape[-1] if parts else 0), float("nan"))
        taps = None if not parts or parts[0][2] is None else torch.full((n, parts[0][2].shape[-1]),
                                                                        float("nan"))
        for pos, f, t in parts:
            keep = pos < n                  # drafts accepted past a stop are not output
            final[pos[keep]] = f[keep].float()
            if taps is not None:
                taps[pos[keep]] = t[keep].float()
        return final, taps

    def check_finished(self, eos_ids: set[int], tail_text: Callable[[int], str] | None) -> None:
        """Set finished_reason after a new token: a complete grammar, stop ids / EOS, stop strings, length.
        `tail_text(n)` decodes the last n output tokens (stop strings need text)."""
        p = self.params
        tok = self.output_ids[-1]
        if self.grammar is not None:
            self.grammar.advance(self.output_ids)
            if self.grammar.error is not None:
                self.finished_reason = FINISH_ABORT(self.grammar.error, 400)
                return
        if self.grammar is not None and self.grammar.terminated:
            self.finished_reason = FINISH_MATCHED_TOKEN(tok)      # as SGLang: the grammar is complete
        elif p.stop_token_ids and tok in p.stop_token_ids:
            self.finished_reason = FINISH_MATCHED_TOKEN(tok)
        elif not p.ignore_eos and tok in eos_ids and len(self.output_ids) >= p.min_new_tokens:
            self.finished_reason = FINISH_MATCHED_TOKEN(tok)
        elif p.stop_strings and tail_text is not None:
            width = max(len(s) for s in p.stop_strings) + 8
            text = tail_text(width)
            for s in p.stop_strings:
                if s in text:
                    self.finished_reason = FINISH_MATCHED_STR(s)
                    break
        if self.finished_reason is None and len(self.output_ids) >= p.max_new_tokens:
            self.finished_reason = FINISH_LENGTH(len(self.output_ids))
