"""`/v1/chat/completions` and `/v1/completions` in OpenAI's shapes: ids `chatcmpl-...`/`cmpl-...`,
usage, logprobs in OpenAI's two shapes, SSE chunks ending `data: [DONE]`,
`stream_options.include_usage`. One stream and one full-response skeleton; the two endpoints
differ only in how a request becomes prompts and how a choice and its logprobs look."""
from __future__ import annotations

import time
from typing import Any, AsyncIterator

from sparkserve.entrypoints.openai_protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    OpenAISampling,
)
from sparkserve.entrypoints.serving_base import ServingBase, finish_reason, sse, usage
from sparkserve.entrypoints.tokenizer_manager import SeqOut, Submission
from sparkserve.frontend.prepare import room_left
from sparkserve.messages import GenerateReq
from sparkserve.sampling_params import MAX_MESSAGES

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def last_hidden(req: OpenAISampling, o: SeqOut) -> dict:
    """SGLang's OpenAI `hidden_states` of a finished choice: the final normed hidden state of the
    last position the model ran (its full rows are on /generate)."""
    if not req.return_hidden_states or o.finish_reason is None:
        return {}
    return {"hidden_states": o.hidden_states[-1] if o.hidden_states else []}


class OpenAIServing(ServingBase):
    object_name = ""            # of a full response; a chunk's is object_name + ".chunk" (chat) or the same
    chunk_object = ""

    def build(self, req: Any, rid: str) -> list[GenerateReq]:
        raise NotImplementedError

    def first_choices(self, seqs: list[GenerateReq]) -> list[dict]:
        """Chunks sent before any token (chat: the assistant role of each choice)."""
        return []

    def stream_choices(self, req: Any, o: SeqOut, offsets: dict[int, int]) -> list[dict]:
        raise NotImplementedError

    def full_choice(self, req: Any, index: int, parts: list[SeqOut]) -> dict:
        raise NotImplementedError

    async def stream(self, req: Any, rid: str, seqs: list[GenerateReq],
                     sub: Submission) -> AsyncIterator[str]:
        created, usage_on = int(time.time()), bool(req.stream_options and req.stream_options.include_usage)
        offsets: dict[int, int] = {}

        def chunk(choices: list, usage_: Any = None) -> str:
            body = {"id": rid, "object": self.chunk_object, "created": created,
                    "model": self.served_name, "choices": choices}
            if usage_on:
                body["usage"] = usage_
            return sse(body)

        for choice in self.first_choices(seqs):
            yield chunk([choice])
        async for event in self.events(sub, seqs, usage_on):
            if isinstance(event, dict):          # final usage
                yield chunk([], event)
                continue
            for choice in self.stream_choices(req, event, offsets):
                yield chunk([choice])

    async def full(self, req: Any, rid: str, seqs: list[GenerateReq], sub: Submission) -> dict:
        outs = await self.collect(sub, seqs)
        choices = [self.full_choice(req, idx, outs[idx]) for idx in sorted(outs)]
        return {"id": rid, "object": self.object_name, "created": int(time.time()),
                "model": self.served_name, "choices": choices, "usage": usage(outs, seqs)}


class ServingChat(OpenAIServing):
    object_name, chunk_object = "chat.completion", "chat.completion.chunk"

    def build(self, req: ChatCompletionRequest, rid: str) -> list[GenerateReq]:
        self.check_model(req.model)
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise ApiError(400, "response_format: only {\"type\": \"text\"} is supported", "response_format")
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs: requires logprobs: true", "top_logprobs")
        if len(req.messages) > MAX_MESSAGES:
            raise ApiError(400, f"messages: {len(req.messages)} messages; one chat may have at most "
                                f"{MAX_MESSAGES}", "messages")
        for i, m in enumerate(req.messages):
            if m.get("role") not in CHAT_ROLES:
                raise ApiError(400,
                               f"messages.{i}.role: {m.get('role')!r} is not one of {', '.join(CHAT_ROLES)}",
                               "messages")
        tok = self.tokenizer("messages")
        try:
            text = tok.apply_chat_template(req.messages, add_generation_prompt=True, tools=req.tools,
                                           **(req.chat_template_kwargs or {}))
        except ValueError as e:
            raise ApiError.bad_request(e, "messages") from None
        # noqa: BLE001 - template errors (raise_exception, bad roles) are the request's
        except Exception as e:
            raise ApiError(400, f"messages: the chat template refused them: {e}", "messages") from None
        ids = self.tokenize(text, "messages")
        self.check_length(ids, "messages", "messages")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        top = (req.top_logprobs or 0) if req.logprobs else None
        names = {"top_logprobs_num": "top_logprobs"}
        return self.fan(rid, [(ids, self.openai_params(req, ids, max_tokens, None, top, names))],
                        req.return_hidden_states, dp_rank=self.dp_rank(req.routed_dp_rank),
                        boots=self.bootstraps(req, 1))

    def first_choices(self, seqs: list[GenerateReq]) -> list[dict]:
        return [{"index": s.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for s in seqs]

    def stream_choices(self, req: ChatCompletionRequest, o: SeqOut, offsets: dict[int, int]) -> list[dict]:
        out = []
        if o.text or (req.logprobs and o.token_ids):
            lp = {"content": self._logprobs(o)} if req.logprobs else None
            out.append({"index": o.index, "delta": {"content": o.text}, "logprobs": lp,
                        "finish_reason": None})
        if o.finish_reason is not None:
            out.append({"index": o.index, "delta": {}, "logprobs": None,
                        "finish_reason": finish_reason(o.finish_reason), **last_hidden(req, o)})
        return out

    def full_choice(self, req: ChatCompletionRequest, index: int, parts: list[SeqOut]) -> dict:
        msg = {"role": "assistant", "content": "".join(o.text for o in parts)}
        lp = {"content": [c for o in parts for c in self._logprobs(o)]} if req.logprobs else None
        return {"index": index, "message": msg, "logprobs": lp,
                "finish_reason": finish_reason(parts[-1].finish_reason), **last_hidden(req, parts[-1])}

    def _logprobs(self, o: SeqOut) -> list[dict]:
        entries = []
        for k, (tid, lp) in enumerate(zip(o.token_ids, o.logprobs)):
            text, raw = self.tm.token_piece(tid)
            tops = []
            for t, tl in (o.top_logprobs[k] if k < len(o.top_logprobs) else None) or []:
                tt, tr = self.tm.token_piece(t)
                tops.append({"token": tt, "logprob": tl, "bytes": list(tr)})
            entries.append({"token": text, "logprob": lp, "bytes": list(raw), "top_logprobs": tops})
        return entries


class ServingCompletion(OpenAIServing):
    object_name = chunk_object = "text_completion"

    def build(self, req: CompletionRequest, rid: str) -> list[GenerateReq]:
        self.check_model(req.model)
        if req.echo:
            raise ApiError(400, "echo is not supported", "echo")
        if req.suffix:
            raise ApiError(400, "suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise ApiError(400, "best_of: only best_of == n is supported", "best_of")
        prompts, _ = self.prompts(req.prompt, "prompt", ("text", "ids"))
        names = {"top_logprobs_num": "logprobs", "input_ids": "prompt"}
        checked = []
        for ids in prompts:
            default = min(16, room_left(ids, self.tm.limits))
            checked.append((ids, self.openai_params(req, ids, req.max_tokens, default, req.logprobs, names)))
        return self.fan(rid, checked, req.return_hidden_states, dp_rank=self.dp_rank(req.routed_dp_rank),
                        boots=self.bootstraps(req, len(prompts)))

    def stream_choices(self, req: CompletionRequest, o: SeqOut, offsets: dict[int, int]) -> list[dict]:
        if not (o.text or o.finish_reason is not None or (req.logprobs is not None and o.token_ids)):
            return []
        lp = self._logprobs(o, offsets) if req.logprobs is not None else None
        return [{"index": o.index, "text": o.text, "logprobs": lp,
                 "finish_reason": finish_reason(o.finish_reason), **last_hidden(req, o)}]

    def full_choice(self, req: CompletionRequest, index: int, parts: list[SeqOut]) -> dict:
        lp = None
        if req.logprobs is not None:
            offsets: dict[int, int] = {}
            lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            for o in parts:
                for k, v in self._logprobs(o, offsets).items():
                    lp[k] += v
        return {"index": index, "text": "".join(o.text for o in parts), "logprobs": lp,
                "finish_reason": finish_reason(parts[-1].finish_reason), **last_hidden(req, parts[-1])}

    def _logprobs(self, o: SeqOut, offsets: dict[int, int]) -> dict:
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
