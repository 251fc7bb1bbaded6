"""The HTTP app of `sparkserve serve` (FastAPI): OpenAI routes, SGLang routes and operations,
OpenAI-shaped errors for every failure, the API-key check. It holds no model: the TokenizerManager
talks to the scheduler process that entrypoints/launch.py starts."""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

import sparkserve
from sparkserve.args import ServerArgs
from sparkserve.embedded import DEFAULT_ALIAS
from sparkserve.entrypoints import routes_openai, routes_sglang
from sparkserve.entrypoints.http_io import ApiKeyMiddleware, ServerContext, error_response
from sparkserve.entrypoints.openai_protocol import ApiError
from sparkserve.entrypoints.serving_generate import ServingGenerate
from sparkserve.entrypoints.serving_openai import ServingChat, ServingCompletion
from sparkserve.entrypoints.tokenizer_manager import TokenizerManager

log = logging.getLogger("sparkserve.server")


def create_app(args: ServerArgs, tm: TokenizerManager, tokenizer_path: str | None = None) -> FastAPI:
    app = FastAPI(title="sparkserve", version=sparkserve.__version__, openapi_url=None, docs_url=None,
                  redoc_url=None)
    names = {args.served_model_name, args.model_path, DEFAULT_ALIAS}
    serve = (tm, names, args.served_model_name)
    app.state.ctx = ServerContext(args, tm, ServingChat(*serve), ServingCompletion(*serve),
                                  ServingGenerate(*serve),
                                  tokenizer_path)
    app.include_router(routes_openai.router)
    app.include_router(routes_sglang.router)
    _add_error_handlers(app)
    if args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=args.api_key)
    if args.allowed_origins:     # added last: outermost, so a preflight never needs the API key
        app.add_middleware(CORSMiddleware, allow_origins=args.allowed_origins, allow_methods=["*"],
                           allow_headers=["*"])
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> Response:
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> Response:
        err = (e.errors() or [{}])[0]
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        return error_response(ApiError(400, f"{loc}: {err.get('msg', 'invalid')}", loc or None))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> Response:
        return error_response(ApiError(e.status_code, str(e.detail)))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception) -> Response:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(ApiError(500, f"internal error: {type(e).__name__}: {e}"))
