"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics,
and vLLM's /tokenize, /detokenize and /version.

``/openapi.json`` documents every route: the request bodies are the
validating models of rtp.server.protocol, the responses and errors those of
rtp.server.schemas.

Every error reaches the client as OpenAI's error body
``{"error": {"message", "type", "param", "code"}}``: 400 for bad input, 401
for a missing or wrong API key, 404 for an unknown model or route, 413 for a
body over ``server.max_request_bytes``, 503 once the runtime failed or while
it shuts down, and a generic 500 (the traceback goes to the log only).
Streams use server-sent events in OpenAI's chunk format and end with
``data: [DONE]``; an error after the stream started arrives as one
``data: {"error": ...}`` event before ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from rtp.config import RtpConfig
from rtp.log import get_logger
from rtp.runtime.model_info import ModelInfo
from rtp.server.async_engine import ServingEngine
from rtp.server.context import ServerContext
from rtp.server.http_errors import ClientGone, param_of
from rtp.server.protocol import ApiError
from rtp.server.routes import ROUTE_GROUPS
from rtp.server.schemas import install_openapi

logger = get_logger(__name__)


def build_app(async_engine: ServingEngine, config: RtpConfig, info: ModelInfo) -> FastAPI:
    """The FastAPI app serving ``async_engine`` for the model ``info``; its lifespan starts and stops the
    engine thread."""
    ctx = ServerContext(async_engine, config.server, info)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(async_engine.stop)
            ctx.close()

    app = FastAPI(title="rtp", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.context = ctx  # what the routes share (tests adjust its settings)
    # Documentation only: the handlers return Response objects (or plain dicts for the model routes),
    # so FastAPI does not re-validate them; tests check real bodies against these models.
    request_bodies: dict[str, type[BaseModel]] = {}
    stream_chunks: list[type[BaseModel]] = []
    for group in ROUTE_GROUPS:
        docs = group(ctx).register(app)
        request_bodies.update(docs.request_bodies)
        stream_chunks.extend(docs.stream_chunks)
    install_openapi(app, request_bodies, stream_chunks=tuple(stream_chunks))
    _install_error_handlers(app, ctx)
    return app


def _install_error_handlers(app: FastAPI, ctx: ServerContext) -> None:
    """Every error as OpenAI's error body, counted in the metrics."""

    def error_response(e: ApiError) -> JSONResponse:
        ctx.metrics.observe_error(e.status)
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, e: ApiError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(ClientGone)
    async def on_client_gone(request: Request, e: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message, headers = str(e.detail), dict(e.headers or {})
        if e.status_code == 404:
            message = f"there is no route {request.url.path!r}: /openapi.json lists the routes"
        elif e.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path!r}: use {headers.get('Allow')}"
        response = error_response(ApiError(e.status_code, message))
        response.headers.update(headers)  # e.g. the Allow header of a 405 (RFC 9110)
        return response

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        return error_response(ApiError(400, str(err["msg"]), param_of(tuple(err["loc"])) or None))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, e: Exception) -> JSONResponse:
        logger.error("unhandled error", exc_info=e)
        return error_response(ApiError(500, "internal server error (see the server log)", type="server_error"))
