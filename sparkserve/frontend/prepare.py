"""Request preparation shared by the offline Engine and the HTTP server.

Between untrusted input and a scheduler: sampling params from request JSON, the checks a prompt
must pass (vocabulary, context length, KV pool), the fan-out of `n` into independent sequences
(seed + i each), and SGLang's `meta_info`. Every failure is a ValueError whose message starts
with the offending parameter's name, so the server can answer 400 naming it. No torch here: the
HTTP frontend process imports this module and holds no model."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

from sparkserve.core.finish_reason import BaseFinishReason
from sparkserve.sampling_params import MAX_N, SamplingParams


@dataclass(frozen=True)
class Limits:
    """Model facts a prompt is checked against (from the scheduler, in or out of process)."""
    vocab_size: int
    context_length: int
    # most tokens one sequence can reach: the KV pool, unless a sliding window frees pages
    pool_tokens: int

    @property
    def max_sequence(self) -> int:
        return min(self.context_length, self.pool_tokens)


def parse_params(sp: dict | SamplingParams | None) -> SamplingParams:
    """A fresh, validated SamplingParams from None, a dict (request JSON) or another instance."""
    if sp is None:
        return SamplingParams().validate()
    if isinstance(sp, SamplingParams):
        return dataclasses.replace(sp).validate()
    return SamplingParams.from_dict(sp)


def params_list(sp: Any, n: int) -> list[SamplingParams]:
    """One SamplingParams per prompt: a list must match the prompts, one value is shared."""
    if isinstance(sp, (list, tuple)):
        if len(sp) != n:
            raise ValueError(f"sampling_params: got {len(sp)} for {n} prompts")
        return [parse_params(x) for x in sp]
    return [parse_params(sp) for _ in range(n)]


# What a single prompt of each kind looks like, in words for errors.
PROMPT_KINDS = {"text": "a string", "ids": "a list of token ids",
                "messages": "a list of chat messages (dicts)"}


def prompt_kind(value: Any) -> str | None:
    """Which kind of single prompt `value` is: text, token ids, or a chat conversation."""
    if isinstance(value, str):
        return "text"
    if isinstance(value, (list, tuple)):
        if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return "ids"
        if all(isinstance(t, dict) for t in value):
            return "messages"
    return None


def as_batch(value: Any, name: str, kinds: tuple[str, ...],
             arg_for: dict[str, str] | None = None) -> tuple[list, bool]:
    """(prompts, single): one prompt of an accepted kind, or a non-empty list of them. An empty
    list is one empty prompt where token ids are accepted (the prompt check then names it).
    Anything else is a TypeError naming `name`; `arg_for` maps another kind to the argument
    that takes it, for the hint."""
    kind = prompt_kind(value)
    if kind in kinds:
        return [value], True
    if isinstance(value, (list, tuple)) and value:
        found = [prompt_kind(v) for v in value]
        if all(k in kinds for k in found):
            return list(value), False
        kind = found[0] if len(set(found)) == 1 else None
        got = f"a list of {PROMPT_KINDS[kind]}" if kind else "a list mixing other values"
    elif isinstance(value, (list, tuple)):
        raise ValueError(f"{name}: the batch is empty")
    else:
        got = type(value).__name__
    expected = " or ".join(f"{PROMPT_KINDS[k]} (or a list of them)" for k in kinds)
    hint = f"; pass it as {arg_for[kind]}=" if arg_for and kind in arg_for else ""
    raise TypeError(f"{name}: expected {expected}, got {got}{hint}")


def check_prompt(ids: Sequence[int], params: SamplingParams, limits: Limits,
                 max_tokens_name: str = "max_new_tokens") -> None:
    """Raise ValueError unless `ids` + `params` can run to completion on this model and pool."""
    params.validate(limits.vocab_size)
    if params.n > MAX_N:
        raise ValueError(f"n must be at most {MAX_N}, got {params.n}")
    if not ids:
        raise ValueError("prompt is empty: give at least one token")
    bad = [t for t in ids if not (isinstance(t, int) and not isinstance(t,
                                                                        bool) and 0 <= t < limits.vocab_size)]
    if bad:
        raise ValueError(f"input_ids: token id {bad[0]!r} is outside the vocabulary [0, {limits.vocab_size})")
    if params.logprob_start_len >= len(ids):
        raise ValueError(f"logprob_start_len must be below the prompt's length ({len(ids)} tokens), got "
                         f"{params.logprob_start_len}")
    total = len(ids) + params.max_new_tokens
    if total > limits.context_length:
        raise ValueError(f"{max_tokens_name}: prompt ({len(ids)} tokens) + {max_tokens_name} "
                         f"({params.max_new_tokens}) = {total} exceeds the context length "
                         f"{limits.context_length}")
    if total > limits.pool_tokens:
        raise ValueError(f"{max_tokens_name}: prompt ({len(ids)} tokens) + {max_tokens_name} "
                         f"({params.max_new_tokens}) = {total} tokens exceeds the KV pool "
                         f"({limits.pool_tokens} tokens); raise --max-total-tokens")


def room_left(ids: Sequence[int], limits: Limits) -> int:
    """The largest max_new_tokens this prompt allows (a default when the client gives none)."""
    return max(0, limits.max_sequence - len(ids))


def fan_out(rid: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """`n` independent sequences: rid-i, n=1 each, seed+i when seeded (so choices differ)."""
    if params.n == 1:
        return [(rid, params)]
    out = []
    for i in range(params.n):
        p = dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
        out.append((f"{rid}-{i}", p))
    return out


def meta_info(rid: str, finish_reason: BaseFinishReason | None, prompt_tokens: int, completion_tokens: int,
              cached_tokens: int, spec: tuple[int, int, int] = (0, 0, 0), **extra: Any) -> dict[str, Any]:
    """SGLang's meta_info for one sequence (`extra`: logprobs, latency, ...). With speculative
    decoding, `spec` = (verify cycles, drafts verified, drafts accepted) and SGLang's fields:
    spec_verify_ct, spec_draft_token_num, spec_accept_token_num (bonus tokens not counted),
    spec_accept_rate = accepted / verified, spec_accept_length = completion_tokens / cycles."""
    meta = {"id": rid, "finish_reason": None if finish_reason is None else finish_reason.to_json(),
            "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "cached_tokens": cached_tokens, **extra}
    cycles, drafted, accepted = spec
    if cycles:
        meta.update(spec_verify_ct=cycles, spec_draft_token_num=drafted, spec_accept_token_num=accepted,
                    spec_accept_rate=accepted / drafted if drafted else 0.0,
                    spec_accept_length=completion_tokens / cycles)
    return meta
