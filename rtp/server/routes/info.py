"""The routes about the served model and the server: /v1/models, vLLM's /tokenize, /detokenize and
/version, /health (also /ping) and /metrics."""

from __future__ import annotations

from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from rtp.server.context import ServerContext
from rtp.server.http_errors import guard
from rtp.server.protocol import ApiError, DetokenizeRequest, TokenizeRequest, conversation
from rtp.server.routes.docs import RouteDocs
from rtp.server.schemas import (
    DetokenizeResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    VersionResponse,
    error_responses,
)


class InfoRoutes:
    """Model listing, tokenizer access, version, health and metrics of one app."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    def register(self, app: FastAPI) -> RouteDocs:
        """Add the routes to ``app``; returns their request bodies for /openapi.json."""
        auth = [Depends(self.ctx.auth)]
        app.add_api_route("/v1/models", guard(self.models), methods=["GET"], dependencies=auth, summary="List models",
                          response_model=None,
                          responses={200: {"model": ModelList}, **error_responses(401, 500)})
        app.add_api_route("/v1/models/{model_id:path}", guard(self.model), methods=["GET"], dependencies=auth,
                          response_model=None, summary="Describe a model",
                          responses={200: {"model": ModelCard}, **error_responses(401, 404, 500)})
        app.add_api_route("/metrics", guard(self.prometheus), methods=["GET"], dependencies=auth,
                          summary="Prometheus metrics", response_class=Response,
                          responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                                           "description": "Prometheus text format"}, **error_responses(401, 500)})
        app.add_api_route("/tokenize", guard(self.tokenize), methods=["POST"], dependencies=auth,
                          summary="Tokenize a prompt or chat messages (vLLM's shape)", response_model=None,
                          responses={200: {"model": TokenizeResponse}, **error_responses(400, 401, 404, 413, 500)})
        app.add_api_route("/detokenize", guard(self.detokenize), methods=["POST"], dependencies=auth,
                          summary="Token ids to text (vLLM's shape)", response_model=None,
                          responses={200: {"model": DetokenizeResponse}, **error_responses(400, 401, 404, 413, 500)})
        app.add_api_route("/version", guard(self.version), methods=["GET"], dependencies=auth,
                          summary="The rtp version", response_model=None,
                          responses={200: {"model": VersionResponse}, **error_responses(401, 500)})
        app.add_api_route("/health", self.health, methods=["GET"], summary="Liveness of the engine",
                          responses={200: {"model": HealthResponse},
                                     503: {"model": HealthResponse, "description": "the engine is not serving"}})
        # vLLM's other name for /health (load balancers probe it), left out of the schema as an alias.
        app.add_api_route("/ping", self.health, methods=["GET", "POST"], include_in_schema=False)
        return RouteDocs({"/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest})

    async def models(self) -> dict[str, Any]:
        """GET /v1/models: the one served model."""
        return {"object": "list", "data": [self.model_card()]}

    async def model(self, model_id: str) -> dict[str, Any]:
        """GET /v1/models/{model_id}."""
        self.ctx.check_model_name(model_id)
        return self.model_card()

    def model_card(self) -> dict[str, Any]:
        ctx = self.ctx
        return {"id": ctx.model_name, "object": "model", "created": ctx.created, "owned_by": "rtp",
                "root": ctx.model_name, "parent": None, "max_model_len": ctx.max_model_len}

    async def tokenize(self, request: Request) -> dict[str, Any]:
        """vLLM's /tokenize: a prompt, or chat messages through the chat template, to token ids."""
        ctx = self.ctx
        req: TokenizeRequest = await ctx.read_body(request, TokenizeRequest)
        if req.model is not None:
            ctx.check_model_name(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "give either prompt or messages", "prompt")
        if req.messages is not None:
            add_special = bool(req.add_special_tokens)  # vLLM's default for messages: false
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            text = await ctx.render_chat(conversation(req.messages), tools, req.chat_template_kwargs,
                                         req.add_generation_prompt is not False)
        else:
            add_special = req.add_special_tokens is not False
            text = req.prompt or ""
        ids = await ctx.off_loop(ctx.tokenizer.encode, text, add_special_tokens=add_special)
        strs = await ctx.off_loop(ctx.tokenizer.convert_ids_to_tokens, ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids, "token_strs": strs}

    async def detokenize(self, request: Request) -> dict[str, Any]:
        """vLLM's /detokenize: token ids to text."""
        ctx = self.ctx
        req: DetokenizeRequest = await ctx.read_body(request, DetokenizeRequest)
        if req.model is not None:
            ctx.check_model_name(req.model)
        # The model's vocabulary bounds the ids, as for prompts; its padding rows past the tokenizer have no text.
        vocab, size = ctx.info.vocab_size, len(ctx.tokenizer)
        bad = [t for t in req.tokens if t >= vocab]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is out of range: the model's vocabulary has {vocab} tokens",
                           "tokens")
        return {"prompt": await ctx.off_loop(ctx.tokenizer.decode, [t for t in req.tokens if t < size])}

    async def version(self) -> dict[str, Any]:
        """GET /version."""
        return {"version": _rtp_version()}

    async def health(self) -> Response:
        """GET /health: 200 while the engine serves, else 503 with the reason."""
        engine = self.ctx.engine
        if engine.running:
            return JSONResponse({"status": "ok"})
        reason = engine.failure or "not serving (starting or shutting down)"
        return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)

    async def prometheus(self) -> Response:
        """GET /metrics in the Prometheus text format."""
        body, content_type = self.ctx.metrics.render()
        return Response(body, media_type=content_type)


def _rtp_version() -> str:
    try:
        from importlib.metadata import version

        return version("rtp")
    except Exception:  # noqa: BLE001 - not installed as a package (a plain checkout)
        return "unknown"
