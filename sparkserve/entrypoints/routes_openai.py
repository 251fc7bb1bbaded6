"""OpenAI routes: /v1/chat/completions, /v1/completions, /v1/models."""
from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request
from starlette.responses import Response

from sparkserve.entrypoints.http_io import JSON, ServerContext, context, parse, respond
from sparkserve.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest
from sparkserve.entrypoints.serving_base import new_id
from sparkserve.entrypoints.serving_openai import OpenAIServing
from sparkserve.entrypoints.serving_responses import ResponsesRequest, ServingResponses

router = APIRouter()


async def _openai(request: Request, schema, serving: OpenAIServing, id_prefix: str) -> Response:
    req = await parse(request, schema)
    rid = req.rid or new_id(id_prefix)
    seqs = await asyncio.to_thread(serving.build, req, rid)     # tokenizing: off the event loop
    return await respond(request, serving.tm, seqs, req.stream,
                         lambda sub: serving.stream(req, rid, seqs, sub),
                         lambda sub: serving.full(req, rid, seqs, sub))


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _openai(request, ChatCompletionRequest, context(request).chat, "chatcmpl-")


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _openai(request, CompletionRequest, context(request).completion, "cmpl-")


@router.post("/v1/responses")
async def responses(request: Request) -> Response:
    """OpenAI's Responses API, stateless, on the chat path (serving_responses.py)."""
    ctx = context(request)
    serving = ServingResponses(ctx.chat)
    req = await parse(request, ResponsesRequest)
    rid = new_id("resp_")
    chat_req, seqs = await asyncio.to_thread(serving.build, req, rid)
    return await respond(request, ctx.tm, seqs, req.stream,
                         lambda sub: serving.stream(req, chat_req, rid, seqs, sub),
                         lambda sub: serving.full(req, chat_req, rid, seqs, sub))


def model_card(ctx: ServerContext) -> dict:
    return {"id": ctx.args.served_model_name, "object": "model", "created": int(time.time()),
            "owned_by": "sparkserve", "root": ctx.args.model_path,
            "max_model_len": ctx.tm.info.context_length}


@router.get("/v1/models")
async def models(request: Request) -> Response:
    return JSON({"object": "list", "data": [model_card(context(request))]})


@router.get("/v1/models/{model:path}")
async def model(request: Request, model: str) -> Response:
    ctx = context(request)
    ctx.chat.check_model(model)
    return JSON(model_card(ctx))
