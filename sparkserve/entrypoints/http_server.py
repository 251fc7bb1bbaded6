"""`sparkserve serve`: the HTTP frontend process (FastAPI + uvicorn, tokenizer, no model) and the
scheduler process it spawns (model + scheduler), linked by ZMQ over ipc:// sockets.

Endpoints: OpenAI (`/v1/chat/completions`, `/v1/completions`, `/v1/models`), SGLang (`/generate`,
`/health`, `/health_generate`, `/server_info`, `/model_info` (also under `/get_...`), `/flush_cache`,
`/abort_request`) and `/metrics` (Prometheus). Every error is OpenAI-shaped JSON; a client that
disconnects aborts its request at once; SIGTERM aborts in-flight requests, stops the scheduler and
exits 0; a dead scheduler fails in-flight requests (500) and stops the server with exit code 1."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import secrets
import shutil
import signal
import socket
import tempfile
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

import anyio
import uvicorn
import zmq
import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import PlainTextResponse, Response, StreamingResponse

import sparkserve
from sparkserve.args import ServerArgs
from sparkserve.entrypoints.io_struct import SchedulerFailed, SchedulerReady
from sparkserve.entrypoints.metrics import CONTENT_TYPE, Metrics
from sparkserve.entrypoints.openai_protocol import (AbortRequest, ApiError, ChatCompletionRequest,
                                                    CompletionRequest, GenerateRequest)
from sparkserve.entrypoints.serving import SSE_DONE, Serving, StreamError, dumps, new_id, sse
from sparkserve.entrypoints.tokenizer_manager import (Overloaded, Seq, Submission, TokenizerManager,
                                                      Unavailable)
from sparkserve.frontend.tokenizer import has_tokenizer_files, load_tokenizer
from sparkserve.sampling_params import SamplingParams

log = logging.getLogger("sparkserve.server")

MAX_BODY_BYTES = 32 << 20
STARTUP_TIMEOUT_S = 600.0
HEALTH_GENERATE_TIMEOUT_S = 20.0
GRACEFUL_SHUTDOWN_S = 5.0
RETRY_AFTER_S = "1"


# ---- app ---------------------------------------------------------------------------------------
def create_app(args: ServerArgs, tm: TokenizerManager) -> FastAPI:
    app = FastAPI(title="sparkserve", version=sparkserve.__version__, openapi_url=None, docs_url=None,
                  redoc_url=None)
    names = {args.served_model_name, args.model_path, "default"}
    serving = Serving(tm, names, args.served_model_name)
    ready = tm.info

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> Response:
        return JSON(e.body(), e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> Response:
        err = (e.errors() or [{}])[0]
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        return _api_error_response(ApiError(400, f"{loc}: {err.get('msg', 'invalid')}", loc or None))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> Response:
        return _api_error_response(ApiError(e.status_code, str(e.detail)))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception) -> Response:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return _api_error_response(ApiError(500, f"internal error: {type(e).__name__}: {e}"))

    # ---- generation ---------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await _parse(request, ChatCompletionRequest)
        rid = req.rid or new_id("chatcmpl-")
        seqs = serving.chat_seqs(req, rid)
        return await _respond(request, tm, seqs, req.stream,
                              lambda sub: serving.chat_stream(req, rid, seqs, sub),
                              lambda sub: serving.chat_full(req, rid, seqs, sub))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await _parse(request, CompletionRequest)
        rid = req.rid or new_id("cmpl-")
        seqs = serving.completion_seqs(req, rid)
        return await _respond(request, tm, seqs, req.stream,
                              lambda sub: serving.completion_stream(req, rid, seqs, sub),
                              lambda sub: serving.completion_full(req, rid, seqs, sub))

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        req = await _parse(request, GenerateRequest)
        seqs, batch, with_text = serving.generate_seqs(req)
        return await _respond(request, tm, seqs, req.stream,
                              lambda sub: serving.generate_stream(seqs, sub, batch, with_text),
                              lambda sub: serving.generate_full(seqs, sub, batch, with_text))

    # ---- models and server facts ------------------------------------------------------------
    @app.get("/v1/models")
    async def models() -> Response:
        return JSON({"object": "list", "data": [_model_card(args, ready)]})

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        serving.check_model(model)
        return JSON(_model_card(args, ready))

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> Response:
        return JSON({"model_path": args.model_path, "tokenizer_path": args.tokenizer_path,
                             "is_generation": True, "served_model_name": args.served_model_name,
                             "architecture": ready.architecture, "context_length": ready.context_length,
                             "vocab_size": ready.vocab_size})

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> Response:
        load = await tm.get_load(timeout=2.0)
        info: dict[str, Any] = dataclasses.asdict(args)
        if info.get("api_key"):
            info["api_key"] = "<hidden>"
        info.update(model_path=args.model_path, tokenizer_path=args.tokenizer_path, tp_size=args.tp_size,
                    dp_size=args.dp_size, disaggregation_mode=args.disaggregation_mode,
                    version=sparkserve.__version__, max_total_num_tokens=ready.max_total_num_tokens,
                    context_length=ready.context_length, vocab_size=ready.vocab_size,
                    scheduler_pid=ready.pid)
        state = {k: v for k, v in dataclasses.asdict(load).items() if k != "cid"}
        info["internal_states"] = [{**state, "token_usage": load.token_usage, "inflight_sequences": tm.inflight}]
        return JSON(info)

    @app.get("/metrics")
    async def metrics() -> Response:
        await tm.get_load(timeout=1.0)
        return Response(tm.metrics.render(), media_type=CONTENT_TYPE)

    # ---- health and control -----------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if tm.healthy:
            return Response(status_code=200)
        return _api_error_response(ApiError(503, tm.dead or "server is shutting down"))

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        ids = [ready.bos_token_id if ready.bos_token_id is not None else 0]
        seqs = [Seq(f"health-{uuid.uuid4().hex}", ids, SamplingParams(max_new_tokens=1, temperature=0.0))]
        sub = _submit(tm, seqs)

        async def run() -> None:
            async for o in sub:
                if o.error_status is not None:
                    raise ApiError(o.error_status, o.finish_reason.get("message", "aborted"))
        try:
            await asyncio.wait_for(run(), HEALTH_GENERATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise ApiError(503, f"health generation took over {HEALTH_GENERATE_TIMEOUT_S:.0f}s") from None
        finally:
            sub.close()
        return Response(status_code=200)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        try:
            out = await tm.flush_cache()
        except Unavailable as e:
            raise ApiError(503, str(e)) from None
        except asyncio.TimeoutError:
            raise ApiError(503, "the scheduler did not answer in time") from None
        if not out.success:
            raise ApiError(400, f"cache not flushed: {out.message}")
        return PlainTextResponse("Cache flushed.\n")

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        req = await _parse(request, AbortRequest)
        if not req.abort_all and not req.rid:
            raise ApiError(400, "rid: give the rid to abort, or abort_all: true", "rid")
        n = tm.abort_all() if req.abort_all else tm.abort(req.rid)
        return JSON({"aborted": n})

    if args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=args.api_key)
    return app


def _api_error_response(e: ApiError) -> Response:
    return JSON(e.body(), e.status, headers=e.headers)


def _model_card(args: ServerArgs, ready: SchedulerReady) -> dict:
    return {"id": args.served_model_name, "object": "model", "created": int(time.time()),
            "owned_by": "sparkserve", "root": args.model_path, "max_model_len": ready.context_length}


async def _parse(request: Request, model):
    body = await request.body()
    if len(body) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is over {MAX_BODY_BYTES >> 20} MiB")
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise ApiError.from_validation(e) from None


def _submit(tm: TokenizerManager, seqs: list[Seq]) -> Submission:
    try:
        return tm.submit(seqs)
    except Overloaded as e:
        raise ApiError(503, str(e), headers={"Retry-After": RETRY_AFTER_S}) from None
    except Unavailable as e:
        raise ApiError(503, str(e)) from None
    except ValueError as e:
        raise ApiError.bad_request(e) from None


async def _respond(request: Request, tm: TokenizerManager, seqs: list[Seq], stream: bool,
                   stream_fn: Callable[[Submission], AsyncIterator[str]],
                   full_fn: Callable[[Submission], Awaitable[Any]]) -> Response:
    sub = _submit(tm, seqs)
    if stream:
        return EventStream(_sse_guard(stream_fn(sub)), on_close=sub.close)
    task = asyncio.ensure_future(full_fn(sub))
    gone = asyncio.ensure_future(_disconnected(request))
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


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body is read already, so receive() waits)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def _sse_guard(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
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


class JSON(Response):
    """JSON response rendered by serving.dumps (valid JSON whatever the content)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return dumps(content).encode("ascii")


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
                await _api_error_response(ApiError(401, msg))(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ---- processes ---------------------------------------------------------------------------------
class _Server(uvicorn.Server):
    """uvicorn without its own signal handling (which re-raises SIGTERM after shutdown, so the
    process would die of the signal instead of exiting 0): launch_server handles signals."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class _StartupFailed(Exception):
    pass


def launch_server(args: ServerArgs) -> int:
    """Run the server until SIGTERM/SIGINT (returns 0) or a scheduler failure (returns 1)."""
    try:
        return asyncio.run(_serve(args))
    except _StartupFailed as e:
        log.error("%s", e)
        print(f"sparkserve: error: {e}", flush=True)
        return 1


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise _StartupFailed(f"cannot listen on {host}:{port}: {e}") from None
    sock.set_inheritable(False)
    return sock


async def _serve(args: ServerArgs) -> int:
    sock = _bind(args.host, args.port)         # before the model loads: a busy port fails fast
    ipc_dir = tempfile.mkdtemp(prefix="sparkserve-")
    to_sched, from_sched = f"ipc://{ipc_dir}/in", f"ipc://{ipc_dir}/out"
    actx, sctx = zmq.asyncio.Context(), zmq.Context()
    recv = actx.socket(zmq.PULL)
    recv.bind(from_sched)
    send = sctx.socket(zmq.PUSH)
    send.setsockopt(zmq.SNDHWM, 0)
    send.bind(to_sched)
    from sparkserve.scheduler.process import run_scheduler_process
    proc = mp.get_context("spawn").Process(target=run_scheduler_process, name="sparkserve-scheduler",
                                           args=(args, to_sched, from_sched, os.getpid()), daemon=True)
    proc.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    state: dict[str, Any] = {"code": 0, "server": None, "tm": None}

    def on_signal(sig: int) -> None:
        log.info("received %s: shutting down", signal.Signals(sig).name)
        server, tm = state["server"], state["tm"]
        if server is not None and server.should_exit:
            server.force_exit = True               # second signal: stop waiting for connections
        if tm is not None:
            tm.begin_shutdown()
        if server is not None:
            server.should_exit = True
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    tm = None
    tokenizer_job = asyncio.ensure_future(asyncio.to_thread(_load_tokenizer, args))
    try:
        ready = await _wait_ready(recv, proc, stop)
        if ready is None:                           # signalled during start-up
            return 0
        try:
            tokenizer = await tokenizer_job
        except Exception as e:  # noqa: BLE001 - reported as a start-up error
            raise _StartupFailed(f"cannot load the tokenizer from {args.tokenizer_path}: "
                                 f"{type(e).__name__}: {e}") from None
        metrics = Metrics(args.served_model_name)
        tm = TokenizerManager(args, tokenizer, ready, send, recv, metrics, proc.is_alive, lambda: proc.exitcode)
        state["tm"] = tm
        app = create_app(args, tm)
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off",
                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, timeout_keep_alive=5)
        server = _Server(config)
        state["server"] = server

        def fatal() -> None:
            state["code"] = 1
            server.should_exit = True
        tm.on_fatal = fatal
        tm.start()
        log.info("sparkserve %s serving %s on http://%s:%d (pid %d, scheduler pid %d)", sparkserve.__version__,
                 args.served_model_name, args.host, args.port, os.getpid(), ready.pid)
        if stop.is_set():
            return 0
        await server.serve(sockets=[sock])
        return state["code"]
    finally:
        if not tokenizer_job.done():
            tokenizer_job.cancel()
        elif not tokenizer_job.cancelled() and tokenizer_job.exception() is not None and tm is None:
            log.debug("tokenizer load failed too: %s", tokenizer_job.exception())
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        if tm is not None:
            tm.stop_scheduler()
        else:
            with contextlib.suppress(zmq.ZMQError):
                from sparkserve.entrypoints.io_struct import ShutdownReq
                send.send_pyobj(ShutdownReq(), zmq.NOBLOCK)
        await asyncio.to_thread(_stop_process, proc)
        sock.close()
        recv.close(linger=0)
        send.close(linger=0)
        actx.term()
        sctx.term()
        shutil.rmtree(ipc_dir, ignore_errors=True)


def _load_tokenizer(args: ServerArgs):
    if args.skip_tokenizer_init or not has_tokenizer_files(args.tokenizer_path):
        return None
    return load_tokenizer(args.tokenizer_path)


async def _wait_ready(recv: zmq.asyncio.Socket, proc, stop: asyncio.Event) -> SchedulerReady | None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if stop.is_set():
            return None
        if await recv.poll(200):
            msg = await recv.recv_pyobj()
            if isinstance(msg, SchedulerReady):
                return msg
            if isinstance(msg, SchedulerFailed):
                raise _StartupFailed(f"the scheduler failed to start: {msg.message}")
            log.warning("unexpected message before ready: %r", type(msg).__name__)
        elif not proc.is_alive():
            raise _StartupFailed(f"the scheduler process exited during start-up (code {proc.exitcode})")
    raise _StartupFailed(f"the scheduler was not ready after {STARTUP_TIMEOUT_S:.0f}s")


def _stop_process(proc) -> None:
    proc.join(10)
    if proc.is_alive():
        log.warning("scheduler did not stop; terminating it")
        proc.terminate()
        proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join(5)
