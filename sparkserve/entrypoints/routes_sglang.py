"""SGLang routes: /generate, /tokenize, /detokenize, /server_info, /model_info (also under /get_...),
/metrics, and the operations /health, /health_generate, /flush_cache, /abort_request."""
from __future__ import annotations

import asyncio
import dataclasses
import uuid
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import PlainTextResponse, Response

import sparkserve
from sparkserve.entrypoints.http_io import JSON, context, error_response, parse, respond, submit
from sparkserve.entrypoints.metrics import CONTENT_TYPE
from sparkserve.entrypoints.openai_protocol import (
    AbortRequest,
    ApiError,
    DetokenizeRequest,
    GenerateRequest,
    TokenizeRequest,
)
from sparkserve.entrypoints.tokenizer_manager import Unavailable
from sparkserve.messages import GenerateReq
from sparkserve.sampling_params import MAX_PROMPTS, MAX_RID_CHARS, SamplingParams
from sparkserve.speculative_args import server_info_fields

router = APIRouter()
HEALTH_GENERATE_TIMEOUT_S = 20.0


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(request: Request) -> Response:
    serving = context(request).generate
    req = await parse(request, GenerateRequest)
    seqs, batch = await asyncio.to_thread(serving.build, req)   # tokenizing: off the event loop
    with_text = req.return_text_in_logprobs
    return await respond(request, serving.tm, seqs, req.stream,
                         lambda sub: serving.stream(seqs, sub, batch, with_text),
                         lambda sub: serving.full(seqs, sub, batch, with_text))


@router.post("/tokenize")
@router.post("/v1/tokenize")
async def tokenize(request: Request) -> Response:
    """Token ids of a prompt (or a batch of them: lists of ids and counts) or of a chat's rendered
    prompt, as SGLang and vLLM answer: tokens, count, max_model_len."""
    ctx = context(request)
    req = await parse(request, TokenizeRequest)
    ctx.chat.check_model(req.model)
    given = [n for n in ("prompt", "text", "messages") if getattr(req, n) is not None]
    if len(given) != 1:
        got = f" (got {', '.join(given)})" if given else ""
        raise ApiError(400, f"prompt: give one of prompt, text or messages{got}",
                       given[-1] if given else "prompt")
    tok = ctx.chat.tokenizer(given[0])

    def run() -> list[int] | list[list[int]]:
        if req.messages is not None:
            text = ctx.chat.render(req, req.tools or None)       # the template writes its own BOS
            return ctx.chat.tokenize(text, "messages")
        value = req.prompt if req.prompt is not None else req.text
        texts = [value] if isinstance(value, str) else value
        if len(texts) > MAX_PROMPTS:
            raise ApiError(400, f"{given[0]}: {len(texts)} prompts; at most {MAX_PROMPTS}", given[0])
        ids = []
        for i, t in enumerate(texts):
            where = given[0] if isinstance(value, str) else f"{given[0]}[{i}]"
            try:
                ids.append(tok.encode(t, add_special_tokens=req.add_special_tokens))
            except Exception as e:  # noqa: BLE001 - e.g. lone surrogates the tokenizer cannot encode
                raise ApiError(400, f"{where}: cannot be tokenized ({type(e).__name__}: {e})",
                               given[0]) from None
        return ids[0] if isinstance(value, str) else ids
    tokens = await asyncio.to_thread(run)
    count = [len(t) for t in tokens] if tokens and isinstance(tokens[0], list) else len(tokens)
    return JSON({"tokens": tokens, "count": count, "max_model_len": ctx.tm.info.context_length})


@router.post("/detokenize")
@router.post("/v1/detokenize")
async def detokenize(request: Request) -> Response:
    ctx = context(request)
    req = await parse(request, DetokenizeRequest)
    ctx.chat.check_model(req.model)
    tok = ctx.chat.tokenizer("tokens")
    bad = next((t for t in req.tokens if not 0 <= t < tok.vocab_size), None)
    if bad is not None:
        raise ApiError(400, f"tokens: {bad} is not a token id of this model (0 to {tok.vocab_size - 1})",
                       "tokens")
    text = await asyncio.to_thread(tok.decode, req.tokens, req.skip_special_tokens)
    return JSON({"text": text})


@router.get("/model_info")
@router.get("/get_model_info")
async def model_info(request: Request) -> Response:
    ctx = context(request)
    ready = ctx.tm.info
    return JSON({"model_path": ctx.args.model_path, "tokenizer_path": ctx.tokenizer_path,
                 "is_generation": True, "served_model_name": ctx.args.served_model_name,
                 "architecture": ready.architecture, "context_length": ready.context_length,
                 "vocab_size": ready.vocab_size})


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(request: Request) -> Response:
    ctx = context(request)
    tm, ready = ctx.tm, ctx.tm.info
    load = await tm.get_load(timeout=2.0)
    info: dict[str, Any] = dataclasses.asdict(ctx.args)
    if info.get("api_key"):
        info["api_key"] = "<hidden>"
    # the args carry disaggregation_mode and disaggregation_bootstrap_port, which PD routers read
    info.update(tokenizer_path=ctx.tokenizer_path, version=sparkserve.__version__,
                max_total_num_tokens=ready.max_total_num_tokens, context_length=ready.context_length,
                vocab_size=ready.vocab_size, scheduler_pid=ready.pid, dp_size=tm.dp_groups,
                device=ready.device)
    info = server_info_fields(info, ctx.args.speculative_algorithm, ready.speculative)
    state = {k: v for k, v in dataclasses.asdict(load).items() if k != "cid"}
    info["internal_states"] = [{**state, "token_usage": load.token_usage, "inflight_sequences": tm.inflight}]
    return JSON(info)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    tm = context(request).tm
    await tm.get_load(timeout=1.0)
    return Response(tm.metrics.render(), media_type=CONTENT_TYPE)


@router.get("/health")
async def health(request: Request) -> Response:
    tm = context(request).tm
    if tm.healthy:
        return Response(status_code=200)
    return error_response(ApiError(503, tm.dead or "server is shutting down"))


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """One greedy token through the whole path, within HEALTH_GENERATE_TIMEOUT_S."""
    tm = context(request).tm
    bos = tm.info.bos_token_id
    seqs = [GenerateReq(f"health-{uuid.uuid4().hex}", [bos if bos is not None else 0],
                        SamplingParams(max_new_tokens=1, temperature=0.0))]
    sub = submit(tm, seqs)

    async def run() -> None:
        async for o in sub:
            if o.error_status is not None:
                raise ApiError(o.error_status, o.error_message)
    try:
        await asyncio.wait_for(run(), HEALTH_GENERATE_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise ApiError(503, f"health generation took over {HEALTH_GENERATE_TIMEOUT_S:.0f}s") from None
    finally:
        sub.close()
    return Response(status_code=200)


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> Response:
    try:
        out = await context(request).tm.flush_cache()
    except Unavailable as e:
        raise ApiError(503, str(e)) from None
    except asyncio.TimeoutError:
        raise ApiError(503, "the scheduler did not answer in time") from None
    if not out.success:
        raise ApiError(400, f"cache not flushed: {out.message}")
    return PlainTextResponse("Cache flushed.\n")


@router.post("/abort_request")
async def abort_request(request: Request) -> Response:
    tm = context(request).tm
    req = await parse(request, AbortRequest)
    if not req.abort_all and not req.rid:
        raise ApiError(400, "rid: give the rid to abort, or abort_all: true", "rid")
    if len(req.rid) > MAX_RID_CHARS:         # no request has such a rid (and each lookup would copy it)
        raise ApiError(400, f"rid: at most {MAX_RID_CHARS} characters, got {len(req.rid)}", "rid")
    n = tm.abort_all() if req.abort_all else tm.abort(req.rid)
    return JSON({"aborted": n})
