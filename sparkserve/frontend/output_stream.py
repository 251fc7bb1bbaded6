"""OutputStream: token ids of one request -> text deltas, cut exactly at stop strings.

Text that could still turn out to be the start of a stop string is held back until the
next tokens decide it, so a streaming client never sees part of a stop string. The stop token
that ends a request (EOS or a stop_token_ids entry) is left out of the text as well, special or
not, unless no_stop_trim (SGLang's trim_matched_stop, vLLM's stop_terminated)."""
from __future__ import annotations

from sparkserve.core.finish_reason import FINISH_MATCHED_TOKEN, BaseFinishReason
from sparkserve.frontend.detokenizer import IncrementalDetokenizer
from sparkserve.sampling_params import SamplingParams


def stop_token(reason: BaseFinishReason | None) -> int | None:
    """The token id a request was ended by (EOS or a stop token), or None."""
    return reason.matched if isinstance(reason, FINISH_MATCHED_TOKEN) else None


class OutputStream:
    def __init__(self, tokenizer, params: SamplingParams):
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens)
        self.trim = not params.no_stop_trim
        # a complete grammar ends a request on its last token (FINISH_MATCHED_TOKEN, as SGLang):
        # that one is the answer's, not a stop token, unless it is EOS or a stop_token_ids entry
        self.stop_ids = None if params.grammar is None else \
            set(params.stop_token_ids or ()) | set(tokenizer.eos_token_ids)
        self.stops = [] if params.no_stop_trim else params.stop_strings
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""         # everything decoded so far (before stop trimming)
        self.emitted = 0       # chars of self.text already handed out
        self.done = False
        self.matched_stop: str | None = None   # the stop string the text was cut at

    def push(self, new_ids: list[int], finished: bool, matched: int | None = None) -> str:
        """Feed new tokens; returns the text to hand out now. `matched`: the stop token id that
        finished the request (the last of new_ids), whose text is trimmed."""
        if self.done:
            return ""
        if finished and self.trim and matched is not None and new_ids and new_ids[-1] == matched and \
                (self.stop_ids is None or matched in self.stop_ids):
            new_ids = new_ids[:-1]
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
        """Where the first stop string in the text starts (`matched_stop` set to it: the earliest
        one, the first listed among those starting there), or None."""
        hits = [(i, n, s) for n, s in enumerate(self.stops) if (i := self.text.find(s)) >= 0]
        if not hits:
            return None
        cut, _, self.matched_stop = min(hits)
        return cut
