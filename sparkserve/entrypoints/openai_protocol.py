"""Request schemas of the generation endpoints (pydantic, strict types) and the error shape.

Strict: a number sent as a string, a bool sent as a number, a float where an int belongs are 400s
naming the field, never silently converted. Unknown fields are ignored (clients send vendor
extras), except the ones whose silent omission would change the output (`ApiError` in serving).
Value ranges are checked once, by SamplingParams.validate, not here.

Every list stops at its first bad item (`Ints`, `Strs`, ...: pydantic's fail_fast): a body of a
million wrong items must cost one error, not a million (pydantic collects them all by default, and
ApiError turning them into Python took minutes and gigabytes for a few MiB)."""
from __future__ import annotations

import re
import reprlib
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

Number = float          # strict mode: accepts int and float, refuses str and bool
_FAIL_FAST = Field(fail_fast=True)
Ints = Annotated[list[int], _FAIL_FAST]
Strs = Annotated[list[str], _FAIL_FAST]
Bools = Annotated[list[bool], _FAIL_FAST]
Objects = Annotated[list[dict[str, Any]], _FAIL_FAST]
IntLists = Annotated[list[Ints], _FAIL_FAST]
Ports = Annotated[list[int | None], _FAIL_FAST]
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxstring, _SHORT.maxother = 2, 3, 3, 60, 60


def short_repr(value: Any) -> str:
    """repr of a client's value for an error message, cut short whatever its size (in time too)."""
    return _SHORT.repr(value)


class ApiError(Exception):
    """An error answered in OpenAI's shape (SGLang's `object: "error"` fields alongside)."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 413: "invalid_request_error", 500: "internal_server_error",
             502: "bad_gateway_error", 503: "service_unavailable_error"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        err = {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
               "param": self.param, "code": self.status}
        return {"object": "error", **err, "error": err}

    @classmethod
    def bad_request(cls, e: ValueError | str, param: str | None = None) -> "ApiError":
        msg = str(e)
        if param is None:                   # our ValueErrors start with the parameter's name
            head = msg.split(" ", 1)[0].rstrip(":")
            bare = head.replace("_", "").replace(".", "").replace("[", "").replace("]", "")
            param = head if bare.isalnum() else None
        return cls(400, msg, param)

    @classmethod
    def from_validation(cls, e: ValidationError) -> "ApiError":
        errors = e.errors(include_url=False, include_context=False)
        err = errors[0]
        loc = _field_path(err.get("loc", ()))
        if err.get("type") == "json_invalid":
            return cls(400, f"the request body is not valid JSON: {err.get('msg')}")
        if not loc:
            return cls(400, f"the request body must be a JSON object: {err.get('msg')}")
        field = loc.split(".")[0]
        tags = _union_tags(errors, field)
        if len(tags) > 1:                   # a union field matched none of its forms
            got = short_repr(err.get("input"))
            got = got if loc == field else f"at {loc}: {got}"
            return cls(400, f"{field}: invalid value ({got[:80]}); accepted: {' | '.join(tags)}", field)
        more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
        return cls(400, f"{loc}: {err.get('msg')}{more}", field)


_UNION_TAG = re.compile(r"^(str|int|float|bool|dict|list|none|json-or-python|is-instance|function-\w+)"
                        r"(\[.*\])?$")


def _field_path(loc: tuple) -> str:
    """`messages.0.content` style path of a pydantic error, without union-member tags
    (`stop.list[str].0` -> `stop.0`)."""
    parts = [str(x) for x in loc if not (isinstance(x, str) and _UNION_TAG.match(x))]
    return ".".join(parts)


def _union_tags(errors: list[dict], field: str) -> list[str]:
    tags: list[str] = []
    for err in errors:
        loc = err.get("loc", ())
        if len(loc) > 1 and str(loc[0]) == field and isinstance(loc[1], str) and _UNION_TAG.match(loc[1]):
            tag = loc[1].replace("dict[str,any]", "object").replace("any", "object")
            if tag not in tags:
                tags.append(tag)
    return tags


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class OpenAISampling(_Request):
    """Fields shared by chat and completions (OpenAI's, then SGLang/vLLM's extra-body ones)."""
    model: str | None = None
    max_tokens: int | None = None
    n: int = 1
    stop: str | Strs | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    frequency_penalty: Number | None = None
    presence_penalty: Number | None = None
    seed: int | None = None
    user: str | None = None
    logit_bias: dict[str, Any] | None = None
    # extra body (SGLang / vLLM names)
    top_k: int | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    stop_token_ids: Ints | None = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    # SGLang: constrained decoding (at most one; response_format becomes json_schema or structural_tag)
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    rid: str | None = None
    # SGLang: each finished choice gets "hidden_states", the final normed hidden state of the
    # last position run (needs --enable-return-hidden-states; /generate returns every row)
    return_hidden_states: bool = False
    # SGLang: the DP-attention group to run every choice on (None: the server's load balancing)
    routed_dp_rank: int | None = None
    # SGLang / vLLM: the waiting queue's order (needs --enable-priority-scheduling unless 0)
    priority: int | None = None
    # PD disaggregation, added by a PD router (see ServingBase.bootstraps)
    bootstrap_host: str | Strs | None = None
    bootstrap_port: int | Ports | None = None
    bootstrap_room: int | Ints | None = None


class ChatCompletionRequest(OpenAISampling):
    messages: Objects = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: Objects | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True         # false: at most one call (the first)
    response_format: dict[str, Any] | None = None
    # chat template controls (vLLM's names): continue_final_message continues the last
    # (assistant) message instead of opening a new turn; the kwargs are template variables
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # SGLang: with --reasoning-parser, thinking goes to reasoning_content (False: left in content);
    # stream_reasoning False: streamed in one delta once whole, not as it is written
    separate_reasoning: bool = True
    stream_reasoning: bool = True


class CompletionRequest(OpenAISampling):
    prompt: str | Strs | Ints | IntLists
    response_format: dict[str, Any] | None = None
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class GenerateRequest(_Request):
    """SGLang's /generate (GenerateReqInput): one prompt or a batch, text or token ids."""
    text: str | Strs | None = None
    input_ids: Ints | IntLists | None = None
    sampling_params: dict[str, Any] | Objects | None = None
    rid: str | Strs | None = None
    stream: bool = False
    return_logprob: bool | Bools = False
    top_logprobs_num: int | Ints = 0
    logprob_start_len: int | Ints = -1
    return_text_in_logprobs: bool = False
    # final normed hidden state of every position run (prompt, output but the last token) in
    # meta_info "hidden_states", with the tapped aux layers in "aux_hidden_states"; needs
    # --enable-return-hidden-states. max_new_tokens 0 runs the prompt only.
    return_hidden_states: bool | Bools = False
    # the DP-attention group to run the whole request on (None: load balancing); data_parallel_rank
    # is SGLang's older name for it
    routed_dp_rank: int | None = None
    data_parallel_rank: int | None = None
    priority: int | None = None     # the waiting queue's order (needs --enable-priority-scheduling unless 0)
    # PD disaggregation, added by a PD router: one value, or one per prompt (ServingBase.bootstraps)
    bootstrap_host: str | Strs | None = None
    bootstrap_port: int | Ports | None = None
    bootstrap_room: int | Ints | None = None


class TokenizeRequest(_Request):
    """/tokenize (SGLang's and vLLM's): a prompt (`text` is SGLang's other name) or chat messages."""
    model: str | None = None
    prompt: str | Strs | None = None
    text: str | Strs | None = None
    messages: Objects | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: Objects | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: Ints
    skip_special_tokens: bool = True


class AbortRequest(_Request):
    rid: str = ""
    abort_all: bool = False
