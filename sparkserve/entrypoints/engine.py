"""Offline Engine API: `Engine(model_path=None, **server_args).generate(...)`.

Runs the scheduler in this process (no HTTP, no ZMQ) and returns SGLang-shaped results:
{"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens", ...}}."""
from __future__ import annotations

import itertools
import os
import uuid
from typing import Any, Iterator, Sequence

from sparkserve.args import ServerArgs
from sparkserve.executor.sampler import RequestSamplingState
from sparkserve.frontend.output_stream import OutputStream
from sparkserve.sampling_params import SamplingParams
from sparkserve.scheduler.req import Req
from sparkserve.scheduler.runtime import build_scheduler, context_length, load_tokenizer
from sparkserve.scheduler.scheduler import StepOutput

Messages = list[dict[str, Any]]


class Engine:
    def __init__(self, model_path: str | None = None, **kwargs: Any):
        self.args = ServerArgs(model_path=model_path, **kwargs).validate()
        self.tokenizer = None
        if not self.args.skip_tokenizer_init and _has_tokenizer(self.args.tokenizer_path):
            self.tokenizer = load_tokenizer(self.args.tokenizer_path)
        self.scheduler, self.model_config = build_scheduler(self.args, self.tokenizer)
        self.context_length = context_length(self.args, self.model_config)
        self._ids = itertools.count()

    # ---- public API -------------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[str] | None = None,
                 sampling_params: dict | SamplingParams | Sequence[dict] | None = None,
                 input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
                 messages: Messages | Sequence[Messages] | None = None,
                 stream: bool = False) -> dict | list[dict] | Iterator[dict]:
        """Generate for one prompt (returns a dict) or a batch (returns a list, in order).
        Give exactly one of `prompt` (text), `input_ids` or `messages` (chat, template applied).
        With stream=True (single prompt), yields chunks {"text": delta, "output_ids": new ids,
        "finished": bool, "meta_info": ...}."""
        prompts, single = self._prompt_ids(prompt, input_ids, messages)
        params = _params_list(sampling_params, len(prompts))
        for ids, p in zip(prompts, params):
            self._check(ids, p)
        groups = [self._submit(ids, p) for ids, p in zip(prompts, params)]
        if stream:
            if not single or len(groups[0]) != 1:
                raise ValueError("stream=True takes a single prompt with n=1")
            return self._stream(groups[0][0])
        results = self._run_to_completion(groups)
        return results[0] if single and len(results) == 1 else results

    def chat(self, messages: Messages | Sequence[Messages], sampling_params: dict | None = None,
             **kw: Any) -> dict | list[dict]:
        return self.generate(messages=messages, sampling_params=sampling_params, **kw)

    def flush_cache(self) -> bool:
        return self.scheduler.cache.flush()

    # ---- internals --------------------------------------------------------------------------
    def _prompt_ids(self, prompt, input_ids, messages) -> tuple[list[list[int]], bool]:
        given = [x is not None for x in (prompt, input_ids, messages)]
        if sum(given) != 1:
            raise ValueError("give exactly one of prompt, input_ids, messages")
        if input_ids is not None:
            single = len(input_ids) == 0 or isinstance(input_ids[0], int)
            batch = [list(input_ids)] if single else [list(x) for x in input_ids]
        else:
            tok = self._need_tokenizer()
            if prompt is not None:
                single = isinstance(prompt, str)
                texts = [prompt] if single else list(prompt)
            else:
                single = len(messages) == 0 or isinstance(messages[0], dict)
                convs = [messages] if single else list(messages)
                texts = [tok.apply_chat_template(c, add_generation_prompt=True) for c in convs]
            batch = [tok.encode(t, add_special_tokens=True) for t in texts]
        for ids in batch:
            if not ids:
                raise ValueError("prompt is empty: give at least one token")
        return batch, single

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer (model without tokenizer files, or "
                             "skip_tokenizer_init): pass input_ids")
        return self.tokenizer

    def _check(self, ids: list[int], params: SamplingParams) -> None:
        params.validate(self.model_config.vocab_size)
        bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"input_ids: token id {bad[0]} is outside the vocabulary "
                             f"[0, {self.model_config.vocab_size})")
        total = len(ids) + params.max_new_tokens
        if total > self.context_length:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) = "
                             f"{total} exceeds the context length {self.context_length}")
        if total > self.scheduler.cache.num_slots:
            raise ValueError(f"prompt + max_new_tokens = {total} tokens exceeds the KV pool "
                             f"({self.scheduler.cache.num_slots} tokens); raise --max-total-tokens")

    def _submit(self, ids: list[int], params: SamplingParams) -> list[Req]:
        base = uuid.uuid4().hex[:16]
        eos = self.scheduler.eos_ids
        reqs = []
        for i in range(params.n):
            p = params if params.n == 1 else _replace_seed(params, i)
            req = Req(f"{base}-{i}" if params.n > 1 else base, list(ids), p,
                      RequestSamplingState(p, ids, eos))
            reqs.append(req)
            if params.max_new_tokens == 0:
                req.finished_reason = {"type": "length", "length": 0}
            else:
                self.scheduler.add_request(req)
        return reqs

    def _run_to_completion(self, groups: list[list[Req]]) -> list[dict]:
        reqs = [r for g in groups for r in g]
        while any(not r.finished for r in reqs):
            self.scheduler.step()
        return [self._result(r) for r in reqs]

    def _stream(self, req: Req) -> Iterator[dict]:
        out = OutputStream(self.tokenizer, req.params) if self.tokenizer else None
        sent = 0
        while True:
            if not req.finished:
                self.scheduler.step()
            new = req.output_ids[sent:]
            sent = len(req.output_ids)
            if new or req.finished:
                text = out.push(new, req.finished) if out else ""
                yield {"text": text, "output_ids": new, "finished": req.finished,
                       "meta_info": self._meta(req)}
            if req.finished:
                return

    def _result(self, req: Req) -> dict:
        text = ""
        if self.tokenizer is not None:
            out = OutputStream(self.tokenizer, req.params)
            text = out.push(req.output_ids, True)
        return {"text": text, "output_ids": list(req.output_ids), "meta_info": self._meta(req)}

    @staticmethod
    def _meta(req: Req) -> dict:
        meta = {"id": req.rid, "finish_reason": req.finished_reason,
                "prompt_tokens": len(req.input_ids), "completion_tokens": len(req.output_ids),
                "cached_tokens": req.cached_tokens}
        if req.params.return_logprob:
            meta["output_token_logprobs"] = [(lp, t) for lp, t in zip(req.output_logprobs, req.output_ids)]
            meta["output_top_logprobs"] = req.output_top_logprobs
        return meta


def _has_tokenizer(path: str) -> bool:
    return path.endswith(".gguf") or os.path.isfile(os.path.join(path, "tokenizer.json"))


def _params_list(sp, n: int) -> list[SamplingParams]:
    if isinstance(sp, (list, tuple)):
        if len(sp) != n:
            raise ValueError(f"sampling_params: got {len(sp)} for {n} prompts")
        return [_one_params(x) for x in sp]
    return [_one_params(sp) for _ in range(n)]


def _one_params(sp) -> SamplingParams:
    if sp is None:
        return SamplingParams()
    if isinstance(sp, SamplingParams):
        return SamplingParams(**{k: v for k, v in sp.__dict__.items()})
    return SamplingParams.from_dict(dict(sp))


def _replace_seed(p: SamplingParams, i: int) -> SamplingParams:
    q = SamplingParams(**p.__dict__)
    q.seed = None if p.seed is None else p.seed + i
    q.n = 1
    return q
