"""What every route of one app shares: the engine, the served model, request parsing and submission.

A :class:`ServerContext` holds the AsyncEngine and the :class:`ModelInfo`
handed to the app, the server settings, the metrics, and the two helper threads
(tokenizing and chat templates; grammar compiling) that keep slow work off the
event loop. Route groups (:mod:`rtp.server.routes`) build on it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, TypeVar

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from rtp.config import ServerConfig
from rtp.outputs import RequestOutput
from rtp.runtime.input_processor import truncate_prompt
from rtp.runtime.model_info import ModelInfo
from rtp.sampling import SamplingParams
from rtp.server import streaming
from rtp.server.async_engine import RequestStream, ServingEngine
from rtp.server.chat_output import ChatOutput, ToolMode
from rtp.server.http_errors import ClientGone, lone_surrogate, param_of, runtime_error
from rtp.server.metrics import ServerMetrics
from rtp.server.protocol import (
    TEMPLATE_RESERVED,
    ApiError,
    ChatCompletionRequest,
    CommonRequest,
    NamedToolChoice,
    resolve_max_tokens,
    unsupported_hint,
)
from rtp.server.reasoning import THINK_END, think_state
from rtp.server.responses import ResponseBuilder
from rtp.structured import GrammarCompileError, GrammarCompiler, GrammarSpec, StructuredOutputsUnavailable

_T = TypeVar("_T")

DP_RANK_HEADER = "X-Data-Parallel-Rank"
"""Pins a request to one data-parallel replica (vLLM's spelling); the body field ``data_parallel_rank`` too."""
_GRAMMAR_TIMEOUT_S = 30.0  # a grammar that takes longer to compile is refused (400)


class Submitted(NamedTuple):
    """A queued request: its output stream, prompt ids, request id and the SamplingParams it runs with
    (the request's own settings, the checkpoint's defaults filling the rest)."""

    stream: RequestStream
    ids: list[int]
    request_id: str
    params: SamplingParams


class _Constraint:
    """A constraint factory that remembers its grammar's spec: an API frontend sends the spec to the
    engine process, which builds its own matchers from it."""

    def __init__(self, make: Callable[[], Any], spec: GrammarSpec) -> None:
        self.make, self.grammar_spec = make, spec

    def __call__(self) -> Any:  # noqa: ANN401 - a TokenConstraint
        return self.make()


class ServerContext:
    """The engine, the model and the request plumbing of one app."""

    def __init__(self, engine: ServingEngine, server: ServerConfig, info: ModelInfo) -> None:
        self.engine, self.server, self.info = engine, server, info
        self.model_name, self.tokenizer, self.max_model_len = info.name, info.tokenizer, info.max_model_len
        self.metrics = ServerMetrics(lambda: self.engine.stats, self.model_name, lambda: self.engine.replica_stats)
        self.created = int(time.time())
        # Tokenizing and chat templates take milliseconds per prompt (a second for a 1 MiB one): on
        # the event loop they would stall every stream, /health and the failure answers. One thread
        # keeps the tokenizer used by at most two threads at a time (this one and the engine's
        # detokenizer), since a fast tokenizer is not safe to share more freely.
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
            info = self.info
            self._grammar = GrammarCompiler(self.tokenizer, info.vocab_size, list(info.eos_token_ids))
        return _Constraint(self._grammar.constraint_factory(self._grammar.compile(spec), spec), spec)

    def after_thinking(self, spec: GrammarSpec | None, prompt: str) -> GrammarSpec | None:
        """A chat grammar under ``--reasoning-parser``: free output until the model's ``</think>``, the grammar
        after it (vLLM's rule; a thinking model answers after thinking). Not where the prompt's last turn
        closed the think block itself (``enable_thinking: false``): the grammar then applies from the start."""
        think_end = self._think_end_id
        if spec is None or self.server.reasoning_parser is None or think_end is None or think_state(prompt) == "closed":
            return spec
        return dataclasses.replace(spec, after=think_end)

    def chat_output(self, prompt: str, mode: ToolMode, tool_name: str | None, one_call: bool,
                    spec: GrammarSpec | None) -> ChatOutput:
        """How a chat or Responses request's output is split (reasoning, content, tool calls); ``spec`` as
        :meth:`after_thinking` returned it."""
        return ChatOutput(reasoning=self.server.reasoning_parser is not None, tool_mode=mode, tool_name=tool_name,
                          one_call=one_call, thinks_first=spec is not None and spec.after is not None,
                          opened=think_state(prompt) == "open")

    @functools.cached_property
    def _think_end_id(self) -> int | None:
        """The token id of ``</think>`` (one token in Qwen3's vocabulary), or None where it is no single token."""
        tid = self.tokenizer.convert_tokens_to_ids(THINK_END)
        return tid if isinstance(tid, int) and tid != self.tokenizer.unk_token_id else None

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
            raise ClientGone() from None
        try:
            data = json.loads(body)
        except (ValueError, RecursionError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}")
        at = lone_surrogate(bytes(body), data)
        if at is not None:
            raise ApiError(400, f"{param_of(at)}: a lone UTF-16 surrogate is not text (it has no UTF-8 form)",
                           param_of(at) or None)
        pin = request.headers.get(DP_RANK_HEADER)
        if pin is not None and "data_parallel_rank" in model.model_fields:
            if not pin.strip().isdigit():
                raise ApiError(400, f"the {DP_RANK_HEADER} header must be a replica index >= 0, got {pin!r}")
            data["data_parallel_rank"] = int(pin)
        try:
            return model.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            unsupported = unsupported_hint(model, tuple(err["loc"]))
            if unsupported is not None:  # a feature rtp does not implement: say what it supports instead
                name, hint = unsupported
                raise ApiError(400, f"{name}={data[name]!r} is not supported: only {hint}", name) from None
            param = param_of(err["loc"])
            raise ApiError(400, f"{param}: {err['msg']}" if param else err["msg"], param or None) from None

    def check_model(self, req: CommonRequest) -> None:
        if req.model is not None:
            self.check_model_name(req.model)

    def check_model_name(self, name: str) -> None:
        if name != self.model_name:
            raise ApiError(404, f"the model {name!r} does not exist: this server serves {self.model_name!r}",
                           "model", "model_not_found")

    async def submit(self, req: CommonRequest, prompt: str | list[int], logprobs: int | None, prefix: str,
                     prompt_param: str, constraint: Callable[[], Any] | None = None,
                     max_tokens_param: str | None = None) -> Submitted:
        """Tokenize (off the loop), build SamplingParams and queue the request. Errors about the requested
        max_tokens name ``max_tokens_param`` (default: the request's own field)."""
        try:
            ids = await self.off_loop(self.engine.tokenize, prompt)
            ids = truncate_prompt(ids, req.truncate_prompt_tokens, self.max_model_len,  # before max_tokens is fitted
                                  req.requested_max_tokens())
            req_param = max_tokens_param or (
                "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens")
            max_tokens = resolve_max_tokens(req.requested_max_tokens(), self.server, len(ids), self.max_model_len,
                                            req_param, prompt_param, self.info.sampling_defaults.get("max_tokens"))
            params = req.sampling_params(max_tokens, logprobs, self.info.sampling_defaults)
            if constraint is not None:
                params.constraint = constraint
            rid = f"{prefix}-{uuid.uuid4().hex}"
            stream = self.engine.add_request(ids, params, rid, getattr(req, "data_parallel_rank", None))
            return Submitted(stream, ids, rid, params)
        except Exception as e:  # noqa: BLE001 - mapped to an HTTP error
            raise runtime_error(e, prompt_param) from None

    async def echo_text(self, req: CommonRequest, prompt: str | list[int], ids: list[int]) -> str:
        """The prompt as completions' ``echo`` returns it: its own text, or its ids decoded (token ids, or the
        tokens ``truncate_prompt_tokens`` kept)."""
        if isinstance(prompt, str) and req.truncate_prompt_tokens is None:
            return prompt
        return await self.off_loop(self.tokenizer.decode, ids)

    def tool_mode(self, req: ChatCompletionRequest) -> tuple[ToolMode, str | None]:
        """How a chat request's output is parsed for tool calls, and the function it names (if any);
        400 for tool_choice "auto" on a server that cannot parse tool calls."""
        choice = req.effective_tool_choice()
        auto_ok = self.server.enable_auto_tool_choice and self.server.tool_call_parser is not None
        if choice == "auto" and req.tools and not auto_ok:
            raise ApiError(400, 'tool_choice "auto" (the default with tools) needs a server started with '
                                '--enable-auto-tool-choice and --tool-call-parser; or send tool_choice "none", '
                                '"required" or a named function', "tool_choice")
        if isinstance(choice, NamedToolChoice):
            return "named", choice.function.name
        return choice, None  # type: ignore[return-value]  # "none", "auto" or "required"

    async def render_chat(self, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                          kwargs: dict[str, Any] | None, add_generation_prompt: bool,
                          continue_final_message: bool = False) -> str:
        """The chat template applied (off the loop); 400 when it rejects the messages."""
        bad = sorted(set(kwargs or {}) & TEMPLATE_RESERVED)
        if bad:
            raise ApiError(400, f"chat_template_kwargs may not set {', '.join(bad)}: these are request fields or "
                                "tokenizer arguments", "chat_template_kwargs")
        try:
            return await self.off_loop(self.tokenizer.apply_chat_template, conversation, tools=tools,
                                       add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final_message, tokenize=False, **(kwargs or {}))
        except ApiError:
            raise
        except Exception as e:  # noqa: BLE001 - jinja errors: the template rejected these messages
            raise ApiError(400, f"the chat template rejected the messages: {e}", "messages") from None

    async def respond(self, request: Request, req: CommonRequest, stream: RequestStream, ids: list[int],
                      build: ResponseBuilder) -> Response:
        """The response to a submitted request: an event stream, or the final JSON body."""
        return await streaming.respond(self.metrics, request, req, stream, ids, build)

    async def collect(self, request: Request, stream: RequestStream, num_prompt_tokens: int) -> RequestOutput:
        """A submitted request's final output; the request is aborted if the client disconnects first."""
        return await streaming.collect(self.metrics, request, stream, num_prompt_tokens)

    def stream_events(self, stream: RequestStream, num_prompt_tokens: int, build: ResponseBuilder,
                      include_usage: bool) -> AsyncIterator[str]:
        """A submitted request's server-sent events, ``data: [DONE]`` last."""
        return streaming.stream_events(self.metrics, stream, num_prompt_tokens, build, include_usage)
