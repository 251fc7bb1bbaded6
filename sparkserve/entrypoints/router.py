"""`sparkserve router`: a prefill/decode (PD) disaggregation router for users without
sglang-router, with the flag shapes of its PD mode (`--prefill URL [BOOTSTRAP_PORT]`, `--decode
URL`, each repeatable).

Each generation request (/generate, /v1/completions, /v1/chat/completions) goes to one prefill and
one decode server (round robin over the healthy ones: router_pool.py) with the same body plus the
pairing a PD server reads: bootstrap_host (the prefill server's host), bootstrap_port (its
bootstrap service) and a random 63-bit bootstrap_room (one per prompt for a batch). Both get it at
once, so the decode server reserves room for the request while the prefill server runs the
prompt, instead of one waiting for the other's HTTP round trip. The prefill server hands the
request over to the decode server, whose answer (JSON, or SSE passed through unchanged) is the
client's. If the prefill server answers an error, the decode half would only wait for state that
never comes: it is cancelled and the client gets the prefill server's status and body. A client
that goes away cancels both requests (each server then aborts its half and frees its KV)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
from typing import Any, AsyncIterator

import httpx
import uvicorn
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

import sparkserve
from sparkserve.entrypoints.http_io import EventStream, disconnected, error_response, read_body
from sparkserve.entrypoints.openai_protocol import ApiError
from sparkserve.entrypoints.router_pool import DEFAULT_BOOTSTRAP_PORT, Server, ServerPool
from sparkserve.sampling_params import MAX_PROMPTS

log = logging.getLogger("sparkserve.router")

GENERATION_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")
INFO_ROUTES = ("/v1/models", "/model_info", "/get_model_info", "/server_info", "/get_server_info")
CONNECT_TIMEOUT_S = 10.0
ROOM_BITS = 63                      # as SGLang's routers draw rooms


# ---- the pairing ---------------------------------------------------------------------------
def prompt_count(path: str, payload: dict[str, Any]) -> int | None:
    """How many prompts a batched request carries; None for a single prompt (sent scalars)."""
    if path == "/generate":
        text, ids = payload.get("text"), payload.get("input_ids")
        if isinstance(text, list):
            return len(text)
        if isinstance(ids, list) and ids and isinstance(ids[0], list):
            return len(ids)
    elif path == "/v1/completions":
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            return len(prompt)          # texts or token-id lists, not one token-id prompt
    return None


def bootstrap_fields(prefill: Server, count: int | None) -> dict[str, Any]:
    """bootstrap_host/port/room for a request sent to `prefill` (lists for `count` prompts)."""
    if count is None:
        return {"bootstrap_host": prefill.host, "bootstrap_port": prefill.bootstrap_port,
                "bootstrap_room": random.getrandbits(ROOM_BITS)}
    return {"bootstrap_host": [prefill.host] * count, "bootstrap_port": [prefill.bootstrap_port] * count,
            "bootstrap_room": [random.getrandbits(ROOM_BITS) for _ in range(count)]}


# ---- one upstream request ------------------------------------------------------------------
class Call:
    """One POST to an upstream server in a task of its own: its response head as soon as it comes
    (a streamed answer's head comes at once, a full one's with the body), then the body chunk by
    chunk into a queue. Cancelling it closes the connection, which the server takes for a client
    that left: it aborts the request."""

    def __init__(self, client: httpx.AsyncClient, server: Server, path: str, data: bytes,
                 headers: dict[str, str]):
        self.server = server
        self.head: asyncio.Future[httpx.Response | None] = asyncio.get_running_loop().create_future()
        self.chunks: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.error: str | None = None        # why the server could not be reached or the body broke off
        self.task = asyncio.create_task(self._run(client, path, data, headers))

    async def _run(self, client: httpx.AsyncClient, path: str, data: bytes, headers: dict[str, str]) -> None:
        try:
            async with client.stream("POST", self.server.url + path, content=data, headers=headers) as r:
                self.head.set_result(r)
                async for chunk in r.aiter_bytes():     # decoded: no content-encoding passes on
                    self.chunks.put_nowait(chunk)
        except httpx.HTTPError as e:
            self.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            if not self.head.done():
                self.head.set_result(None)   # no answer: the caller reads `error`
            else:
                log.warning("the answer of %s broke off: %s", self.server.url, self.error)
        finally:
            if not self.head.done():
                self.head.cancel()
            self.chunks.put_nowait(None)

    async def response(self) -> httpx.Response | None:
        """The answer's head, or None when the server could not be reached."""
        return await asyncio.shield(self.head)

    async def stream(self) -> AsyncIterator[bytes]:
        while (chunk := await self.chunks.get()) is not None:
            yield chunk

    async def body(self) -> bytes:
        return b"".join([c async for c in self.stream()])

    def cancel(self) -> None:
        self.task.cancel()


async def _decide(pool: ServerPool, prefill: Call, decode: Call, stream: bool) -> Response | Call:
    """Whose answer the client gets: an error Response, or the decode Call to pass on.

    The prefill server's answer decides first: in PD it comes once its half is done (a streamed
    one's head at once), before the decode server's. A decode answer that comes first decides only
    when it is final: an error, or a whole non-streamed answer (the request is done)."""
    pending = {prefill.head, decode.head}
    while prefill.head in pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if decode.head in done:
            head = await decode.response()
            if head is None or head.status_code >= 400 or not stream:
                return await _passed_on(pool, decode, head)
    head = await prefill.response()
    if head is None or head.status_code >= 400:
        return await _passed_on(pool, prefill, head)
    return decode if await decode.response() is not None else await _passed_on(pool, decode, None)


async def _passed_on(pool: ServerPool, call: Call, head: httpx.Response | None) -> Response | Call:
    """`call`'s answer as the client's: a 502 when its server could not be reached (then skipped
    until a health check passes), its error status and body, or the call itself to stream on."""
    if head is None:
        pool.mark_down(call.server, call.error or "no answer")
        return error_response(ApiError(502, f"the {call.server.role} server {call.server.url} could not be "
                                            f"reached: {call.error}"))
    if head.status_code >= 400:
        return Response(await call.body(), head.status_code, media_type=head.headers.get("content-type"))
    return call


# ---- the app --------------------------------------------------------------------------------
class Router:
    """The routes' work: a generation request to a pair, an info request to a decode server."""

    def __init__(self, pool: ServerPool, client: httpx.AsyncClient):
        self.pool = pool
        self.client = client

    async def generate(self, request: Request, path: str) -> Response:
        payload = _json_object(await read_body(request))
        count = prompt_count(path, payload)
        if count is not None and count > MAX_PROMPTS:     # before a room is drawn for each
            name = "text" if isinstance(payload.get("text"), list) else \
                "input_ids" if path == "/generate" else "prompt"
            raise ApiError(400, f"{name}: a batch of {count} prompts; one request may carry at most "
                                f"{MAX_PROMPTS}", name)
        prefill, decode = self.pool.pair()
        payload.update(bootstrap_fields(prefill, count))
        data = json.dumps(payload).encode()
        headers = {"content-type": "application/json", **_auth(request)}
        calls = tuple(Call(self.client, server, path, data, headers) for server in (prefill, decode))
        stream = payload.get("stream") is True
        streaming = False                        # once the SSE response owns the calls

        def cancel() -> None:
            for c in calls:
                c.cancel()

        work = asyncio.ensure_future(_decide(self.pool, *calls, stream))
        gone = asyncio.ensure_future(disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():                  # the client left before any answer
                return Response(status_code=499)
            answer = work.result()
            if isinstance(answer, Response):
                return answer
            if stream:                           # its end, or the client leaving, cancels both
                streaming = True
                return EventStream(answer.stream(), on_close=cancel)
            head = await answer.response()
            body = asyncio.ensure_future(answer.body())
            await asyncio.wait({body, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not body.done():
                body.cancel()
                return Response(status_code=499)
            return Response(body.result(), head.status_code, media_type=head.headers.get("content-type"))
        finally:
            gone.cancel()
            work.cancel()
            with contextlib.suppress(BaseException):
                await work
            if not streaming:
                cancel()

    async def info(self, request: Request) -> Response:
        """A decode server's answer (the model as the decode side serves it)."""
        server = self.pool.pick("decode")
        try:
            r = await self.client.get(server.url + request.url.path, headers=_auth(request))
        except httpx.HTTPError as e:
            self.pool.mark_down(server, f"{type(e).__name__}: {e}")
            raise ApiError(502, f"the decode server {server.url} could not be reached: {e}") from None
        return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))

    def health(self) -> Response:
        for role, group in (("prefill", self.pool.prefill), ("decode", self.pool.decode)):
            if not any(s.healthy for s in group):
                return error_response(ApiError(503, f"no healthy {role} server"))
        return Response(status_code=200)


def _auth(request: Request) -> dict[str, str]:
    auth = request.headers.get("authorization")
    return {"authorization": auth} if auth else {}


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError) as e:   # RecursionError: nested deeper than the parser goes
        raise ApiError(400, f"the request body is not valid JSON: {type(e).__name__}: {e}") from None
    if not isinstance(payload, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return payload


def create_router_app(pool: ServerPool) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S),
                                     limits=httpx.Limits(max_connections=None)) as client:
            pool.client = client
            await pool.check()
            app.state.router = Router(pool, client)
            checks = asyncio.create_task(pool.run())
            try:
                yield
            finally:
                checks.cancel()

    app = FastAPI(title="sparkserve router", version=sparkserve.__version__, openapi_url=None, docs_url=None,
                  redoc_url=None, lifespan=lifespan)

    def router(request: Request) -> Router:
        return request.app.state.router

    for path in GENERATION_ROUTES:
        async def generate(request: Request, path: str = path) -> Response:
            return await router(request).generate(request, path)
        app.add_api_route(path, generate, methods=["POST"])
    for path in INFO_ROUTES:
        async def info(request: Request) -> Response:
            return await router(request).info(request)
        app.add_api_route(path, info, methods=["GET"])

    @app.get("/health")
    async def health(request: Request) -> Response:
        return router(request).health()

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> Response:
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> Response:
        return error_response(ApiError(e.status_code, str(e.detail)))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception) -> Response:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(ApiError(500, f"internal error: {type(e).__name__}: {e}"))
    return app


def parse_prefill(values: list[str]) -> tuple[str, int | None]:
    """`--prefill URL [BOOTSTRAP_PORT]` -> (url, port). As in sglang-router, `none` sends no port
    (each decode server then uses its own --disaggregation-bootstrap-port); the default is 8998."""
    if not 1 <= len(values) <= 2:
        raise ValueError(f"--prefill {' '.join(values)}: give URL [BOOTSTRAP_PORT]")
    if len(values) == 1:
        return values[0], DEFAULT_BOOTSTRAP_PORT
    if values[1].lower() == "none":
        return values[0], None
    if not values[1].isdigit() or not 0 < int(values[1]) <= 65535:
        raise ValueError(f"--prefill {values[0]} {values[1]}: the bootstrap port must be in [1, 65535] "
                         "or none")
    return values[0], int(values[1])


def run_router(prefill: list[list[str]], decode: list[str], host: str, port: int, health_interval: float,
               log_level: str = "info") -> int:
    """Serve the router until SIGINT/SIGTERM (bad flags: ValueError)."""
    pool = ServerPool([parse_prefill(v) for v in prefill], decode, health_interval)
    logging.getLogger("httpx").setLevel(logging.WARNING)      # not a line per upstream request
    log.info("sparkserve router on http://%s:%d: prefill %s, decode %s", host, port,
             ", ".join(s.url for s in pool.prefill), ", ".join(s.url for s in pool.decode))
    uvicorn.run(create_router_app(pool), host=host, port=port, log_level=log_level, access_log=False)
    return 0
