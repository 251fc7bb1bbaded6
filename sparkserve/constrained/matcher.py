"""One request's grammar state: a copy of its compiled matcher, kept caught up with the request's
output tokens. Catching up from `output_ids` (rather than being told each token) is what keeps the
constraint across retraction (the tokens stay, so does the state) and PD disaggregation (the decode
side replays the prefill side's first token). A reasoning model's constraint may start only after
its thinking ends (`after_token`, its `</think>`): until that token is in the output every token is
allowed, and drafts that cross it are checked from it on."""
from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

import llguidance
import torch
from torch import Tensor


def bitmask_words(n_vocab: int) -> int:
    """int32 words of one row's token bitmask (bit t of word t // 32: token t allowed)."""
    return (n_vocab + 31) // 32


class GrammarMatcher:
    def __init__(self, field: str, compiled: Future, words: int, after_token: int | None = None):
        self.field = field
        self.words = words
        self._compiled = compiled
        self._m: llguidance.LLMatcher | None = None
        self._error: str | None = None
        self.consumed = 0               # output tokens the matcher has taken (or passed over)
        self.after_token = after_token
        self.start = 0 if after_token is None else None     # where the constraint starts in the output
        self._scanned = 0

    def _started(self, output_ids: Sequence[int]) -> bool:
        """Whether the constraint applies after `output_ids` (its after_token came)."""
        if self.start is None:
            for i in range(self._scanned, len(output_ids)):
                if output_ids[i] == self.after_token:
                    self.start = self.consumed = i + 1
                    break
            self._scanned = len(output_ids)
        return self.start is not None

    @property
    def ready(self) -> bool:
        """Whether the compile finished (a request waits in the queue until then)."""
        return self._compiled.done()

    def _matcher(self) -> llguidance.LLMatcher | None:
        if self._m is None and self._error is None:
            try:
                self._m = self._compiled.result().deep_copy()
            except Exception as e:      # a compile that failed here fails the request, not the scheduler
                named = isinstance(e, ValueError)       # ours start with the field's name
                self._error = str(e) if named else f"{self.field}: {type(e).__name__}: {e}"
        return self._m

    def advance(self, output_ids: Sequence[int]) -> None:
        """Take the output tokens not taken yet."""
        if not self._started(output_ids):
            return
        m = self._matcher()
        if m is None or self.consumed >= len(output_ids):
            return
        new = list(output_ids[self.consumed:])
        self.consumed = len(output_ids)
        if not m.consume_tokens(new) and self._error is None:
            self._error = f"{self.field}: the grammar rejected token {new}: {m.get_error()}"

    @property
    def error(self) -> str | None:
        return self._error

    @property
    def terminated(self) -> bool:
        """The grammar is complete and takes nothing more (the request stops here)."""
        return self.start is not None and self._m is not None and self._error is None and self._m.is_stopped()

    def fill(self, bitmask: Tensor, row: int, output_ids: Sequence[int]) -> None:
        """Row `row` of `bitmask` [n, words] (int32, host) := the tokens allowed next. A matcher in
        error allows everything (the request is ended with the error at its next token)."""
        self.advance(output_ids)
        m = self._m
        if self.start is None or m is None or self._error is not None:
            bitmask[row] = -1
            return
        v = bitmask[row]
        m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    def cut_drafts(self, drafts: Sequence[int], output_ids: Sequence[int]) -> int:
        """How many of `drafts` to verify: the ones the grammar allows and the first it does not
        (whose rejection, certain under the mask, draws from the residual as the lossless rule
        asks); the drafts after it could never be accepted."""
        self.advance(output_ids)
        free = self._free_drafts(drafts)
        if free == len(drafts):
            return free
        m = self._matcher()
        if m is None or self._error is not None:
            return free
        return free + min(len(drafts) - free, m.validate_tokens(list(drafts[free:])) + 1)

    def _free_drafts(self, drafts: Sequence[int]) -> int:
        """How many leading drafts the constraint does not apply to: none once it started, else
        those up to and including the after_token (all of them when it is not among them)."""
        if self.start is not None:
            return 0
        return next((k + 1 for k, t in enumerate(drafts) if t == self.after_token), len(drafts))

    def walker(self, output_ids: Sequence[int]) -> llguidance.LLMatcher | None:
        """A copy of the state after `output_ids` to walk drafts with while they are drafted (the
        matcher itself is left as it is); None when the matcher is in error."""
        self.advance(output_ids)
        if self.start is None or self._m is None or self._error is not None:
            return None
        return self._m.deep_copy()

    def draft_masks(self, drafts: Sequence[int], output_ids: Sequence[int]) -> Tensor:
        """[len(drafts) + 1, words]: row k allows what may follow the output and drafts[:k]; rows
        past the first draft the grammar rejects allow everything (verify never reads them)."""
        bits = torch.full((len(drafts) + 1, self.words), -1, dtype=torch.int32)
        self.advance(output_ids)
        free = self._free_drafts(drafts)            # rows up to the one after them allow everything
        if free == len(drafts) and self.start is None:
            return bits
        m = self._matcher()
        if m is None or self._error is not None:
            return bits
        v = bits[free]
        m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())
        rest = list(drafts[free:])
        valid = m.validate_tokens(rest) if rest else 0  # consuming a rejected token ends a matcher in error
        if not valid:
            return bits
        # A copy walks the drafts (a few us): consume + rollback on the matcher itself leaves a
        # wrong state once an EOS draft was taken and masked (llguidance 1.9; found by
        # test_dspark_grammar_sampling, pinned by test_draft_masks_leave_the_matcher_as_it_was).
        walk = m.deep_copy()
        for k in range(valid):
            walk.consume_token(rest[k])
            v = bits[free + k + 1]
            walk.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())
        return bits
