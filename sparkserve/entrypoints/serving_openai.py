"""`/v1/chat/completions` and `/v1/completions` in OpenAI's shapes: ids `chatcmpl-...`/`cmpl-...`,
usage, logprobs in OpenAI's two shapes, SSE chunks ending `data: [DONE]`,
`stream_options.include_usage`. One stream and one full-response skeleton; the two endpoints
differ only in how a request becomes prompts and how a choice and its logprobs look."""
from __future__ import annotations

import time
from itertools import accumulate
from typing import Any, AsyncIterator

from sparkserve.constrained.check import apply_response_format
from sparkserve.entrypoints.chat_tools import checked_tools, forced_tools, tool_parser_for
from sparkserve.entrypoints.openai_protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    OpenAISampling,
    TokenizeRequest,
)
from sparkserve.entrypoints.serving_base import ServingBase, finish_reason, sse, usage
from sparkserve.entrypoints.tokenizer_manager import SeqOut, Submission, TokenizerManager
from sparkserve.frontend.chat_output import ChatOutputParser
from sparkserve.frontend.chat_template import continue_final, load_chat_template, render_chat_template
from sparkserve.frontend.prepare import room_left
from sparkserve.frontend.reasoning_parser import REASONING_PARSERS, ReasoningParser
from sparkserve.frontend.tool_parsers import TOOL_PARSERS
from sparkserve.messages import GenerateReq
from sparkserve.sampling_params import MAX_MESSAGES, SamplingParams

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# what the server itself hands the chat template (chat_template_kwargs may not override them)
TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "special_tokens"})


def last_hidden(req: OpenAISampling, o: SeqOut) -> dict:
    """SGLang's OpenAI `hidden_states` of a finished choice: the final normed hidden state of the
    last position the model ran (its full rows are on /generate)."""
    if not req.return_hidden_states or o.finish_reason is None:
        return {}
    return {"hidden_states": o.hidden_states[-1] if o.hidden_states else []}


def thinking(req: ChatCompletionRequest) -> bool:
    """Whether the answer may think: unless the template was told enable_thinking: false."""
    return (req.chat_template_kwargs or {}).get("enable_thinking", True) is not False

class OpenAIServing(ServingBase):
    object_name = ""            # of a full response; a chunk's is object_name + ".chunk" (chat) or the same
    chunk_object = ""

    def build(self, req: Any, rid: str) -> list[GenerateReq]:
        raise NotImplementedError

    def with_response_format(self, req: Any) -> Any:
        """response_format (json_object, json_schema) as the request's json_schema constraint."""
        try:
            return apply_response_format(req, self.tm.args.grammar_backend, self.tm.tokenizer is not None)
        except ValueError as e:
            raise ApiError.bad_request(e, "response_format") from None

    def first_choices(self, seqs: list[GenerateReq]) -> list[dict]:
        """Chunks sent before any token (chat: the assistant role of each choice)."""
        return []

    def stream_choices(self, req: Any, o: SeqOut, state: dict[int, Any]) -> list[dict]:
        """Chunks for one SeqOut; `state`: each choice's, kept across the stream's SeqOuts."""
        raise NotImplementedError

    def full_choice(self, req: Any, index: int, parts: list[SeqOut]) -> dict:
        raise NotImplementedError

    async def stream(self, req: Any, rid: str, seqs: list[GenerateReq],
                     sub: Submission) -> AsyncIterator[str]:
        created, usage_on = int(time.time()), bool(req.stream_options and req.stream_options.include_usage)
        state: dict[int, Any] = {}

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
            for choice in self.stream_choices(req, event, state):
                yield chunk([choice])

    async def full(self, req: Any, rid: str, seqs: list[GenerateReq], sub: Submission) -> dict:
        outs = await self.collect(sub, seqs)
        choices = [self.full_choice(req, idx, outs[idx]) for idx in sorted(outs)]
        return {"id": rid, "object": self.object_name, "created": int(time.time()),
                "model": self.served_name, "choices": choices, "usage": usage(outs, seqs)}


class ServingChat(OpenAIServing):
    object_name, chunk_object = "chat.completion", "chat.completion.chunk"

    def __init__(self, tm: TokenizerManager, model_names: set[str], served_name: str):
        super().__init__(tm, model_names, served_name)
        args = tm.args
        self.template = load_chat_template(args.chat_template) if args.chat_template else None
        self.tool_parser = TOOL_PARSERS[args.tool_call_parser]() if args.tool_call_parser else None
        self.reasoning_parser = REASONING_PARSERS[args.reasoning_parser] if args.reasoning_parser else None

    def build(self, req: ChatCompletionRequest, rid: str) -> list[GenerateReq]:
        self.check_model(req.model)
        req = self.with_response_format(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs: requires logprobs: true", "top_logprobs")
        tools = checked_tools(req, self.tool_parser)        # the tools the template renders
        req = forced_tools(req, self.tm.args.grammar_backend, self.tm.tokenizer is not None, self.tool_parser)
        ids = self.tokenize(self.render(req, tools), "messages")
        self.check_length(ids, "messages", "messages")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        top = (req.top_logprobs or 0) if req.logprobs else None
        names = {"top_logprobs_num": "top_logprobs"}
        if self.keeps_special_tokens(req):
            req = req.model_copy(update={"skip_special_tokens": False})
        params = self.openai_params(req, ids, max_tokens, None, top, names)
        params.grammar_after_token = self.thinking_end(req, params)
        return self.fan(rid, [(ids, params)], req.return_hidden_states,
                        dp_rank=self.dp_rank(req.routed_dp_rank), boots=self.bootstraps(req, 1),
                        priority=req.priority)

    def thinking_end(self, req: ChatCompletionRequest, params: SamplingParams) -> int | None:
        """SGLang's reasoning grammar: a reasoning model (--reasoning-parser, thinking on) thinks
        freely, and its constraint (response_format, forced or strict tools) starts after its end tag
        when that is one token (Qwen3's and DeepSeek-R1's `</think>` are)."""
        parser = self.reasoning_parser
        if params.grammar is None or not isinstance(parser, ReasoningParser) or not thinking(req):
            return None
        return self.tm.tokenizer.token_to_id(parser.end)

    def check_messages(self, messages: list[dict]) -> None:
        if len(messages) > MAX_MESSAGES:
            raise ApiError(400, f"messages: {len(messages)} messages; one chat may have at most "
                                f"{MAX_MESSAGES}", "messages")
        for i, m in enumerate(messages):
            if m.get("role") not in CHAT_ROLES:
                raise ApiError(400,
                               f"messages.{i}.role: {m.get('role')!r} is not one of {', '.join(CHAT_ROLES)}",
                               "messages")

    def render(self, req: ChatCompletionRequest | TokenizeRequest, tools: list[dict] | None) -> str:
        """The prompt text of a chat: the chat template (--chat-template, else the tokenizer's) over
        the messages, tools and chat_template_kwargs, closed by the assistant's turn opening
        (add_generation_prompt) or left inside the last message (continue_final_message)."""
        self.check_messages(req.messages)
        cont = req.continue_final_message
        if cont and req.add_generation_prompt:
            raise ApiError(400, "continue_final_message: cannot be true with add_generation_prompt (which "
                                "defaults to true): send add_generation_prompt: false",
                           "continue_final_message")
        if cont and req.messages[-1].get("role") != "assistant":
            raise ApiError(400, "continue_final_message: the last message must be the assistant's",
                           "continue_final_message")
        kwargs = req.chat_template_kwargs or {}
        taken = sorted(set(kwargs) & TEMPLATE_VARIABLES)
        if taken:
            raise ApiError(400, f"chat_template_kwargs: {', '.join(taken)} are set by the server (use the "
                                "request's own fields)", "chat_template_kwargs")
        tok, opening = self.tokenizer("messages"), req.add_generation_prompt

        def render_as_given(messages: list[dict]) -> str:
            if self.template is not None:
                return render_chat_template(self.template, messages, add_generation_prompt=opening,
                                            tools=tools, special_tokens=tok.special_tokens, **kwargs)
            return tok.apply_chat_template(messages, add_generation_prompt=opening, tools=tools, **kwargs)

        def render(messages: list[dict]) -> str:
            """A template that cannot take an assistant turn without content (one of only
            tool_calls: `content: null`, or none) gets "" there, as vLLM and SGLang give it."""
            try:
                return render_as_given(messages)
            except Exception:
                given = [m.get("role") != "assistant" or isinstance(m.get("content"), (str, list))
                         for m in messages]
                if all(given):
                    raise
                return render_as_given([m if ok else {**m, "content": ""} for m, ok in zip(messages, given)])
        try:
            return continue_final(render, req.messages) if cont else render(req.messages)
        except ValueError as e:
            raise ApiError.bad_request(e, "continue_final_message" if cont and "continue_final" in str(e)
                                       else "messages") from None
        # noqa: BLE001 - template errors (raise_exception, bad roles) are the request's
        except Exception as e:
            raise ApiError(400, f"messages: the chat template refused them: {e}", "messages") from None

    def output_parser(self, req: ChatCompletionRequest) -> ChatOutputParser | None:
        """How this request's answers are read: tool calls when tool_parser_for says so, thinking
        apart unless separate_reasoning is off or the template was told enable_thinking: false."""
        tools = tool_parser_for(req, self.tool_parser)
        reasoning = self.reasoning_parser if req.separate_reasoning and thinking(req) else None
        if tools is None and reasoning is None:
            return None
        return ChatOutputParser(reasoning, tools, None if req.parallel_tool_calls else 1,
                                stream_reasoning=req.stream_reasoning)

    def first_choices(self, seqs: list[GenerateReq]) -> list[dict]:
        return [{"index": s.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for s in seqs]

    def stream_choices(self, req: ChatCompletionRequest, o: SeqOut, state: dict[int, Any]) -> list[dict]:
        out, final = [], o.finish_reason is not None
        parser = self.output_parser(req)
        if parser is None:
            delta = {"content": o.text} if o.text else {}
        else:
            if o.index not in state:
                state[o.index] = parser.stream()
            delta = state[o.index].feed(o.text, final)
        if delta or (req.logprobs and o.token_ids):
            lp = {"content": self._logprobs(o)} if req.logprobs else None
            out.append({"index": o.index, "delta": delta or {"content": ""}, "logprobs": lp,
                        "finish_reason": None})
        if final:
            reason = finish_reason(o.finish_reason)
            if parser is not None and state[o.index].made_calls and reason == "stop":
                reason = "tool_calls"
            out.append({"index": o.index, "delta": {}, "logprobs": None, "finish_reason": reason,
                        **last_hidden(req, o)})
        return out

    def keeps_special_tokens(self, req: ChatCompletionRequest) -> bool:
        """Whether the answer is detokenized with its special tokens although the client asked them
        skipped: a tool-call or thinking format whose markers are special tokens reads them."""
        parser = self.output_parser(req)
        return req.skip_special_tokens and parser is not None and any(
            p is not None and not p.skip_special_tokens for p in (parser.tools, parser.reasoning))

    def full_choice(self, req: ChatCompletionRequest, index: int, parts: list[SeqOut]) -> dict:
        text = "".join(o.text for o in parts)
        parser = self.output_parser(req)
        reason = finish_reason(parts[-1].finish_reason)
        if parser is None:
            msg = {"role": "assistant", "content": text}
        else:
            answer = parser.parse(text)
            msg = answer.message(with_reasoning=parser.reasoning is not None)
            if answer.calls and reason == "stop":
                reason = "tool_calls"
        lp = {"content": [c for o in parts for c in self._logprobs(o)]} if req.logprobs else None
        return {"index": index, "message": msg, "logprobs": lp, "finish_reason": reason,
                **last_hidden(req, parts[-1])}

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
        req = self.with_response_format(req)
        if req.suffix:
            raise ApiError(400, "suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise ApiError(400, "best_of: only best_of == n is supported", "best_of")
        prompts, _ = self.prompts(req.prompt, "prompt", ("text", "ids"))
        names = {"top_logprobs_num": "logprobs", "input_ids": "prompt"}
        checked = []
        for ids in prompts:
            default = min(16, room_left(ids, self.tm.limits))
            params = self.openai_params(req, ids, req.max_tokens, default, req.logprobs, names)
            if req.echo and req.logprobs is not None:
                params.logprob_start_len = 0            # echo's logprobs: the whole prompt's too
            checked.append((ids, params))
        return self.fan(rid, checked, req.return_hidden_states, dp_rank=self.dp_rank(req.routed_dp_rank),
                        boots=self.bootstraps(req, len(prompts)), priority=req.priority)

    def stream_choices(self, req: CompletionRequest, o: SeqOut, offsets: dict[int, int]) -> list[dict]:
        echo = self._echo_choice(req, o, offsets) if req.echo and o.index not in offsets else []
        if not (o.text or o.finish_reason is not None or (req.logprobs is not None and o.token_ids)):
            return echo
        lp = self._logprobs(o, offsets) if req.logprobs is not None else None
        return echo + [{"index": o.index, "text": o.text, "logprobs": lp,
                        "finish_reason": finish_reason(o.finish_reason), **last_hidden(req, o)}]

    def full_choice(self, req: CompletionRequest, index: int, parts: list[SeqOut]) -> dict:
        lp = None
        offsets: dict[int, int] = {}
        text = ""
        if req.echo:
            echo = self._echo_choice(req, next((o for o in parts if o.input_logprobs is not None), parts[0]),
                                     offsets)
            text, lp = (echo[0]["text"], echo[0]["logprobs"]) if echo else ("", None)
        if req.logprobs is not None:
            lp = lp or {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            for o in parts:
                for k, v in self._logprobs(o, offsets).items():
                    lp[k] += v
        return {"index": index, "text": text + "".join(o.text for o in parts), "logprobs": lp,
                "finish_reason": finish_reason(parts[-1].finish_reason), **last_hidden(req, parts[-1])}

    def _echo_choice(self, req: CompletionRequest, o: SeqOut, offsets: dict[int, int]) -> list[dict]:
        """echo: the choice's prompt as it comes before its completion, with the prompt tokens'
        logprobs (None for the first) when logprobs are asked for; once per choice (`offsets`
        then holds where the completion's text offsets start). [] while they are not computed."""
        if req.logprobs is not None and o.input_logprobs is None:
            return []
        prompts = [req.prompt] if isinstance(req.prompt, str) or not isinstance(req.prompt[0], (str, list)) \
            else req.prompt
        prompt = prompts[o.index // req.n]
        text = prompt if isinstance(prompt, str) else self.tm.need_tokenizer().decode(prompt, False)
        lp = None
        if req.logprobs is not None:
            pieces = [self.tm.token_piece(t)[0] for t in o.input_logprob_ids]
            lp = {"tokens": pieces, "token_logprobs": list(o.input_logprobs),
                  "top_logprobs": [None if top is None else {self.tm.token_piece(t)[0]: v for t, v in top}
                                   for top in o.input_top_logprobs],
                  "text_offset": list(accumulate((len(p) for p in pieces[:-1]), initial=0))}
        offsets[o.index] = len(text)
        return [{"index": o.index, "text": text, "logprobs": lp, "finish_reason": None}]

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
