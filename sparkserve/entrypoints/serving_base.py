"""What the three generation endpoints share: checked sequences out of a request (model name,
OpenAI sampling fields, tokenization, n fanned out), the events of a submission, usage, and the
JSON/SSE encoding. Choice i of prompt p has index p*n + i; each is its own sequence (rid-i) with
seed+i. An error inside one request becomes that request's error response or stream event."""
from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator

from sparkserve.constrained.check import check_grammar
from sparkserve.core.finish_reason import BaseFinishReason
from sparkserve.entrypoints.openai_protocol import ApiError, GenerateRequest, OpenAISampling
from sparkserve.entrypoints.tokenizer_manager import SeqOut, Submission, TokenizerManager
from sparkserve.frontend.prepare import as_batch, check_prompt, fan_out, room_left
from sparkserve.frontend.tokenizer import Tokenizer
from sparkserve.messages import Bootstrap, GenerateReq
from sparkserve.sampling_params import (
    MAX_HOST_CHARS,
    MAX_PROMPTS,
    MAX_RID_CHARS,
    MAX_SEQUENCES,
    SamplingParams,
)

# OpenAI field name -> SamplingParams field name (for building params and renaming errors back).
_OPENAI_TO_SP = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens", "stop": "stop",
                 "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty", "frequency_penalty": "frequency_penalty",
                 "presence_penalty": "presence_penalty", "seed": "seed", "n": "n",
                 "ignore_eos": "ignore_eos", "stop_token_ids": "stop_token_ids",
                 "skip_special_tokens": "skip_special_tokens", "no_stop_trim": "no_stop_trim",
                 "logit_bias": "logit_bias", "json_schema": "json_schema", "regex": "regex",
                 "ebnf": "ebnf", "structural_tag": "structural_tag"}
_SP_TO_OPENAI = {v: k for k, v in _OPENAI_TO_SP.items()}


def dumps(obj: Any) -> str:
    """JSON text that is always valid: -inf logprobs clamped, non-ASCII escaped (so an echoed
    lone surrogate from a client cannot break the UTF-8 encoding of a response)."""
    return json.dumps(_finite(obj), ensure_ascii=True, allow_nan=False)


def _finite(obj: Any) -> Any:
    """JSON has no -inf: logprobs of impossible tokens become -9999.0 (as vLLM does)."""
    if isinstance(obj, float):
        return obj if obj == obj and abs(obj) != float("inf") else (-9999.0 if obj < 0 else 9999.0)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def sse(obj: Any) -> str:
    return f"data: {dumps(obj)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
ROOMS = 1 << 63                 # bootstrap rooms are 63-bit, as PD routers draw them
NO_MODEL_FROM_ROUTER = "unknown"


class StreamError(Exception):
    """Raised inside a stream: the SSE writer turns it into an error event + [DONE]."""

    def __init__(self, error: ApiError):
        super().__init__(error.message)
        self.error = error


class ServingBase:
    def __init__(self, tm: TokenizerManager, model_names: set[str], served_name: str):
        self.tm = tm
        self.model_names = model_names
        self.served_name = served_name

    # ---- request -> sequences -------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        """An unknown model is a 404 naming the served one. No model, and sglang-router's stand-in
        for none (it sends model "unknown" for a chat request without one), mean this one."""
        if name and name != NO_MODEL_FROM_ROUTER and name not in self.model_names:
            raise ApiError(404, f"model: the model {name!r} does not exist; this server serves "
                                f"{self.served_name!r} (see /v1/models)", "model")

    def check_hidden_states(self, wanted: bool) -> None:
        if wanted and not self.tm.args.enable_return_hidden_states:
            raise ApiError(400, "return_hidden_states: this server was started without "
                                "--enable-return-hidden-states", "return_hidden_states")

    def dp_rank(self, value: int | None, alias: int | None = None) -> int | None:
        """SGLang's routed_dp_rank (`alias`: its older name data_parallel_rank), checked here so a
        group the server does not have is the client's 400, not a scheduler error."""
        name = "routed_dp_rank"
        if alias is not None and value is None:
            name, value = "data_parallel_rank", alias
        elif alias is not None and alias != value:
            raise ApiError(400, f"routed_dp_rank: {value} and data_parallel_rank: {alias} disagree; give "
                                "one (data_parallel_rank is its older name)", name)
        groups = self.tm.dp_groups
        if value is not None and not 0 <= value < groups:
            raise ApiError(400, f"{name} must be in [0, {groups}) (the DP-attention groups of this server), "
                                f"got {value}", name)
        return value

    def openai_params(self, req: OpenAISampling, ids: list[int], max_tokens: int | None,
                      default_max: int | None, top_logprobs: int | None,
                      names: dict[str, str]) -> SamplingParams:
        """SamplingParams from an OpenAI request, checked against the model; errors name
        the OpenAI field (max_tokens, not max_new_tokens; `names` adds endpoint-specific ones)."""
        values = {sp: getattr(req, k) for k, sp in _OPENAI_TO_SP.items()
                  if k != "max_tokens" and getattr(req, k) is not None}
        if max_tokens is None:
            max_tokens = default_max if default_max is not None else room_left(ids, self.tm.limits)
            if max_tokens == 0:
                raise ApiError(400,
                               f"max_tokens: the prompt ({len(ids)} tokens) leaves no room in the context "
                                    f"length {self.tm.limits.context_length}", "max_tokens")
        values["max_new_tokens"] = max_tokens
        if top_logprobs is not None:
            values["return_logprob"] = True
            values["top_logprobs_num"] = top_logprobs
        try:
            params = SamplingParams(**values)
            check_prompt(ids, params, self.tm.limits, "max_tokens")
            check_grammar(params, self.tm.args.grammar_backend, self.tm.tokenizer is not None)
        except ValueError as e:
            head, _, rest = str(e).partition(" ")
            name = head.rstrip(":")
            rename = {**_SP_TO_OPENAI, **names}
            if name in rename:
                e = ValueError(f"{rename[name]}{head[len(name):]} {rest}")
            raise ApiError.bad_request(e) from None
        return params

    def bootstraps(self, req: GenerateRequest | OpenAISampling, k: int) -> list[Bootstrap | None]:
        """PD disaggregation: the pairing of each of the request's k prompts (a router sent the same
        body to a prefill and a decode server; the room pairs the two halves), or None for each
        when there is none to make: on a null-mode server (the fields are ignored, as SGLang does)
        and for a request without the fields, which runs colocated here (/health_generate, direct
        clients). A paired request needs its host and room. Its port may be missing or null: then
        it is this server's --disaggregation-bootstrap-port, as in SGLang's scheduler
        (sglang-router sends null for a prefill server given without a port). A list gives one
        value per prompt; one room for a batch is room + p for prompt p (SGLang's rule), so every
        sequence has a room of its own, which is also why fan() refuses n > 1."""
        args = self.tm.args
        host, port, room = req.bootstrap_host, req.bootstrap_port, req.bootstrap_room
        if args.disaggregation_mode == "null" or (host is None and port is None and room is None):
            return [None] * k
        for name, value in (("bootstrap_host", host), ("bootstrap_room", room)):
            if value is None:
                raise ApiError(400, f"{name}: missing; a request paired for PD disaggregation needs "
                                    "bootstrap_host and bootstrap_room (bootstrap_port defaults to "
                                    f"{args.disaggregation_bootstrap_port})", name)
        hosts = per_prompt(host, k, "bootstrap_host")
        ports = per_prompt(port, k, "bootstrap_port")
        rooms = (per_prompt(room, k, "bootstrap_room") if isinstance(room, list)
                 else [room + p for p in range(k)])
        if len(set(rooms)) != k:
            raise ApiError(400, "bootstrap_room: every prompt needs a room of its own; got repeats",
                           "bootstrap_room")
        out: list[Bootstrap | None] = []
        for p, (h, pt, r) in enumerate(zip(hosts, ports, rooms)):
            pt = args.disaggregation_bootstrap_port if pt is None else pt
            if not h or len(h) > MAX_HOST_CHARS:
                raise ApiError(400, f"bootstrap_host: must be a host name or address of 1 to "
                                    f"{MAX_HOST_CHARS} characters, got {len(h)}", "bootstrap_host")
            if not 0 < pt <= 65535:
                raise ApiError(400, f"bootstrap_port must be in [1, 65535], got {pt}", "bootstrap_port")
            if not 0 <= r < ROOMS:
                of = f" (bootstrap_room + {p}: prompt {p}'s room)" if p and not isinstance(room, list) else ""
                raise ApiError(400, f"bootstrap_room must be in [0, 2**63), got {r}{of}", "bootstrap_room")
            out.append(Bootstrap(h, pt, r))
        return out

    def check_priority(self, priority: int | None) -> None:
        """A priority other than 0 needs --enable-priority-scheduling: never silently ignored."""
        if priority in (None, 0):
            return
        if not self.tm.args.enable_priority_scheduling:
            raise ApiError(400, f"priority: {priority} needs a server started with "
                                "--enable-priority-scheduling (this one admits requests first come, first "
                                "served)", "priority")
        if not -(2**63) <= priority < 2**63:
            raise ApiError(400, f"priority must be an int in [-2**63, 2**63), got {priority}", "priority")

    def fan(self, rid: str, prompts: list[tuple[list[int], SamplingParams]],
            hidden: list[bool] | bool = False, rids: list[str] | None = None,
            dp_rank: int | None = None, boots: list[Bootstrap | None] | None = None,
            priority: int | None = None) -> list[GenerateReq]:
        """One GenerateReq per choice (n fanned out); `rids`: one per prompt, else rid or rid-p.
        `dp_rank` (checked by `dp_rank()`) goes to every one: a request runs in one DP group.
        `boots` (from `bootstraps()`): each prompt's PD pairing, whose single room allows one choice.
        `priority` (SGLang's): the waiting queue's order under --enable-priority-scheduling."""
        hidden = hidden if isinstance(hidden, list) else [hidden] * len(prompts)
        boots = boots or [None] * len(prompts)
        self.check_hidden_states(any(hidden))
        self.check_priority(priority)
        count = sum(params.n for _, params in prompts)
        if count > MAX_SEQUENCES:
            per = f"{len(prompts)} prompts x n" if len(prompts) > 1 else "n"
            raise ApiError(400, f"n: {per} = {count} sequences; one request may ask for at most "
                                f"{MAX_SEQUENCES}", "n")
        try:
            self.tm.check_capacity(count)
        except ValueError as e:
            raise ApiError.bad_request(e) from None
        for r in rids or [rid]:
            if not isinstance(r, str) or not r or len(r) > MAX_RID_CHARS:
                got = f", got {len(r)} characters" if isinstance(r, str) and r else ""
                raise ApiError(400, f"rid: must be a string of 1 to {MAX_RID_CHARS} characters{got}", "rid")
        seqs: list[GenerateReq] = []
        for p, (ids, params) in enumerate(prompts):
            base = rids[p] if rids else (rid if len(prompts) == 1 else f"{rid}-{p}")
            if boots[p] is not None and params.n > 1:
                raise ApiError(400, f"n: {params.n} choices of a PD request (bootstrap_room): each sequence "
                                    "needs a room of its own; send n = 1 (or one request per choice)", "n")
            if boots[p] is not None and params.logprob_start_len >= 0:
                raise ApiError(400, "logprob_start_len: prompt logprobs are not served across PD "
                                    "disaggregation (its decode side never runs the prompt)",
                               "logprob_start_len")
            for r, sp in fan_out(base, params):
                seqs.append(GenerateReq(r, ids, sp, bool(hidden[p]), len(seqs), p, dp_rank, boots[p],
                                        priority or 0))
        return seqs

    def prompts(self, value: Any, name: str, kinds: tuple[str, ...]) -> tuple[list[list[int]], bool]:
        """Token ids of a single prompt or a batch (text tokenized), and whether it was single."""
        try:
            items, single = as_batch(value, name, kinds)
        except (TypeError, ValueError) as e:
            raise ApiError(400, str(e), name) from None
        if len(items) > MAX_PROMPTS:
            raise ApiError(400, f"{name}: a batch of {len(items)} prompts; one request may carry at most "
                                f"{MAX_PROMPTS}", name)
        ids = []
        for i, x in enumerate(items):
            where = name if single else f"{name}[{i}]"
            ids.append(self.tokenize(x, where) if isinstance(x, str) else list(x))
            self.check_length(ids[-1], where, name)
        return ids, single

    def check_length(self, ids: list[int], where: str, param: str) -> None:
        """A prompt longer than the context is refused as such (as vLLM does), before max_tokens
        is looked at: the message says the context length."""
        context = self.tm.limits.context_length
        if len(ids) > context:
            raise ApiError(400, f"{where}: the prompt is {len(ids)} tokens, over this model's context length "
                                f"of {context} tokens", param)

    def tokenize(self, text: str, param: str) -> list[int]:
        try:
            return self.tm.encode(text)
        except ValueError as e:
            raise ApiError(400, f"{param}: {e}", param) from None
        except Exception as e:  # noqa: BLE001 - e.g. lone surrogates the tokenizer cannot encode
            raise ApiError(400, f"{param}: cannot be tokenized ({type(e).__name__}: {e})", param) from None

    def tokenizer(self, param: str) -> Tokenizer:
        try:
            return self.tm.need_tokenizer()
        except ValueError as e:
            raise ApiError(400, f"{param}: {e}", param) from None

    # ---- submission -> results ------------------------------------------------------------
    async def events(self, sub: Submission, seqs: list[GenerateReq],
                     usage_on: bool) -> AsyncIterator[SeqOut | dict]:
        """SeqOuts in arrival order; an error ends the stream via StreamError; then usage."""
        last: dict[int, SeqOut] = {}
        async for o in sub:
            if o.error_status is not None:
                raise StreamError(ApiError(o.error_status, o.error_message))
            last[o.index] = o
            yield o
        if usage_on:
            yield usage({i: [o] for i, o in last.items()}, seqs)

    async def collect(self, sub: Submission, seqs: list[GenerateReq]) -> dict[int, list[SeqOut]]:
        outs: dict[int, list[SeqOut]] = {s.index: [] for s in seqs}
        async for o in sub:
            if o.error_status is not None:
                raise ApiError(o.error_status, o.error_message)
            outs[o.index].append(o)
        return outs


def finish_reason(fr: BaseFinishReason | None) -> str | None:
    """OpenAI's finish_reason: stop, length (abort shows as abort)."""
    return None if fr is None else fr.type


def usage(outs: dict[int, list[SeqOut]], seqs: list[GenerateReq]) -> dict:
    """Prompt tokens once per prompt (not per choice), completion tokens of every choice."""
    prompt_tokens, cached, seen = 0, 0, set()
    completion = 0
    index_prompt = {s.index: s.prompt_index for s in seqs}
    for idx, parts in outs.items():
        last = parts[-1] if parts else None
        if last is None:
            continue
        completion += last.completion_tokens
        key = index_prompt.get(idx)
        if key not in seen:
            seen.add(key)
            prompt_tokens += last.prompt_tokens
            cached += last.cached_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached}}


def per_prompt(value: Any, k: int, name: str) -> list:
    if isinstance(value, list):
        if len(value) != k:
            raise ApiError(400, f"{name}: got {len(value)} values for {k} prompts", name)
        return value
    return [value] * k


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"
