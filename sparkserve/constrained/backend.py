"""The grammar backend a scheduler owns: compiles each constraint once, on a small thread pool (the
scheduler loop never waits for a compile: a request waits in the queue until its grammar is ready),
and keeps the compiled matchers by (field, text), each request starting from a copy."""
from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import torch

from sparkserve.constrained.check import grammar_source
from sparkserve.constrained.matcher import GrammarMatcher, bitmask_words
from sparkserve.constrained.vocab import TokenSource, ll_tokenizer
from sparkserve.core.finish_reason import FINISH_ABORT
from sparkserve.core.req import Req

COMPILE_THREADS = 2
CACHE_ENTRIES = 256         # compiled grammars kept (a JSON schema's matcher holds a few MB at most)


class GrammarBackend:
    """llguidance over one model's vocabulary (n_vocab: the width of its logits)."""

    def __init__(self, tok: TokenSource, n_vocab: int):
        self.n_vocab = n_vocab
        self.words = bitmask_words(n_vocab)
        self._source = tok
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()

    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        """Built on first use, on a compile thread (it takes a second or so)."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = ll_tokenizer(self._source, self.n_vocab)
            return self._tokenizer

    def _special_tokens(self) -> dict[str, int]:
        """Each special token's text -> its id (a structural tag's triggers may be such tokens)."""
        src = self._source
        return {src.token_bytes(t).decode("utf-8", "replace"): t
                for t in src.all_special_ids if t < self.n_vocab}

    def _compile(self, field: str, text: str) -> llguidance.LLMatcher:
        special = self._special_tokens() if field == "structural_tag" else None
        matcher = llguidance.LLMatcher(self._ll_tokenizer(), grammar_source(field, text, special))
        if matcher.is_error():
            raise ValueError(f"{field}: invalid {field}: {matcher.get_error()}")
        scratch = torch.empty(1, self.words, dtype=torch.int32)
        matcher.unsafe_compute_mask_ptr(scratch.data_ptr(), scratch.numel() * 4)   # warms its lexer
        return matcher

    def compiled(self, field: str, text: str) -> Future:
        """The compile of (field, text): started now, or the one started (or done) before."""
        key = (field, text)
        fut = self._cache.get(key)
        if fut is None:
            fut = self._cache[key] = self._pool.submit(self._compile, field, text)
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return fut

    def matcher(self, field: str, text: str, after_token: int | None = None) -> GrammarMatcher:
        return GrammarMatcher(field, self.compiled(field, text), self.words, after_token)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def make_grammar_backend(name: str, tok: TokenSource | None, n_vocab: int) -> GrammarBackend | None:
    """--grammar-backend's backend (None: off, or no tokenizer to build one from; ServerArgs refuses
    xgrammar at start-up)."""
    return None if name == "none" or tok is None else GrammarBackend(tok, n_vocab)


def attach_grammar(req: Req, backend: GrammarBackend | None) -> bool:
    """Give a constrained request its matcher (its compile starts now); False, with the request
    finished, when this scheduler has no grammar backend (the frontend refuses such requests first)."""
    field, text = req.params.grammar
    if backend is None:
        req.finished_reason = FINISH_ABORT(f"{field}: constrained decoding is off on this server", 400)
        return False
    if req.grammar is None:
        req.grammar = backend.matcher(field, text, req.params.grammar_after_token)
    return True
