"""The server's published contract: response models and the request bodies in ``/openapi.json``.

The handlers read and validate the request body themselves (the body-size
limit is enforced while reading, and every validation error becomes an
OpenAI-style 400), so FastAPI cannot see the body models in their
signatures. :func:`install_openapi` publishes the very models the handlers
validate with (rtp.server.protocol) as each route's ``requestBody``, so the
schema and the validation are one source of truth. The response models here
document what rtp.server.responses builds; the API tests check real
responses against them.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import models_json_schema

_REF = "#/components/schemas/{model}"


class _Doc(BaseModel):
    """A documented response body (never used for validation inside the server)."""

    model_config = ConfigDict(extra="allow")


# ---- errors ----


class ErrorDetail(_Doc):
    """What went wrong, in OpenAI's shape."""

    message: str = Field(description="what was wrong and what is allowed")
    type: str = Field(description='"invalid_request_error" for 4xx, "server_error" for 5xx')
    param: str | None = Field(description="the request field at fault (dotted path), if any")
    code: str | None = Field(description='a machine-readable code, e.g. "context_length_exceeded", if any')


class ErrorResponse(_Doc):
    """Body of every error response."""

    error: ErrorDetail


# ---- usage and logprobs ----


class PromptTokensDetails(_Doc):
    cached_tokens: int = Field(ge=0, description="prompt tokens served from the prefix cache")


class Usage(_Doc):
    """Token counts of one request; completion tokens include the EOS or stop token."""

    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(_Doc):
    """Logprobs of the generated tokens of a completion (legacy OpenAI shape)."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class TopLogprob(_Doc):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(_Doc):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Doc):
    content: list[ChatTokenLogprob]


FinishReason = Literal["stop", "length", "abort", "tool_calls"]


# ---- completions ----


STOP_REASON = ("with finish_reason \"stop\": the stop string or stop token id (a generation config's EOS id too) "
               "that ended the choice; null for the tokenizer's EOS token (and until the last chunk of a stream)")


class PromptLogprob(_Doc):
    logprob: float
    rank: int | None = Field(description="1 for the likeliest token; a prompt token outside the top ones: the number "
                                         "of tokens at least as likely as it")
    decoded_token: str


class CompletionChoice(_Doc):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None = Field(description="null in every stream chunk but the last")
    stop_reason: int | str | None = Field(default=None, description=STOP_REASON)
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(
        default=None, description="with the prompt_logprobs parameter (in a stream, in the choice's first chunk): "
                                  "per prompt token null for the first, else token id -> its logprob")


class CompletionResponse(_Doc):
    """A /v1/completions response; with ``stream: true`` each server-sent event is one of these
    (``choices`` empty and ``usage`` set in the usage chunk), and the stream ends with ``data: [DONE]``."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# ---- chat ----


class FunctionCallOut(_Doc):
    name: str
    arguments: str = Field(description="the arguments as JSON text")


class ToolCallOut(_Doc):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class AssistantMessage(_Doc):
    role: Literal["assistant"]
    content: str | None = Field(description="null only beside tool_calls")
    reasoning: str | None = Field(default=None, description="the think block (with --reasoning-parser), as vLLM's")
    reasoning_content: str | None = Field(default=None, description="the same, under its earlier name")
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(_Doc):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None = Field(default=None, description=STOP_REASON)


class ChatCompletionResponse(_Doc):
    """A non-streamed /v1/chat/completions response."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(_Doc):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Doc):
    """Part of a tool call: deltas with the same index concatenate (the first has id, type and name)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class ChatDelta(_Doc):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Doc):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None = Field(default=None, description=STOP_REASON)


class ChatCompletionChunk(_Doc):
    """One server-sent event of a streamed chat completion; the stream ends with ``data: [DONE]``."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# ---- tokenizer routes (vLLM's shapes) ----


class TokenizeResponse(_Doc):
    count: int = Field(ge=0)
    max_model_len: int = Field(ge=1)
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(_Doc):
    prompt: str


class VersionResponse(_Doc):
    version: str


# ---- models and health ----


class ModelCard(_Doc):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str = Field(description="the model this card serves (vLLM's field; rtp serves one model, under its name)")
    parent: None = Field(default=None, description="always null: no fine-tuned variants are served")
    max_model_len: int = Field(ge=1, description="context length in tokens, prompt and output together")


class ModelList(_Doc):
    object: Literal["list"]
    data: list[ModelCard]


class HealthResponse(_Doc):
    """``ok`` (200) while the engine serves; ``unavailable`` (503) with the reason otherwise."""

    status: Literal["ok", "unavailable"]
    reason: str | None = None


# ---- publishing ----

_ERRORS: dict[int, str] = {
    400: "invalid request: malformed JSON, a field of the wrong type or out of bounds, an unsupported feature, "
         "or a prompt that does not fit the context",
    401: "missing or invalid API key (only when the server has one)",
    404: "unknown model",
    413: "request body larger than server.max_request_bytes",
    500: "internal error (details in the server log)",
    503: "the engine failed or the server is shutting down",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The ``responses=`` entries documenting these error statuses with ErrorResponse."""
    return {s: {"model": ErrorResponse, "description": _ERRORS[s]} for s in statuses}


def sse_response(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` adding the text/event-stream form of a 200 (``stream: true``).

    The schema describes one event (OpenAPI 3.1 style): its ``data`` is
    ``[DONE]`` (the last event) or JSON holding a ``model`` chunk or an
    ErrorResponse (an error after the stream started).
    """
    chunk = {"anyOf": [{"$ref": _REF.format(model=model.__name__)}, {"$ref": _REF.format(model="ErrorResponse")}]}
    event = {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"anyOf": [
            {"const": "[DONE]"},
            {"type": "string", "contentMediaType": "application/json", "contentSchema": chunk},
        ]}},
        "description": f"one server-sent event: `data: <{model.__name__} as JSON>`, `data: {{\"error\": ...}}` "
                       "for an error after the stream started, and a last `data: [DONE]`",
    }
    return {"responses": {"200": {"content": {"text/event-stream": {"schema": event}}}}}


def install_openapi(app: FastAPI, request_bodies: dict[str, type[BaseModel]],
                    stream_chunks: tuple[type[BaseModel], ...] = ()) -> None:
    """Publish ``request_bodies`` (path -> model of its POST body) in the app's ``/openapi.json``.

    ``stream_chunks`` are the models :func:`sse_response` refers to that no
    route names as a JSON response, added to the components.

    FastAPI's default 422 responses are dropped too: validation errors are
    400s in OpenAI's shape here.
    """

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        models = list(dict.fromkeys(request_bodies.values()))
        refs, defs = models_json_schema([(m, "validation") for m in models]
                                        + [(m, "serialization") for m in stream_chunks], ref_template=_REF)
        components.update(defs.get("$defs", {}))
        for path, model in request_bodies.items():
            operation = schema["paths"][path]["post"]
            operation["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": refs[(model, "validation")]}}}
        for item in schema["paths"].values():
            for operation in item.values():
                operation.get("responses", {}).pop("422", None)
        components.pop("HTTPValidationError", None)
        components.pop("ValidationError", None)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
