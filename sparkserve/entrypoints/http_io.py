"""HTTP plumbing the routes share: what a route can reach (ServerContext on app.state), body
parsing with size and schema checks, the run-to-response step that aborts a request whose client
left, SSE responses that notice a disconnect, JSON that is always valid, and the API-key check."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

import anyio
from fastapi import Request
from pydantic import ValidationError
from starlette.responses import Response, StreamingResponse

from sparkserve.args import ServerArgs
from sparkserve.entrypoints.openai_protocol import ApiError
from sparkserve.entrypoints.serving_base import SSE_DONE, StreamError, dumps, sse
from sparkserve.entrypoints.serving_generate import ServingGenerate
from sparkserve.entrypoints.serving_openai import ServingChat, ServingCompletion
from sparkserve.entrypoints.tokenizer_manager import Overloaded, Submission, TokenizerManager, Unavailable
from sparkserve.messages import GenerateReq

log = logging.getLogger("sparkserve.server")

MAX_BODY_BYTES = 32 << 20
RETRY_AFTER_S = "1"


@dataclass
class ServerContext:
    args: ServerArgs
    tm: TokenizerManager
    chat: ServingChat
    completion: ServingCompletion
    generate: ServingGenerate
    tokenizer_path: str | None      # an HF tokenizer directory load generators can read


def context(request: Request) -> ServerContext:
    return request.app.state.ctx


class JSON(Response):
    """JSON response rendered by serving_base.dumps (valid JSON whatever the content)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return dumps(content).encode("ascii")


def error_response(e: ApiError) -> Response:
    return JSON(e.body(), e.status, headers=e.headers)


async def read_body(request: Request) -> bytes:
    """The body, read up to MAX_BODY_BYTES: a longer one is a 413 as soon as its Content-Length,
    or its bytes so far, say so (never read whole into memory first)."""
    too_big = ApiError(413, f"the request body is over {MAX_BODY_BYTES >> 20} MiB")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


async def parse(request: Request, model):
    body = await read_body(request)
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise ApiError.from_validation(e) from None


def submit(tm: TokenizerManager, seqs: list[GenerateReq]) -> Submission:
    try:
        return tm.submit(seqs)
    except Overloaded as e:
        raise ApiError(503, str(e), headers={"Retry-After": RETRY_AFTER_S}) from None
    except Unavailable as e:
        raise ApiError(503, str(e)) from None
    except ValueError as e:
        raise ApiError.bad_request(e) from None


async def respond(request: Request, tm: TokenizerManager, seqs: list[GenerateReq], stream: bool,
                  stream_fn: Callable[[Submission], AsyncIterator[str]],
                  full_fn: Callable[[Submission], Awaitable[Any]]) -> Response:
    """Submit `seqs`; answer with their stream or their full result. A client that goes away
    first aborts them at once (their KV is freed) and gets no answer."""
    sub = submit(tm, seqs)
    if stream:
        return EventStream(sse_guard(stream_fn(sub)), on_close=sub.close)
    task = asyncio.ensure_future(full_fn(sub))
    gone = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():                       # client went away: abort now, answer nobody
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            return Response(status_code=499)
        return JSON(task.result())
    finally:
        gone.cancel()
        task.cancel()
        sub.close()


async def disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body is read already, so receive() waits)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def sse_guard(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Errors inside a stream become an error event; every stream ends with [DONE]."""
    try:
        async for c in chunks:
            yield c
    except StreamError as e:
        yield sse(e.error.body())
    except ApiError as e:
        yield sse(e.body())
    except Exception as e:  # noqa: BLE001 - the headers are sent; report in-band
        log.exception("error inside a stream")
        yield sse(ApiError(500, f"internal error: {type(e).__name__}: {e}").body())
    yield SSE_DONE


class EventStream(StreamingResponse):
    """SSE response that notices a client disconnect while it waits for the next token (a queued
    request may wait long) and cancels the generator, whose cleanup aborts the request. Starlette
    does this itself only for servers declaring ASGI < 2.4 (uvicorn says 2.3 today); this does it
    for any server. `on_close` runs in every case, even if the stream never started."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    with contextlib.suppress(OSError):
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()
                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            self.on_close()


class ApiKeyMiddleware:
    """`Authorization: Bearer KEY` on every route but /health (pure ASGI: streams stay untouched)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope.get("path") != "/health":
            got = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not secrets.compare_digest(got, self.expected):
                msg = "invalid API key" if got else "missing API key: send 'Authorization: Bearer <key>'"
                await error_response(ApiError(401, msg))(scope, receive, send)
                return
        await self.app(scope, receive, send)
