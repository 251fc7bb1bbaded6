"""Streaming detokenization: text deltas for newly sampled ids, in time independent of output length.

vLLM's prefix/read offsets: only the ids since the last emitted text, plus the chunk before them as
context, are decoded. The context makes decoders that treat the first token specially (leading-space
stripping, byte fragments) agree with a full decode. Text ending in an incomplete UTF-8 sequence
(a trailing U+FFFD) is held back until the next ids complete it, or until `flush()`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Per-request stream state: feed ids with `add`, read deltas; `text` is everything emitted."""

    def __init__(self, tokenizer: _Decoder, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the context window
        self._read_offset = 0  # ids before this are already emitted as text
        self._chunks: list[str] = []
        self._text_cache: str | None = ""

    @property
    def token_ids(self) -> list[int]:
        return self._ids

    @property
    def text(self) -> str:
        if self._text_cache is None:
            self._text_cache = "".join(self._chunks)
        return self._text_cache

    def _emit(self, delta: str) -> str:
        if delta:
            self._chunks.append(delta)
            self._text_cache = None
        return delta

    def _window(self) -> tuple[str, str]:
        decode = self._tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=self._skip)
        full = decode(self._ids[self._prefix_offset :], skip_special_tokens=self._skip)
        return prefix, full

    def add(self, new_ids: Sequence[int]) -> str:
        """Append ids; return the text they complete ('' while a character is still partial)."""
        if not new_ids:
            return ""
        self._ids.extend(new_ids)
        prefix, full = self._window()
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return ""  # nothing new yet, or a multi-byte character is still incomplete
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._emit(full[len(prefix) :])

    def flush(self) -> str:
        """At end of stream: whatever was held back (an incomplete character decodes to U+FFFD)."""
        if self._read_offset == len(self._ids):
            return ""
        prefix, full = self._window()
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._emit(full[len(prefix) :])
