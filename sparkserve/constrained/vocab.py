"""The grammar engine's view of the model's vocabulary, built from sparkserve's own Tokenizer (HF
tokenizer.json or GGUF alike): every token's bytes (`Tokenizer.token_bytes`), its special tokens and
EOS ids. llguidance marks a special token by a leading 0xFF byte (no text can spell it), and the
model's logits may be wider than the tokenizer (padding rows): those ids are empty, never allowed."""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import llguidance

SPECIAL_PREFIX = b"\xff"


class TokenSource(Protocol):
    """What the bridge reads of a tokenizer (sparkserve.frontend.tokenizer.Tokenizer has it)."""

    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None
    eos_token_ids: set[int]
    all_special_ids: list[int]

    def token_bytes(self, tid: int) -> bytes: ...

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...


class _Wrapped:
    """llguidance.TokenizerWrapper's input: the token bytes, and text -> ids for its own use."""

    def __init__(self, tok: TokenSource, tokens: Sequence[bytes], special: Iterable[int], eos: int):
        self._tok = tok
        self.tokens = tokens
        self.special_token_ids = sorted(special)
        self.eos_token_id = eos
        self.bos_token_id = tok.bos_token_id

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text)


def ll_tokenizer(tok: TokenSource, n_vocab: int) -> llguidance.LLTokenizer:
    """An LLTokenizer over the model's n_vocab logits (~1 s for a 150k vocabulary: build it once)."""
    special = set(tok.all_special_ids) | set(tok.eos_token_ids)
    tokens = []
    for tid in range(n_vocab):
        if tid >= tok.vocab_size:
            tokens.append(b"")
        elif tid in special:
            tokens.append(SPECIAL_PREFIX + tok.token_bytes(tid))
        else:
            tokens.append(tok.token_bytes(tid))
    eos = sorted(tok.eos_token_ids)
    if not eos:
        raise ValueError("constrained decoding needs the tokenizer's EOS token")
    first = tok.eos_token_id if tok.eos_token_id is not None else eos[0]
    wrapped = llguidance.TokenizerWrapper(_Wrapped(tok, tokens, special, first))
    return llguidance.LLTokenizer(wrapped, n_vocab=n_vocab, eos_token=eos)
