"""The three generation endpoints: request -> checked sequences -> TokenizerManager -> response.

`/v1/chat/completions` and `/v1/completions` speak OpenAI (ids `chatcmpl-...`/`cmpl-...`, usage,
logprobs in OpenAI's two shapes, SSE chunks ending `data: [DONE]`, `stream_options.include_usage`);
`/generate` speaks SGLang (text/output_ids/meta_info; streamed chunks carry the cumulative text, as
SGLang does by default). Choice i of prompt p has index p*n + i; each is its own sequence (rid-i)
with seed+i. An error inside one request becomes that request's error response or stream event."""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator

from sparkserve.entrypoints.openai_protocol import (ApiError, ChatCompletionRequest, CompletionRequest,
                                                    GenerateRequest, OpenAISampling)
from sparkserve.entrypoints.tokenizer_manager import Seq, SeqOut, Submission, TokenizerManager
from sparkserve.frontend.prepare import check_prompt, fan_out, meta_info, room_left
from sparkserve.sampling_params import SamplingParams

# OpenAI field name -> SamplingParams field name (for building params and renaming errors back).
_OPENAI_TO_SP = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens", "stop": "stop",
                 "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty", "frequency_penalty": "frequency_penalty",
                 "presence_penalty": "presence_penalty", "seed": "seed", "n": "n",
                 "ignore_eos": "ignore_eos", "stop_token_ids": "stop_token_ids",
                 "skip_special_tokens": "skip_special_tokens", "no_stop_trim": "no_stop_trim"}
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


class Serving:
    def __init__(self, tm: TokenizerManager, model_names: set[str], served_name: str):
        self.tm = tm
        self.model_names = model_names
        self.served_name = served_name

    # ---- shared ---------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name and name not in self.model_names:
            raise ApiError(404, f"model: the model {name!r} does not exist; this server serves "
                                f"{self.served_name!r} (see /v1/models)", "model")

    def openai_params(self, req: OpenAISampling, ids: list[int], max_tokens: int | None,
                      default_max: int | None, top_logprobs: int | None,
                      names: dict[str, str]) -> SamplingParams:
        """SamplingParams from an OpenAI request, checked against the model; errors name
        the OpenAI field (max_tokens, not max_new_tokens; `names` adds endpoint-specific ones)."""
        if req.logit_bias:
            raise ApiError(400, "logit_bias is not supported", "logit_bias")
        values = {sp: getattr(req, k) for k, sp in _OPENAI_TO_SP.items()
                  if k not in ("max_tokens",) and getattr(req, k) is not None}
        if max_tokens is None:
            max_tokens = default_max if default_max is not None else room_left(ids, self.tm.limits)
            if max_tokens == 0:
                raise ApiError(400, f"max_tokens: the prompt ({len(ids)} tokens) leaves no room in the context "
                                    f"length {self.tm.limits.context_length}", "max_tokens")
        values["max_new_tokens"] = max_tokens
        if top_logprobs is not None:
            values["return_logprob"] = True
            values["top_logprobs_num"] = top_logprobs
        try:
            params = SamplingParams(**values)
            check_prompt(ids, params, self.tm.limits, "max_tokens")
        except ValueError as e:
            head, _, rest = str(e).partition(" ")
            name = head.rstrip(":")
            rename = {**_SP_TO_OPENAI, **names}
            if name in rename:
                e = ValueError(f"{rename[name]}{head[len(name):]} {rest}")
            raise ApiError.bad_request(e) from None
        return params

    def check_hidden_states(self, wanted: bool) -> None:
        if wanted and not self.tm.args.enable_return_hidden_states:
            raise ApiError(400, "return_hidden_states: this server was started without "
                                "--enable-return-hidden-states", "return_hidden_states")

    def fan(self, rid: str, prompts: list[tuple[list[int], SamplingParams]], hidden: bool = False) -> list[Seq]:
        self.check_hidden_states(hidden)
        seqs = []
        for p, (ids, params) in enumerate(prompts):
            base = rid if len(prompts) == 1 else f"{rid}-{p}"
            for i, (r, sp) in enumerate(fan_out(base, params)):
                seqs.append(Seq(r, ids, sp, p * params.n + i, p, hidden))
        try:
            self.tm.check_capacity(len(seqs))
        except ValueError as e:
            raise ApiError.bad_request(e) from None
        return seqs

    def tokenize(self, text: str, param: str) -> list[int]:
        try:
            return self.tm.encode(text)
        except ValueError as e:
            raise ApiError(400, f"{param}: {e}", param) from None
        except Exception as e:  # noqa: BLE001 - e.g. lone surrogates the tokenizer cannot encode
            raise ApiError(400, f"{param}: cannot be tokenized ({type(e).__name__}: {e})", param) from None

    # ---- chat -----------------------------------------------------------------------------
    def chat_seqs(self, req: ChatCompletionRequest, rid: str) -> list[Seq]:
        self.check_model(req.model)
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise ApiError(400, "response_format: only {\"type\": \"text\"} is supported", "response_format")
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs: requires logprobs: true", "top_logprobs")
        tok = self._tokenizer("messages")
        try:
            text = tok.apply_chat_template(req.messages, add_generation_prompt=True, tools=req.tools,
                                           **(req.chat_template_kwargs or {}))
        except ValueError as e:
            raise ApiError.bad_request(e, "messages") from None
        except Exception as e:  # noqa: BLE001 - template errors (raise_exception, bad roles) are the request's
            raise ApiError(400, f"messages: the chat template refused them: {e}", "messages") from None
        ids = self.tokenize(text, "messages")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        top = (req.top_logprobs or 0) if req.logprobs else None
        names = {"top_logprobs_num": "top_logprobs"}
        return self.fan(rid, [(ids, self.openai_params(req, ids, max_tokens, None, top, names))],
                        req.return_hidden_states)

    async def chat_stream(self, req: ChatCompletionRequest, rid: str, seqs: list[Seq],
                          sub: Submission) -> AsyncIterator[str]:
        created, usage_on = int(time.time()), bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choices: list, usage: Any = None) -> str:
            body = {"id": rid, "object": "chat.completion.chunk", "created": created,
                    "model": self.served_name, "choices": choices}
            if usage_on:
                body["usage"] = usage
            return sse(body)

        for s in seqs:
            yield chunk([{"index": s.index, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}])
        async for event in self._events(sub, seqs, usage_on):
            if isinstance(event, dict):          # final usage
                yield chunk([], event)
                continue
            o = event
            if o.text or (req.logprobs and o.token_ids):
                lp = {"content": self._chat_logprobs(o)} if req.logprobs else None
                yield chunk([{"index": o.index, "delta": {"content": o.text}, "logprobs": lp,
                              "finish_reason": None}])
            if o.finish_reason is not None:
                yield chunk([{"index": o.index, "delta": {}, "logprobs": None,
                              "finish_reason": finish_reason(o.finish_reason), **last_hidden(req, o)}])

    async def chat_full(self, req: ChatCompletionRequest, rid: str, seqs: list[Seq], sub: Submission) -> dict:
        outs = await self._collect(sub, seqs)
        choices = []
        for idx in sorted(outs):
            parts = outs[idx]
            msg = {"role": "assistant", "content": "".join(o.text for o in parts)}
            choice = {"index": idx, "message": msg, "logprobs": None,
                      "finish_reason": finish_reason(parts[-1].finish_reason), **last_hidden(req, parts[-1])}
            if req.logprobs:
                choice["logprobs"] = {"content": [c for o in parts for c in self._chat_logprobs(o)]}
            choices.append(choice)
        return {"id": rid, "object": "chat.completion", "created": int(time.time()),
                "model": self.served_name, "choices": choices, "usage": usage(outs, seqs)}

    def _chat_logprobs(self, o: SeqOut) -> list[dict]:
        entries = []
        for k, (tid, lp) in enumerate(zip(o.token_ids, o.logprobs)):
            text, raw = self.tm.token_piece(tid)
            tops = []
            for t, tl in (o.top_logprobs[k] if k < len(o.top_logprobs) else None) or []:
                tt, tr = self.tm.token_piece(t)
                tops.append({"token": tt, "logprob": tl, "bytes": list(tr)})
            entries.append({"token": text, "logprob": lp, "bytes": list(raw), "top_logprobs": tops})
        return entries

    # ---- completions ------------------------------------------------------------------------
    def completion_seqs(self, req: CompletionRequest, rid: str) -> list[Seq]:
        self.check_model(req.model)
        if req.echo:
            raise ApiError(400, "echo is not supported", "echo")
        if req.suffix:
            raise ApiError(400, "suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise ApiError(400, "best_of: only best_of == n is supported", "best_of")
        prompt = req.prompt
        if isinstance(prompt, str):
            prompts = [self.tokenize(prompt, "prompt")]
        elif prompt and isinstance(prompt[0], str):
            prompts = [self.tokenize(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
        elif prompt and isinstance(prompt[0], int):
            prompts = [list(prompt)]
        else:
            prompts = [list(p) for p in prompt]
        if not prompts:
            raise ApiError(400, "prompt: is empty; give a string, strings or token ids", "prompt")
        names = {"top_logprobs_num": "logprobs", "input_ids": "prompt"}
        checked = []
        for ids in prompts:
            default = min(16, room_left(ids, self.tm.limits))
            checked.append((ids, self.openai_params(req, ids, req.max_tokens, default, req.logprobs, names)))
        return self.fan(rid, checked, req.return_hidden_states)

    async def completion_stream(self, req: CompletionRequest, rid: str, seqs: list[Seq],
                                sub: Submission) -> AsyncIterator[str]:
        created, usage_on = int(time.time()), bool(req.stream_options and req.stream_options.include_usage)
        offsets: dict[int, int] = {}

        def chunk(choices: list, usage: Any = None) -> str:
            body = {"id": rid, "object": "text_completion", "created": created,
                    "model": self.served_name, "choices": choices}
            if usage_on:
                body["usage"] = usage
            return sse(body)

        async for event in self._events(sub, seqs, usage_on):
            if isinstance(event, dict):
                yield chunk([], event)
                continue
            o = event
            if o.text or o.finish_reason is not None or (req.logprobs is not None and o.token_ids):
                lp = self._completion_logprobs(o, offsets) if req.logprobs is not None else None
                yield chunk([{"index": o.index, "text": o.text, "logprobs": lp,
                              "finish_reason": finish_reason(o.finish_reason), **last_hidden(req, o)}])

    async def completion_full(self, req: CompletionRequest, rid: str, seqs: list[Seq],
                              sub: Submission) -> dict:
        outs = await self._collect(sub, seqs)
        choices = []
        for idx in sorted(outs):
            parts = outs[idx]
            lp = None
            if req.logprobs is not None:
                offsets: dict[int, int] = {}
                lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
                for o in parts:
                    for k, v in self._completion_logprobs(o, offsets).items():
                        lp[k] += v
            choices.append({"index": idx, "text": "".join(o.text for o in parts), "logprobs": lp,
                            "finish_reason": finish_reason(parts[-1].finish_reason), **last_hidden(req, parts[-1])})
        return {"id": rid, "object": "text_completion", "created": int(time.time()),
                "model": self.served_name, "choices": choices, "usage": usage(outs, seqs)}

    def _completion_logprobs(self, o: SeqOut, offsets: dict[int, int]) -> dict:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for k, (tid, lp) in enumerate(zip(o.token_ids, o.logprobs)):
            text, _ = self.tm.token_piece(tid)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp)
            tops = (o.top_logprobs[k] if k < len(o.top_logprobs) else None) or []
            out["top_logprobs"].append({self.tm.token_piece(t)[0]: v for t, v in tops})
            out["text_offset"].append(offsets.get(o.index, 0))
            offsets[o.index] = offsets.get(o.index, 0) + len(text)
        return out

    # ---- /generate (SGLang) -----------------------------------------------------------------
    def generate_seqs(self, req: GenerateRequest) -> tuple[list[Seq], bool, bool]:
        """(sequences, batch?, return_text_in_logprobs); batch: the response is a list."""
        if (req.text is None) == (req.input_ids is None):
            raise ApiError(400, "text: give exactly one of text and input_ids", "text")
        if req.text is not None:
            single = isinstance(req.text, str)
            texts = [req.text] if single else req.text
            prompts = [self.tokenize(t, "text") for t in texts]
        else:
            ids = req.input_ids
            single = not ids or isinstance(ids[0], int)
            prompts = [list(ids)] if single else [list(x) for x in ids]
        if not prompts:
            raise ApiError(400, "text: the batch is empty", "text")
        k = len(prompts)
        sps = per_prompt(req.sampling_params, k, "sampling_params")
        ret_lp = per_prompt(req.return_logprob, k, "return_logprob")
        top_n = per_prompt(req.top_logprobs_num, k, "top_logprobs_num")
        hidden = per_prompt(req.return_hidden_states, k, "return_hidden_states")
        self.check_hidden_states(any(hidden))
        rids = per_prompt(req.rid, k, "rid") if isinstance(req.rid, list) else None
        base = req.rid if isinstance(req.rid, str) else uuid.uuid4().hex
        seqs: list[Seq] = []
        index = 0
        for p, ids in enumerate(prompts):
            try:
                sp = dict(sps[p] or {})
                if ret_lp[p]:
                    sp["return_logprob"] = True
                if top_n[p]:
                    sp["top_logprobs_num"] = top_n[p]
                params = SamplingParams.from_dict(sp)
                check_prompt(ids, params, self.tm.limits)
            except ValueError as e:
                raise ApiError.bad_request(e) from None
            rid = rids[p] if rids else (base if k == 1 else f"{base}-{p}")
            if not isinstance(rid, str) or not rid:
                raise ApiError(400, "rid: must be a non-empty string", "rid")
            for r, sp_i in fan_out(rid, params):
                seqs.append(Seq(r, ids, sp_i, index, p, bool(hidden[p])))
                index += 1
        try:
            self.tm.check_capacity(len(seqs))
        except ValueError as e:
            raise ApiError.bad_request(e) from None
        return seqs, not (single and len(seqs) == 1), req.return_text_in_logprobs

    def _generate_result(self, s: Seq, text: str, ids: list[int], parts: list[SeqOut], with_text: bool) -> dict:
        last = parts[-1] if parts else None
        extra: dict[str, Any] = {"e2e_latency": last.e2e_latency if last else 0.0}
        if s.params.return_logprob:
            lps = [lp for o in parts for lp in o.logprobs]
            tops = [t for o in parts for t in o.top_logprobs]
            piece = (lambda t: self.tm.token_piece(t)[0]) if with_text and self.tm.tokenizer else (lambda t: None)
            extra["output_token_logprobs"] = [[lp, t, piece(t)] for lp, t in zip(lps, ids)]
            extra["output_top_logprobs"] = [[[v, t, piece(t)] for t, v in (top or [])] for top in tops]
        if last is not None and last.hidden_states is not None:
            extra["hidden_states"] = last.hidden_states
            if last.aux_hidden_states is not None:
                extra["aux_hidden_states"] = last.aux_hidden_states
        meta = meta_info(s.rid, last.finish_reason if last else None, len(s.input_ids),
                         last.completion_tokens if last else 0, last.cached_tokens if last else 0,
                         last.spec_verify_ct if last else 0, last.spec_accepted_tokens if last else 0, **extra)
        return {"text": text, "output_ids": list(ids), "meta_info": meta}

    async def generate_stream(self, seqs: list[Seq], sub: Submission, batch: bool,
                              with_text: bool) -> AsyncIterator[str]:
        text = {s.index: "" for s in seqs}
        ids: dict[int, list[int]] = {s.index: [] for s in seqs}
        parts: dict[int, list[SeqOut]] = {s.index: [] for s in seqs}
        by_index = {s.index: s for s in seqs}
        async for o in self._events(sub, seqs, False):
            text[o.index] += o.text
            ids[o.index] += o.token_ids
            parts[o.index].append(o)
            if o.text or o.token_ids or o.finish_reason is not None:
                res = self._generate_result(by_index[o.index], text[o.index], ids[o.index], parts[o.index], with_text)
                if batch:
                    res["index"] = o.index
                yield sse(res)

    async def generate_full(self, seqs: list[Seq], sub: Submission, batch: bool, with_text: bool) -> dict | list:
        outs = await self._collect(sub, seqs)
        results = []
        for s in seqs:
            parts = outs[s.index]
            results.append(self._generate_result(s, "".join(o.text for o in parts),
                                                 [t for o in parts for t in o.token_ids], parts, with_text))
        return results if batch else results[0]

    # ---- plumbing ---------------------------------------------------------------------------
    async def _events(self, sub: Submission, seqs: list[Seq], usage_on: bool) -> AsyncIterator[SeqOut | dict]:
        """SeqOuts in arrival order; an error ends the stream via StreamError; then usage."""
        last: dict[int, SeqOut] = {}
        async for o in sub:
            if o.error_status is not None:
                raise StreamError(ApiError(o.error_status, o.finish_reason.get("message", "aborted")))
            last[o.index] = o
            yield o
        if usage_on:
            yield usage({i: [o] for i, o in last.items()}, seqs)

    async def _collect(self, sub: Submission, seqs: list[Seq]) -> dict[int, list[SeqOut]]:
        outs: dict[int, list[SeqOut]] = {s.index: [] for s in seqs}
        async for o in sub:
            if o.error_status is not None:
                raise ApiError(o.error_status, o.finish_reason.get("message", "aborted"))
            outs[o.index].append(o)
        return outs

    def _tokenizer(self, param: str):
        try:
            return self.tm.need_tokenizer()
        except ValueError as e:
            raise ApiError(400, f"{param}: {e}", param) from None


class StreamError(Exception):
    """Raised inside a stream: the SSE writer turns it into an error event + [DONE]."""

    def __init__(self, error: ApiError):
        super().__init__(error.message)
        self.error = error


def finish_reason(fr: dict | None) -> str | None:
    if fr is None:
        return None
    return {"stop": "stop", "length": "length"}.get(fr.get("type"), fr.get("type"))


def usage(outs: dict[int, list[SeqOut]], seqs: list[Seq]) -> dict:
    """Prompt tokens once per prompt (not per choice), completion tokens of every choice."""
    prompt_tokens, cached, seen = 0, 0, set()
    completion = 0
    index_prompt = {s.index: s.prompt for s in seqs}
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


def last_hidden(req: OpenAISampling, o: SeqOut) -> dict:
    """SGLang's OpenAI `hidden_states` of a finished choice: the final normed hidden state of the
    last position the model ran (its full rows are on /generate)."""
    if not req.return_hidden_states or o.finish_reason is None:
        return {}
    return {"hidden_states": o.hidden_states[-1] if o.hidden_states else []}


def per_prompt(value: Any, k: int, name: str) -> list:
    if isinstance(value, list):
        if len(value) != k:
            raise ApiError(400, f"{name}: got {len(value)} values for {k} prompts", name)
        return value
    return [value] * k


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"

