"""Per-request sampling parameters, named and defaulted as in SGLang so its clients work unchanged.

`validate` is the single gate between untrusted request JSON and the sampler: every error is a
`ValueError` whose message starts with the parameter name, so the HTTP layer can turn it into a 400.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Any

# Below this temperature the distribution is numerically a one-hot; SGLang treats it as greedy too.
GREEDY_EPS = 1e-6
MAX_LOGIT_BIAS = 100.0      # OpenAI's range for a logit_bias value

# ---- size limits of one request ------------------------------------------------------------------
# A request is untrusted input: nothing in it may make the server hold or scan without bound. Each
# limit is far above real use and bounds what one request costs; going over it is a 400 naming the
# field. Bounded elsewhere: the body (http_io.MAX_BODY_BYTES, 32 MiB) and each sequence's prompt +
# max_tokens (the context length and the KV pool), so that n x max_tokens of one request is at most
# MAX_SEQUENCES x the context length, made (and held) only as fast as the model generates them.
# Every choice is its own request in the scheduler, with its own copy of the prompt and of the
# sampling parameters below: the per-sequence limits count n times.
MAX_N = 128                 # choices per prompt, as OpenAI: more is a client bug, not a workload
MAX_STOP_STRINGS = 16       # each is searched for in the decoded text after every token
MAX_STOP_CHARS = 1024       # per stop string: a stream holds back that much text (a stop's possible start)
MAX_STOP_TOKEN_IDS = 1024   # every generated token is looked up in the list
MAX_LOGIT_BIAS_ENTRIES = 1024  # each becomes a (token, bias) pair on the device, per sequence
MAX_TOP_LOGPROBS = 20       # OpenAI's: every token of the answer carries that many alternatives
MAX_PROMPTS = 2048          # prompts of a batch (/generate, /v1/completions): as OpenAI's embeddings inputs
MAX_SEQUENCES = 2048        # prompts x n of one request: each is a request in the scheduler
MAX_MESSAGES = 16384        # messages of one chat: the template renders each before the context is checked
MAX_RID_CHARS = 256         # a rid (each choice's is the request's + "-i"); generated ones are <= 41
MAX_HOST_CHARS = 253        # bootstrap_host: a DNS name is at most 253 characters (RFC 1035)
MAX_GRAMMAR_CHARS = 1 << 20  # json_schema / regex / ebnf text: compiled (and cached) per request

# Constrained decoding (SGLang's names): at most one of them; the grammar engine is sparkserve/constrained.
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")

_ALIASES = {"sampling_seed": "seed", "max_tokens": "max_new_tokens"}
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "no_stop_trim", "return_logprob")
_INT_FIELDS = ("max_new_tokens", "min_new_tokens", "top_k", "n", "top_logprobs_num", "logprob_start_len")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                 "presence_penalty")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_finite(v: Any) -> bool:
    """A finite int or float (not a bool); an int too large for a float is not one."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


@dataclass
class SamplingParams:
    """What one request asks of the sampler and of the stop checker."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # prompt logprobs (SGLang's): of the prompt tokens from this position on; -1: none
    logprob_start_len: int = -1
    # token id -> added to its logit before sampling (OpenAI's; JSON keys arrive as strings)
    logit_bias: dict[int, float] | None = None
    # constrained decoding: a JSON schema (JSON text), a regular expression or an EBNF / Lark grammar
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None     # SGLang's: tags (begin, schema, end) triggers open in text
    # the constraint starts after this token's first appearance in the output (a reasoning model's
    # `</think>`: it thinks freely first, as SGLang's reasoning grammar lets it)
    grammar_after_token: int | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Build from request JSON; unknown keys are errors (a typo must not silently do nothing)."""
        if not isinstance(d, dict):
            raise ValueError(f"sampling_params must be an object, got {type(d).__name__}")
        names = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            name = _ALIASES.get(key, key)
            if name not in names:
                raise ValueError(f"{key} is not a known sampling parameter")
            if name in kwargs:
                raise ValueError(f"{name} given twice (as {key} and its alias)")
            kwargs[name] = value
        params = cls(**kwargs)
        params.validate()
        return params

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(field, text) of the constraint asked for, or None."""
        for name in GRAMMAR_FIELDS:
            text = getattr(self, name)
            if text is not None:
                return name, text
        return None

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= GREEDY_EPS or self.top_k == 1

    def validate(self, vocab_size: int | None = None) -> SamplingParams:
        """Raise ValueError on any bad value; normalises top_k=0 (and, given the vocabulary, a top_k
        of all of it or more) to -1. Returns self for chaining."""
        for name in _BOOL_FIELDS:
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise ValueError(f"{name} must be a bool, got {v!r}")
        for name in _INT_FIELDS:
            v = getattr(self, name)
            if not _is_int(v):
                raise ValueError(f"{name} must be an int, got {v!r}")
        for name in _FLOAT_FIELDS:
            v = getattr(self, name)
            if not _is_finite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or (vocab_size is not None and self.top_k >= vocab_size):
            self.top_k = -1         # off; k of the whole vocabulary (or more) keeps every token
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got "
                f"{self.min_new_tokens}"
            )
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not 0 <= self.top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], got "
                             f"{self.top_logprobs_num}")
        if self.logprob_start_len < -1:
            raise ValueError(f"logprob_start_len must be -1 (none) or >= 0, got {self.logprob_start_len}")
        if self.logprob_start_len >= 0 and not self.return_logprob:
            raise ValueError("logprob_start_len: prompt logprobs need return_logprob")
        if self.seed is not None and not (_is_int(self.seed) and -(2**63) <= self.seed < 2**63):
            raise ValueError(f"seed must be an int in [-2**63, 2**63), got {self.seed!r}")
        self._validate_stop(vocab_size)
        self._validate_logit_bias(vocab_size)
        self._validate_grammar(vocab_size)
        return self

    def _validate_grammar(self, vocab_size: int | None) -> None:
        """Shape only (one constraint, a string, JSON for json_schema): whether the grammar compiles
        is the grammar engine's to say (sparkserve/constrained/check.py, in the request path)."""
        given = [name for name in GRAMMAR_FIELDS if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"{given[0]}: give at most one of {', '.join(GRAMMAR_FIELDS)}, got "
                             f"{' and '.join(given)}")
        after = self.grammar_after_token
        if after is not None:
            if not given:
                raise ValueError(f"grammar_after_token: needs a constraint ({', '.join(GRAMMAR_FIELDS)})")
            if not (_is_int(after) and 0 <= after < (vocab_size if vocab_size is not None else 2**31)):
                raise ValueError(f"grammar_after_token must be a token id in the vocabulary, got {after!r}")
        if not given:
            return
        name = given[0]
        text = getattr(self, name)
        if self.min_new_tokens:       # its EOS ban could leave a complete grammar no token at all
            raise ValueError(f"min_new_tokens: cannot be combined with {name} (the grammar decides where the "
                             f"answer ends)")
        if not isinstance(text, str):
            raise ValueError(f"{name} must be a string, got {type(text).__name__}")
        if len(text) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"{name} must be at most {MAX_GRAMMAR_CHARS} characters, got {len(text)}")
        if name == "json_schema":
            try:
                schema = json.loads(text)
            except ValueError as e:
                raise ValueError(f"json_schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"json_schema must be a JSON object (a schema), got "
                                 f"{type(schema).__name__}")

    def _validate_logit_bias(self, vocab_size: int | None) -> None:
        """Checks logit_bias and makes its keys ints (token ids as JSON object keys are strings)."""
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be an object of token id -> bias, got {type(bias).__name__}")
        if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias must have at most {MAX_LOGIT_BIAS_ENTRIES} entries, got "
                             f"{len(bias)}")
        out: dict[int, float] = {}
        for key, value in bias.items():
            # (a token id has at most 10 digits; int() of a longer string only costs time)
            digits = isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10
            tid = key if _is_int(key) else int(key) if digits else None
            if tid is None or tid < 0 or (vocab_size is not None and tid >= vocab_size):
                bound = f" in [0, {vocab_size})" if vocab_size is not None else ""
                raise ValueError(f"logit_bias keys must be token ids{bound}, got {key!r}")
            if not _is_finite(value) or abs(value) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, "
                                 f"{MAX_LOGIT_BIAS:g}], got {value!r} for token {key!r}")
            out[tid] = float(value)
        self.logit_bias = out or None

    def _validate_stop(self, vocab_size: int | None) -> None:
        stop = self.stop
        if stop is not None and not isinstance(stop, (str, list)):
            raise ValueError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
        strings = self.stop_strings
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"stop must have at most {MAX_STOP_STRINGS} strings, got {len(strings)}")
        for s in strings:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"stop strings must be at most {MAX_STOP_CHARS} characters, got one of "
                                 f"{len(s)}")
        ids = self.stop_token_ids
        if ids is None:
            return
        if not isinstance(ids, list):
            raise ValueError(f"stop_token_ids must be a list of ints, got {type(ids).__name__}")
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids must have at most {MAX_STOP_TOKEN_IDS} entries, got {len(ids)}")
        for t in ids:
            if not _is_int(t) or t < 0 or (vocab_size is not None and t >= vocab_size):
                bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
                raise ValueError(f"stop_token_ids entries must be ints in {bound}, got {t!r}")
