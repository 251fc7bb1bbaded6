"""Offline Engine API: `Engine(model_path=None, **server_args).generate(...)`.

Runs the scheduler in this process (no HTTP, no ZMQ) and returns SGLang-shaped results:
{"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens", ...}}."""
from __future__ import annotations

import uuid
from collections import deque
from dataclasses import replace
from typing import Any, Iterable, Iterator, Sequence

from sparkserve.args import ServerArgs
from sparkserve.constrained.check import check_grammar
from sparkserve.core.req import Req
from sparkserve.core.sampling_state import RequestSamplingState
from sparkserve.distributed import parallel_state as ps
from sparkserve.entrypoints.ranks import start_worker_ranks
from sparkserve.frontend.output_stream import OutputStream, stop_token
from sparkserve.frontend.prepare import (
    Limits,
    as_batch,
    check_prompt,
    fan_out,
    meta_info,
    params_list,
    prompt_kind,
)
from sparkserve.frontend.tokenizer import Tokenizer, load_tokenizer_for
from sparkserve.sampling_params import SamplingParams
from sparkserve.scheduler.data_parallel import build_driver_scheduler
from sparkserve.scheduler.runtime import context_length

Messages = list[dict[str, Any]]
# The kind of prompt each argument takes, and back (for the hint when one is given to another).
PROMPT_ARGS = {"prompt": "text", "input_ids": "ids", "messages": "messages"}
ARG_FOR = {kind: arg for arg, kind in PROMPT_ARGS.items()}


class Engine:
    """`Engine(...)`, or `with Engine(...) as engine:`; with --tp-size > 1 this process is the
    driver (rank 0) and the other ranks run in processes it starts; `shutdown()` stops them. A rank
    that exits while the engine starts raises RankDiedError (entrypoints/ranks.py) naming it."""

    def __init__(self, model_path: str | None = None, **kwargs: Any):
        self.args = ServerArgs(model_path=model_path, **kwargs).validate()
        ps.check_free()
        if self.args.node_rank > 0:
            raise ValueError("--node-rank > 0 runs only that node's ranks: use `sparkserve serve` there")
        self.tokenizer = load_tokenizer_for(self.args)
        self._ranks = start_worker_ranks(self.args)
        try:
            with self._ranks.watch_startup():      # a rank that dies meanwhile fails this at once
                self.scheduler, self.model_config = build_driver_scheduler(self.args, self.tokenizer)
        except BaseException:
            self._ranks.stop(timeout=0)
            raise
        self.context_length = context_length(self.args, self.model_config)
        self.limits = Limits(self.model_config.vocab_size, self.context_length,
                             self.scheduler.max_sequence_tokens)

    # ---- public API -------------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[str] | None = None,
                 sampling_params: dict | SamplingParams | Sequence[dict] | None = None,
                 input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
                 messages: Messages | Sequence[Messages] | None = None,
                 stream: bool = False,
                 return_hidden_states: bool = False,
                 routed_dp_rank: int | None = None, return_logprob: bool = False,
                 logprob_start_len: int = -1, top_logprobs_num: int = 0,
                 priority: int | None = None) -> dict | list[dict] | Iterator[dict]:
        """Generate for one prompt (returns a dict) or a batch (returns a list, in order).
        Give exactly one of `prompt` (text), `input_ids` or `messages` (chat, template applied).
        With stream=True (single prompt), yields chunks {"text": delta, "output_ids": new ids,
        "finished": bool, "meta_info": ...}. return_hidden_states (engine started with
        enable_return_hidden_states) adds meta_info "hidden_states" (final normed hidden state
        of every position but the last output token; with max_new_tokens 0, of every prompt
        position: the prompt runs, nothing is generated) and, when the model captures aux layers
        (set_aux_layers; a DSpark target does), "aux_hidden_states" (those layers, concatenated).
        routed_dp_rank (DP attention): the attention group that runs the requests (default: the
        --load-balance-method's pick). return_logprob / top_logprobs_num / logprob_start_len
        (SGLang's, also accepted in sampling_params): meta_info output_token_logprobs and, from
        prompt position logprob_start_len on (-1: none), input_token_logprobs (None first at 0).
        priority (SGLang's): the requests' place in the waiting queue; other than 0 it needs
        enable_priority_scheduling."""
        self._check_hidden_states(return_hidden_states)
        self._check_dp_rank(routed_dp_rank)
        self._check_priority(priority)
        if return_hidden_states and stream:
            raise ValueError("return_hidden_states is not available with stream=True")
        prompts, single = self._prompt_ids(prompt, input_ids, messages)
        params = params_list(sampling_params, len(prompts))
        if return_logprob or top_logprobs_num or logprob_start_len != -1:
            params = [replace(p, return_logprob=p.return_logprob or return_logprob,
                              top_logprobs_num=top_logprobs_num or p.top_logprobs_num,
                              logprob_start_len=logprob_start_len if logprob_start_len != -1
                              else p.logprob_start_len) for p in params]
        for ids, p in zip(prompts, params):
            check_prompt(ids, p, self.limits)
            check_grammar(p, self.args.grammar_backend, self.tokenizer is not None)
        groups = [self._submit(ids, p, return_hidden_states, routed_dp_rank, priority or 0)
                  for ids, p in zip(prompts, params)]
        if stream:
            if not single or len(groups[0]) != 1:
                raise ValueError("stream=True takes a single prompt with n=1")
            return self._stream(groups[0][0])
        results = self._run_to_completion(groups)
        return results[0] if single and len(results) == 1 else results

    def generate_many(self, prompts: Iterable[str | Sequence[int]],
                      sampling_params: dict | Sequence[dict] | None = None,
                      max_in_flight: int = 32, return_hidden_states: bool = False,
                      priority: int | Sequence[int] | None = None) -> Iterator[dict]:
        """Results for a long stream of prompts (text, or token id lists), yielded in input
        order, with up to `max_in_flight` requests in the scheduler at any time: a finished
        request is replaced at once, so the batch stays full while a long answer runs
        (generate() on a list waits for the whole list; offline distillation of thousands of
        prompts wants neither that nor all of them in the KV pool at once). sampling_params:
        one dict for all, or one per prompt; n = 1. A bad prompt raises when the stream reaches
        it; the requests then in flight are aborted, as they are when the consumer stops early.
        priority (as generate's): one for all, or one per prompt; in flight, higher ones run first
        (with enable_priority_scheduling), results still come in input order."""
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self._check_hidden_states(return_hidden_states)
        per_prompt = isinstance(sampling_params, Sequence)
        shared = None if per_prompt else params_list(sampling_params, 1)[0]
        for name, given in (("sampling_params", sampling_params if per_prompt else None),
                            ("priority", priority if isinstance(priority, Sequence) else None)):
            if given is not None and isinstance(prompts, Sequence) and len(prompts) != len(given):
                raise ValueError(f"{name}: {len(given)} values for {len(prompts)} prompts")
        if not isinstance(priority, Sequence):
            self._check_priority(priority)
        pairs = zip(prompts, sampling_params, strict=True) if per_prompt else ((p, None) for p in prompts)
        items = ((p, s, q) for (p, s), q in zip(pairs, priority, strict=True)) \
            if isinstance(priority, Sequence) else ((p, s, priority) for p, s in pairs)
        return self._ordered_results(iter(items), shared, max_in_flight, return_hidden_states)

    def _ordered_results(self, items, shared, max_in_flight, return_hidden_states) -> Iterator[dict]:
        order: deque[Req] = deque()            # submitted, in input order (some finished)
        exhausted = False
        try:
            while True:
                while not exhausted and sum(not r.finished for r in order) < max_in_flight:
                    item = next(items, None)
                    if item is None:
                        exhausted = True
                        break
                    ids = self._one_prompt(item[0])
                    params = shared if shared is not None else params_list(item[1], 1)[0]
                    if params.n != 1:
                        raise ValueError("generate_many takes n=1")
                    check_prompt(ids, params, self.limits)
                    check_grammar(params, self.args.grammar_backend, self.tokenizer is not None)
                    self._check_priority(item[2])
                    order.append(self._submit(ids, params, return_hidden_states, priority=item[2] or 0)[0])
                while order and order[0].finished:
                    yield self._result(order.popleft())
                if not order:
                    return
                self.scheduler.step()
        finally:          # a bad prompt or a consumer that stops early leaves no request behind
            for req in order:
                if not req.finished:
                    self.scheduler.abort(req.rid)

    def chat(self, messages: Messages | Sequence[Messages], sampling_params: dict | None = None,
             **kw: Any) -> dict | list[dict]:
        return self.generate(messages=messages, sampling_params=sampling_params, **kw)

    def flush_cache(self) -> bool:
        return self.scheduler.flush_cache()

    def shutdown(self) -> None:
        """Stop the other ranks (tensor parallel); the engine cannot generate afterwards."""
        self.scheduler.close()
        self._ranks.stop()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- internals --------------------------------------------------------------------------
    def _check_priority(self, priority: int | None) -> None:
        if priority is not None and not isinstance(priority, int):
            raise ValueError(f"priority must be an int, got {priority!r}")
        if priority not in (None, 0) and not self.args.enable_priority_scheduling:
            raise ValueError(f"priority: {priority} needs enable_priority_scheduling=True")

    def _check_dp_rank(self, rank: int | None) -> None:
        groups = self.args.parallel_config().dp_size
        if rank is not None and not 0 <= rank < groups:
            raise ValueError(f"routed_dp_rank {rank}: this engine has {groups} DP attention group(s); "
                             f"use 0..{groups - 1}")

    def _check_hidden_states(self, wanted: bool) -> None:
        if wanted and not self.args.enable_return_hidden_states:
            raise ValueError("return_hidden_states needs an engine started with "
                             "enable_return_hidden_states=True "
                             "(--enable-return-hidden-states)")

    def _prompt_ids(self, prompt, input_ids, messages) -> tuple[list[list[int]], bool]:
        given = {k: v for k, v in (("prompt", prompt), ("input_ids", input_ids), ("messages", messages))
                 if v is not None}
        if len(given) != 1:
            raise ValueError("give exactly one of prompt, input_ids, messages")
        (name, value), = given.items()
        kind = PROMPT_ARGS[name]
        items, single = as_batch(value, name, (kind,), ARG_FOR)
        batch = [self._encode(x, kind) for x in items]
        for ids in batch:
            if not ids:
                raise ValueError("prompt is empty: give at least one token")
        return batch, single

    def _one_prompt(self, prompt: Any) -> list[int]:
        """One prompt of generate_many: text or token ids."""
        kind = prompt_kind(prompt)
        if kind not in ("text", "ids"):
            raise TypeError(f"generate_many: each prompt is a string or a list of token ids, got "
                            f"{type(prompt).__name__}")
        ids = self._encode(prompt, kind)
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        return ids

    def _encode(self, prompt: Any, kind: str) -> list[int]:
        if kind == "ids":
            return list(prompt)
        tok = self._need_tokenizer()
        text = prompt if kind == "text" else tok.apply_chat_template(prompt, add_generation_prompt=True)
        return tok.encode(text, add_special_tokens=True)

    def _need_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer (model without tokenizer files, or "
                             "skip_tokenizer_init): pass input_ids")
        return self.tokenizer

    def _submit(self, ids: list[int], params: SamplingParams, hidden: bool = False,
                routed_dp_rank: int | None = None, priority: int = 0) -> list[Req]:
        """Queue the request (n fanned out)."""
        eos = self.scheduler.eos_ids
        reqs = [Req(rid, list(ids), p, RequestSamplingState(p, ids, eos), hidden_parts=[] if hidden else None,
                    routed_dp_rank=routed_dp_rank, priority=priority)
                for rid, p in fan_out(uuid.uuid4().hex[:16], params)]
        for req in reqs:
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
                text = out.push(new, req.finished, stop_token(req.finished_reason)) if out else ""
                yield {"text": text, "output_ids": new, "finished": req.finished,
                       "meta_info": self._meta(req)}
            if req.finished:
                return

    def _result(self, req: Req) -> dict:
        text = ""
        if self.tokenizer is not None:
            text = OutputStream(self.tokenizer, req.params).push(req.output_ids, True,
                                                                 stop_token(req.finished_reason))
        meta = self._meta(req)
        rows = req.pop_hidden_states()
        if rows is not None:
            meta["hidden_states"] = rows[0]
            if rows[1] is not None:
                meta["aux_hidden_states"] = rows[1]
        return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}

    @staticmethod
    def _meta(req: Req) -> dict:
        meta = meta_info(req.rid, req.finished_reason, len(req.input_ids), len(req.output_ids),
                         req.cached_tokens, (req.spec_verify_ct, req.spec_draft_token_num,
                                             req.spec_accept_token_num))
        if req.params.return_logprob:
            meta["output_token_logprobs"] = [(lp, t) for lp, t in zip(req.output_logprobs, req.output_ids)]
            meta["output_top_logprobs"] = [[(lp, t) for t, lp in top] for top in req.output_top_logprobs]
            ids = req.input_ids[max(0, req.params.logprob_start_len):] if req.wants_input_logprobs else []
            meta["input_token_logprobs"] = [(lp, t) for lp, t in zip(req.input_logprobs, ids)]
            meta["input_top_logprobs"] = [None if top is None else [(lp, t) for t, lp in top]
                                          for top in req.input_top_logprobs]
        return meta
