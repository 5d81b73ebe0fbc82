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
import functools
import hmac
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from rtp.config import RtpConfig
from rtp.errors import RequestError, RtpError
from rtp.log import get_logger
from rtp.outputs import RequestOutput
from rtp.server.async_engine import AsyncEngine, EngineDeadError, RequestStream, ServerShuttingDownError
from rtp.server.chat_output import ChatOutput, ToolMode
from rtp.server.metrics import ServerMetrics
from rtp.server.prompt_batch import batch_completions
from rtp.server.protocol import (
    TEMPLATE_RESERVED,
    ApiError,
    ChatCompletionRequest,
    CommonRequest,
    CompletionRequest,
    DetokenizeRequest,
    NamedToolChoice,
    TokenizeRequest,
    conversation,
    resolve_max_tokens,
    unsupported_hint,
)
from rtp.server.responses import ResponseBuilder
from rtp.server.responses_api import route as responses_route
from rtp.server.responses_protocol import ResponsesRequest
from rtp.server.responses_schemas import STREAM_EVENTS as RESPONSES_STREAM_EVENTS
from rtp.server.responses_schemas import ResponseObject, responses_sse
from rtp.server.schemas import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    VersionResponse,
    error_responses,
    install_openapi,
    sse_response,
)
from rtp.structured import GrammarCompileError, GrammarCompiler, GrammarSpec, StructuredOutputsUnavailable

logger = get_logger(__name__)

_T = TypeVar("_T")

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_GRAMMAR_TIMEOUT_S = 30.0  # a grammar that takes longer to compile is refused (400)
# pydantic names union members in error locations ("prompt", "str"); they are no field names.
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*|dict\[.*|literal\[.*|function-.*|.*\[.*\].*)$")


class _ClientGone(Exception):
    """The client disconnected before its response was ready."""


class _EventStream(StreamingResponse):
    """A StreamingResponse that closes its request stream however the response ends.

    The event generator's own ``finally`` does not run if the response is
    cancelled before the generator was first entered (a client that leaves
    right away); this catches that case too.
    """

    def __init__(self, events: AsyncIterator[str], stream: RequestStream) -> None:
        super().__init__(events, media_type="text/event-stream", headers=_SSE_HEADERS)
        self.request_stream = stream

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.request_stream.close()


def _param_of(loc: tuple[Any, ...]) -> str:
    return ".".join(str(x) for x in loc if not (isinstance(x, str) and _TYPE_TAG.match(x)))


def _runtime_error(e: Exception, prompt_param: str) -> ApiError:
    """The HTTP error for an exception raised while submitting or running a request."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, RequestError):
        m = re.match(r"SamplingParams\.(\w+)=", str(e))
        return ApiError(400, str(e), m.group(1) if m else prompt_param)
    if isinstance(e, (EngineDeadError, ServerShuttingDownError)):
        return ApiError(503, str(e), type="server_error", code="service_unavailable")
    if isinstance(e, RtpError):
        return ApiError(500, str(e), type="server_error")
    logger.error("request failed", exc_info=e)
    return ApiError(500, "internal server error (see the server log)", type="server_error")


def _sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


class _Tracker:
    """Per-request metrics bookkeeping: token counts, inter-token gaps, the final outcome."""

    def __init__(self, metrics: ServerMetrics, num_prompt_tokens: int) -> None:
        self.metrics, self.num_prompt_tokens = metrics, num_prompt_tokens
        self.seen = 0  # generated tokens already accounted for
        self.last_time: float | None = None
        self.last: RequestOutput | None = None

    def update(self, out: RequestOutput) -> None:
        total = out.num_completion_tokens  # every choice's tokens (n > 1)
        n, now = total - self.seen, time.monotonic()
        if self.last_time is None:
            self.metrics.observe_first_tokens(n)
        else:
            self.metrics.observe_tokens(n, now - self.last_time)
        if n > 0:
            self.last_time = now
        self.seen, self.last = total, out

    def done(self) -> None:
        reason = self.last.finish_reason if self.last is not None and self.last.finished else "abort"
        self.metrics.observe_finished(self.last, self.num_prompt_tokens, reason or "abort")


class _Api:
    """The endpoints of one app, bound to one AsyncEngine."""

    def __init__(self, engine: AsyncEngine, config: RtpConfig, model_name: str) -> None:
        self.engine, self.server, self.model_name = engine, config.server, model_name
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = int(engine.engine.max_model_len)
        self.metrics = ServerMetrics(lambda: self.engine.stats, model_name)
        self.created = int(time.time())
        # Tokenizing and chat templates take milliseconds per prompt (a second for a 1 MiB one): on
        # the event loop they would stall every stream, /health and the failure answers. One thread
        # keeps the tokenizer used by at most two threads at a time (this one and the engine's
        # detokenizer), as before, since a fast tokenizer is not safe to share more freely.
        self._tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rtp-tokenize")
        # Grammars compile on a thread of their own (tens of ms for a JSON schema, more for a big one),
        # so neither the event loop nor the tokenizer waits; the compiler is built on first use.
        self._grammar_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rtp-grammar")
        self._grammar: GrammarCompiler | None = None

    def close(self) -> None:
        """Stop the tokenizing and grammar threads (the app's lifespan ends)."""
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: GrammarSpec) -> Callable[[], Any]:
        """The constraint factory of ``spec`` (on the grammar thread)."""
        if self._grammar is None:
            inner = self.engine.engine
            runner_spec = getattr(getattr(inner, "runner", None), "spec", None)
            vocab = getattr(runner_spec, "vocab_size", None) or len(self.tokenizer)
            eos = list(getattr(inner, "eos_token_ids", None) or [self.tokenizer.eos_token_id])
            self._grammar = GrammarCompiler(self.tokenizer, vocab, eos)
        return self._grammar.constraint_factory(self._grammar.compile(spec), spec.kind)

    async def constraint(self, spec: GrammarSpec | None) -> Callable[[], Any] | None:
        """SamplingParams.constraint for ``spec`` (compiled off the loop, cached); 400 naming the field on failure."""
        if spec is None:
            return None
        future = asyncio.get_running_loop().run_in_executor(self._grammar_pool, self._compile, spec)
        try:
            return await asyncio.wait_for(future, _GRAMMAR_TIMEOUT_S)
        except GrammarCompileError as e:
            raise ApiError(400, str(e), e.field) from None
        except StructuredOutputsUnavailable as e:
            raise ApiError(400, str(e), spec.field) from None
        except asyncio.TimeoutError:
            raise ApiError(400, f"{spec.field}: the grammar took more than {_GRAMMAR_TIMEOUT_S:.0f} s to compile",
                           spec.field) from None

    async def off_loop(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:  # noqa: ANN401
        """Run ``fn(*args, **kwargs)`` on the tokenizing thread, so the event loop keeps serving."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool,
                                                                functools.partial(fn, *args, **kwargs))

    # ---- request plumbing ----

    async def auth(self, request: Request) -> None:
        """FastAPI dependency: require "Authorization: Bearer <key>" when an API key is configured."""
        key = self.server.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise ApiError(401, "missing or invalid API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    async def read_body(self, request: Request, model: type[BaseModel]) -> Any:
        """Parse the JSON body into ``model``; 413 past max_request_bytes, 400 for anything malformed."""
        limit = self.server.max_request_bytes
        too_large = ApiError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            raise too_large if length.isdigit() else ApiError(400, "invalid Content-Length header")
        body = bytearray()
        try:
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise too_large
        except ClientDisconnect:
            raise _ClientGone() from None
        try:
            data = json.loads(body)
        except (ValueError, RecursionError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}")
        try:
            return model.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            unsupported = unsupported_hint(model, tuple(err["loc"]))
            if unsupported is not None:  # a feature rtp does not implement: say what it supports instead
                name, hint = unsupported
                raise ApiError(400, f"{name}={data[name]!r} is not supported: only {hint}", name) from None
            param = _param_of(err["loc"])
            raise ApiError(400, f"{param}: {err['msg']}" if param else err["msg"], param or None) from None

    def check_model(self, req: CommonRequest) -> None:
        if req.model is not None:
            self.check_model_name(req.model)

    def check_model_name(self, name: str) -> None:
        if name != self.model_name:
            raise ApiError(404, f"the model {name!r} does not exist: this server serves {self.model_name!r}",
                           "model", "model_not_found")

    async def submit(self, req: CommonRequest, prompt: str | list[int], logprobs: int | None, prefix: str,
                     prompt_param: str, constraint: Callable[[], Any] | None = None
                     ) -> tuple[RequestStream, list[int], str]:
        """Tokenize (off the loop), build SamplingParams and queue the request: (stream, prompt ids, request id)."""
        try:
            ids = await self.off_loop(self.engine.engine.tokenize, prompt)
            req_param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
            max_tokens = resolve_max_tokens(req.requested_max_tokens(), self.server, len(ids), self.max_model_len,
                                            req_param, prompt_param)
            params = req.sampling_params(max_tokens, logprobs)
            if constraint is not None:
                params.constraint = constraint
            rid = f"{prefix}-{uuid.uuid4().hex}"
            return self.engine.add_request(ids, params, rid), ids, rid
        except Exception as e:  # noqa: BLE001 - mapped to an HTTP error
            raise _runtime_error(e, prompt_param) from None

    async def collect(self, request: Request, stream: RequestStream, num_prompt_tokens: int) -> RequestOutput:
        """Wait for the final output; abort the request if the client disconnects first."""
        tracker = _Tracker(self.metrics, num_prompt_tokens)

        async def consume() -> RequestOutput:
            async for out in stream:
                tracker.update(out)
            assert tracker.last is not None and tracker.last.finished, "a stream ends with its final output"
            return tracker.last

        async def disconnected() -> None:
            # After the body was read, receive() returns only when the client goes away.
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work, watch = asyncio.ensure_future(consume()), asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                raise _ClientGone()
            return work.result()
        finally:
            for task in (work, watch):
                task.cancel()
            stream.close()
            tracker.done()

    async def stream_events(self, stream: RequestStream, num_prompt_tokens: int, build: ResponseBuilder,
                            include_usage: bool) -> AsyncIterator[str]:
        """SSE events of one request; closing the generator (a disconnect) aborts the request."""
        tracker = _Tracker(self.metrics, num_prompt_tokens)
        try:
            first = build.first_chunk()
            if first is not None:
                yield _sse(first)
            choices: list[ResponseBuilder] = []  # n > 1: one builder per choice
            sent: list[int] = []  # n > 1: tokens of each choice already sent
            async for out in stream:
                start = tracker.seen
                tracker.update(out)
                if out.samples is None:
                    chunk = build.chunk(out, start)
                    if chunk is not None:
                        yield _sse(chunk)
                    continue
                if not choices:
                    choices = [build] + [build.for_choice(c.index) for c in out.samples[1:]]
                    sent = [0] * len(out.samples)
                    for b in choices[1:]:
                        if (first := b.first_chunk()) is not None:
                            yield _sse(first)
                for i, c in enumerate(out.samples):
                    if sent[i] < 0 or (not c.new_token_ids and not c.finished):
                        continue  # finished and reported already, or unchanged in this step
                    chunk = choices[i].chunk(c, sent[i], out)
                    sent[i] = -1 if c.finished else len(c.token_ids)
                    if chunk is not None:
                        yield _sse(chunk)
            if include_usage and tracker.last is not None:
                yield _sse(build.usage_chunk(tracker.last))
        except Exception as e:  # noqa: BLE001 - the status line is gone: report in-band
            yield _sse(_runtime_error(e, "prompt").body())
        finally:
            stream.close()
            tracker.done()
        yield _sse("[DONE]")

    # ---- endpoints ----

    async def completions(self, request: Request) -> Response:
        req: CompletionRequest = await self.read_body(request, CompletionRequest)
        self.check_model(req)
        req.check_supported()
        if len(req.prompts()) > 1:
            return await batch_completions(self, request, req)
        constraint = await self.constraint(req.grammar_spec())
        stream, ids, rid = await self.submit(req, req.prompt_value(), req.logprobs, "cmpl", "prompt", constraint)
        build = ResponseBuilder("text_completion", rid, self.model_name, self.tokenizer, len(ids), req.logprobs)
        if req.echo:
            prompt = req.prompt_value()
            build.echo = prompt if isinstance(prompt, str) else await self.off_loop(self.tokenizer.decode, prompt)
        return await self.respond(request, req, stream, ids, build)

    async def chat_completions(self, request: Request) -> Response:
        req: ChatCompletionRequest = await self.read_body(request, ChatCompletionRequest)
        self.check_model(req)
        req.check_supported()
        choice = req.effective_tool_choice()
        auto_ok = self.server.enable_auto_tool_choice and self.server.tool_call_parser is not None
        if choice == "auto" and req.tools and not auto_ok:
            raise ApiError(400, 'tool_choice "auto" (the default with tools) needs a server started with '
                                '--enable-auto-tool-choice and --tool-call-parser; or send tool_choice "none", '
                                '"required" or a named function', "tool_choice")
        mode: ToolMode = "named" if isinstance(choice, NamedToolChoice) else choice  # type: ignore[assignment]
        text = await self.render_chat(req.conversation(), req.tool_dicts(), req.chat_template_kwargs, True)
        constraint = await self.constraint(req.tool_grammar() or req.grammar_spec())
        stream, ids, rid = await self.submit(req, text, req.num_logprobs(), "chatcmpl", "messages", constraint)
        output = None
        if self.server.reasoning_parser is not None or mode != "none":
            output = ChatOutput(reasoning=self.server.reasoning_parser is not None, tool_mode=mode,
                                tool_name=choice.function.name if isinstance(choice, NamedToolChoice) else None)
        build = ResponseBuilder("chat.completion", rid, self.model_name, self.tokenizer, len(ids),
                                req.num_logprobs(), output)
        return await self.respond(request, req, stream, ids, build)

    async def render_chat(self, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                          kwargs: dict[str, Any] | None, add_generation_prompt: bool) -> str:
        """The chat template applied (off the loop); 400 when it rejects the messages."""
        bad = sorted(set(kwargs or {}) & TEMPLATE_RESERVED)
        if bad:
            raise ApiError(400, f"chat_template_kwargs may not set {', '.join(bad)}: these are request fields or "
                                "tokenizer arguments", "chat_template_kwargs")
        try:
            return await self.off_loop(self.tokenizer.apply_chat_template, conversation, tools=tools,
                                       add_generation_prompt=add_generation_prompt, tokenize=False, **(kwargs or {}))
        except ApiError:
            raise
        except Exception as e:  # noqa: BLE001 - jinja errors: the template rejected these messages
            raise ApiError(400, f"the chat template rejected the messages: {e}", "messages") from None

    async def respond(self, request: Request, req: CommonRequest, stream: RequestStream, ids: list[int],
                      build: ResponseBuilder) -> Response:
        if req.stream:
            return _EventStream(self.stream_events(stream, len(ids), build, req.include_usage), stream)
        try:
            out = await self.collect(request, stream, len(ids))
        except _ClientGone:
            raise
        except Exception as e:  # noqa: BLE001
            raise _runtime_error(e, "prompt") from None
        return JSONResponse(build.full_response(out))

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_card()]}

    async def model(self, model_id: str) -> dict[str, Any]:
        self.check_model_name(model_id)
        return self.model_card()

    def model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "rtp",
                "max_model_len": self.max_model_len}

    async def tokenize(self, request: Request) -> dict[str, Any]:
        """vLLM's /tokenize: a prompt, or chat messages through the chat template, to token ids."""
        req: TokenizeRequest = await self.read_body(request, TokenizeRequest)
        if req.model is not None:
            self.check_model_name(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "give either prompt or messages", "prompt")
        if req.messages is not None:
            add_special = bool(req.add_special_tokens)  # vLLM's default for messages: false
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            text = await self.render_chat(conversation(req.messages), tools, req.chat_template_kwargs,
                                          req.add_generation_prompt is not False)
        else:
            add_special = req.add_special_tokens is not False
            text = req.prompt or ""
        ids = await self.off_loop(self.tokenizer.encode, text, add_special_tokens=add_special)
        strs = await self.off_loop(self.tokenizer.convert_ids_to_tokens, ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}

    async def detokenize(self, request: Request) -> dict[str, Any]:
        """vLLM's /detokenize: token ids to text."""
        req: DetokenizeRequest = await self.read_body(request, DetokenizeRequest)
        if req.model is not None:
            self.check_model_name(req.model)
        size = len(self.tokenizer)
        bad = [t for t in req.tokens if t >= size]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is out of range: the tokenizer has {size} tokens", "tokens")
        return {"prompt": await self.off_loop(self.tokenizer.decode, req.tokens)}

    async def version(self) -> dict[str, Any]:
        return {"version": _rtp_version()}

    async def health(self) -> Response:
        if self.engine.running:
            return JSONResponse({"status": "ok"})
        reason = self.engine.failure or "not serving (starting or shutting down)"
        return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)

    async def prometheus(self) -> Response:
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)


def _rtp_version() -> str:
    try:
        from importlib.metadata import version

        return version("rtp")
    except Exception:  # noqa: BLE001 - not installed as a package (a plain checkout)
        return "unknown"


def _guard(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Turn an unexpected exception into ApiError(500) here, so its traceback is logged once."""

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return await fn(*args, **kwargs)
        except (ApiError, _ClientGone):
            raise
        except Exception as e:  # noqa: BLE001
            logger.error("unexpected error in %s", fn.__name__, exc_info=e)
            raise ApiError(500, "internal server error (see the server log)", type="server_error") from None

    return wrapper


def build_app(async_engine: AsyncEngine, config: RtpConfig, model_name: str) -> FastAPI:
    """The FastAPI app serving ``async_engine``; its lifespan starts and stops the engine thread."""
    api = _Api(async_engine, config, model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(async_engine.stop)
            api.close()

    app = FastAPI(title="rtp", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.api = api
    auth = [Depends(api.auth)]
    # Documentation only: the handlers return Response objects (or plain dicts for the model routes),
    # so FastAPI does not re-validate them; tests check real bodies against these models.
    generation_errors = error_responses(400, 401, 404, 413, 500, 503)
    app.add_api_route("/v1/completions", _guard(api.completions), methods=["POST"], dependencies=auth,
                      summary="Create a completion",
                      responses={200: {"model": CompletionResponse}, **generation_errors},
                      openapi_extra=sse_response(CompletionResponse))
    app.add_api_route("/v1/chat/completions", _guard(api.chat_completions), methods=["POST"], dependencies=auth,
                      summary="Create a chat completion",
                      responses={200: {"model": ChatCompletionResponse}, **generation_errors},
                      openapi_extra=sse_response(ChatCompletionChunk))
    app.add_api_route("/v1/responses", _guard(responses_route(api)), methods=["POST"],
                      dependencies=auth, summary="Create a response (OpenAI's Responses API)",
                      responses={200: {"model": ResponseObject}, **generation_errors}, openapi_extra=responses_sse())
    app.add_api_route("/v1/models", _guard(api.models), methods=["GET"], dependencies=auth, summary="List models",
                      response_model=None,
                      responses={200: {"model": ModelList}, **error_responses(401, 500)})
    app.add_api_route("/v1/models/{model_id:path}", _guard(api.model), methods=["GET"], dependencies=auth,
                      response_model=None, summary="Describe a model",
                      responses={200: {"model": ModelCard}, **error_responses(401, 404, 500)})
    app.add_api_route("/metrics", _guard(api.prometheus), methods=["GET"], dependencies=auth,
                      summary="Prometheus metrics", response_class=Response,
                      responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                                       "description": "Prometheus text format"}, **error_responses(401, 500)})
    app.add_api_route("/tokenize", _guard(api.tokenize), methods=["POST"], dependencies=auth,
                      summary="Tokenize a prompt or chat messages (vLLM's shape)", response_model=None,
                      responses={200: {"model": TokenizeResponse}, **error_responses(400, 401, 404, 413, 500)})
    app.add_api_route("/detokenize", _guard(api.detokenize), methods=["POST"], dependencies=auth,
                      summary="Token ids to text (vLLM's shape)", response_model=None,
                      responses={200: {"model": DetokenizeResponse}, **error_responses(400, 401, 404, 413, 500)})
    app.add_api_route("/version", _guard(api.version), methods=["GET"], dependencies=auth,
                      summary="The rtp version", response_model=None,
                      responses={200: {"model": VersionResponse}, **error_responses(401, 500)})
    app.add_api_route("/health", api.health, methods=["GET"], summary="Liveness of the engine",
                      responses={200: {"model": HealthResponse}, 503: {"model": HealthResponse,
                                                                        "description": "the engine is not serving"}})
    install_openapi(app, {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
                          "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest,
                          "/v1/responses": ResponsesRequest},
                    stream_chunks=(ChatCompletionChunk, *RESPONSES_STREAM_EVENTS))

    def error_response(e: ApiError) -> JSONResponse:
        api.metrics.observe_error(e.status)
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, e: ApiError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(_ClientGone)
    async def on_client_gone(request: Request, e: _ClientGone) -> Response:
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
        return error_response(ApiError(400, str(err["msg"]), _param_of(tuple(err["loc"])) or None))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, e: Exception) -> JSONResponse:
        logger.error("unhandled error", exc_info=e)
        return error_response(ApiError(500, "internal server error (see the server log)", type="server_error"))

    return app
