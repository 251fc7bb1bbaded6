"""OutputStream: token ids of one request -> text deltas, cut exactly at stop strings.

Text that could still turn out to be the start of a stop string is held back until the
next tokens decide it, so a streaming client never sees part of a stop string."""
from __future__ import annotations

from sparkserve.frontend.detokenizer import IncrementalDetokenizer
from sparkserve.sampling_params import SamplingParams


class OutputStream:
    def __init__(self, tokenizer, params: SamplingParams):
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens)
        self.stops = [] if params.no_stop_trim else params.stop_strings
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""         # everything decoded so far (before stop trimming)
        self.emitted = 0       # chars of self.text already handed out
        self.done = False

    def push(self, new_ids: list[int], finished: bool) -> str:
        """Feed new tokens; returns the text to hand out now."""
        if self.done:
            return ""
        self.text += self.detok.add(new_ids)
        if finished:
            self.text += self.detok.flush()
        end = len(self.text)
        cut = self._stop_at()
        if cut is not None:
            end, finished = cut, True
        elif not finished:
            end = max(self.emitted, end - self.hold)
        delta = self.text[self.emitted:end]
        self.emitted = end
        if finished:
            self.text = self.text[:end]
            self.done = True
        return delta

    def _stop_at(self) -> int | None:
        hits = [i for i in (self.text.find(s) for s in self.stops) if i >= 0]
        return min(hits) if hits else None
