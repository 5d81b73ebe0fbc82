"""OpenAI request bodies (pydantic, strict types) and their mapping to SamplingParams.

These models are both the validation that runs and the request schema that
``/openapi.json`` publishes (see rtp.server.schemas): a bound or a type
changes in one place. Field names follow OpenAI's API; unknown fields are ignored as OpenAI does,
but a known field of the wrong type is an error (strict mode: "5" is not an
integer, true is not a number). Features rtp does not implement (n > 1,
non-zero presence/frequency penalties, logit_bias, best_of > 1, echo, suffix,
tools, JSON response formats) are rejected with a 400 rather than silently
ignored, so a client never gets an answer to a question it did not ask; their
fields admit only the supported value (``n`` at most 1, ``tools`` at most 0
items...), so the published schema says so too, and :func:`unsupported_hint`
turns such an error into a message that says what rtp supports.
rtp extras (vLLM names): top_k, min_p, min_tokens, ignore_eos, stop_token_ids,
skip_special_tokens.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
)
from pydantic_core import PydanticCustomError

from rtp.config import ServerConfig
from rtp.sampling import SamplingParams


class ApiError(Exception):
    """An error response in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error") -> None:  # noqa: A002 - OpenAI's field name
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _unsupported(hint: str, **bounds: Any) -> Any:  # noqa: ANN401 - a pydantic FieldInfo
    """A field of a feature rtp does not implement: ``bounds`` admit only the supported value."""
    return Field(default=None, description=f"not supported beyond: {hint}",
                 json_schema_extra={"x-rtp-unsupported": hint}, **bounds)


def unsupported_hint(model: type[BaseModel], loc: tuple[Any, ...]) -> tuple[str, str] | None:
    """(field, hint) when a validation error at ``loc`` is on an unsupported feature's field of ``model``."""
    if not loc or not isinstance(loc[0], str) or loc[0] not in model.model_fields:
        return None
    extra = model.model_fields[loc[0]].json_schema_extra
    hint = extra.get("x-rtp-unsupported") if isinstance(extra, dict) else None
    return (loc[0], str(hint)) if hint else None


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


def _require_bool(value: Any) -> Any:  # noqa: ANN401
    """Strict booleans for Literal[False]: a Literal compares by ==, and 0 == False in Python."""
    if value is not None and not isinstance(value, bool):
        raise PydanticCustomError("bool_type", "Input should be a valid boolean")
    return value


# Pieces of the request schema, shared by the fields below.
NonEmptyText = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
# A single prompt: text, token ids, or a "batch" holding exactly one of them (OpenAI's shape).
Prompt = (NonEmptyText | TokenIds | Annotated[list[NonEmptyText], Field(min_length=1, max_length=1)]
          | Annotated[list[TokenIds], Field(min_length=1, max_length=1)])


class StreamOptions(_Strict):
    """Options of a streamed response."""

    include_usage: bool = Field(default=False, description="send a last chunk with the usage and no choices")


class CommonRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int | None = _unsupported("n=1 (rtp returns exactly one choice)", ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[NonEmptyText] | None = None  # "" means no stop string, as in SamplingParams
    seed: int | None = None
    presence_penalty: float | None = _unsupported("0 (or leave it out)", ge=0.0, le=0.0)
    frequency_penalty: float | None = _unsupported("0 (or leave it out)", ge=0.0, le=0.0)
    logit_bias: dict[str, float] | None = _unsupported("{} (or leave it out)", max_length=0)
    user: str | None = None
    # rtp extras with vLLM's names.
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool | None = None

    def check_supported(self) -> None:
        """Raise ApiError(400) for what the field types cannot say (combinations of fields)."""

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """SamplingParams for this request; ``max_tokens`` was already resolved by the server."""
        kwargs: dict[str, Any] = {"max_tokens": max_tokens, "logprobs": logprobs}
        for name in ("temperature", "top_p", "seed", "stop", "top_k", "min_p", "min_tokens", "ignore_eos",
                     "stop_token_ids", "skip_special_tokens"):
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        return SamplingParams(**kwargs)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options is not None and self.stream_options.include_usage)


class CompletionRequest(CommonRequest):
    """Body of POST /v1/completions (one prompt: text, token ids, or a list holding one of them)."""

    prompt: Prompt = Field(description="one prompt: text, token ids, or a list holding exactly one of them")
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: Annotated[Literal[False] | None, BeforeValidator(_require_bool)] = _unsupported("false (or leave it out)")
    best_of: int | None = _unsupported("1", ge=1, le=1)
    suffix: str | None = _unsupported('"" (or leave it out)', max_length=0)

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _one_prompt(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:  # noqa: ANN401
        """One error that says what a prompt may be, instead of one per member of the union."""
        try:
            return handler(value)
        except ValidationError:
            if isinstance(value, list) and len(value) > 1 and all(isinstance(x, (str, list)) for x in value):
                raise PydanticCustomError("prompt_batch", "got {n} prompts: rtp serves one prompt per request",
                                          {"n": len(value)}) from None
            raise PydanticCustomError(
                "prompt_type", "must be a non-empty string or a non-empty list of non-negative token ids "
                "(or a list holding exactly one of these)") from None

    def prompt_value(self) -> str | list[int]:
        """The single prompt as text or token ids."""
        p = self.prompt
        if isinstance(p, list) and isinstance(p[0], (str, list)):
            return p[0]  # a batch of one
        return p


class ContentPart(_Strict):
    """One part of a message's content; only ``{"type": "text", "text": ...}`` is supported."""

    type: str
    text: str | None = None


class ChatMessage(_Strict):
    """One message of a conversation."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self, index: int) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for j, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                raise ApiError(400, f"content part of type {part.type!r} is not supported: only text parts",
                               f"messages.{index}.content.{j}.type")
            parts.append(part.text)
        return "".join(parts)


class ResponseFormat(_Strict):
    """``{"type": "text"}``: structured output formats are not supported."""

    type: Literal["text"]


class ChatCompletionRequest(CommonRequest):
    """Body of POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Any] | None = _unsupported("[] (tool calling is not supported)", max_length=0)
    functions: list[Any] | None = _unsupported("[] (tool calling is not supported)", max_length=0)
    response_format: ResponseFormat | None = _unsupported('{"type": "text"}')

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")

    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is the newer name; it wins when both are given.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict[str, str]]:
        """Messages as chat-template input ("developer" is OpenAI's newer name for "system")."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text(i)}
                for i, m in enumerate(self.messages)]


def resolve_max_tokens(requested: int | None, server: ServerConfig, num_prompt_tokens: int,
                       max_model_len: int, param: str = "max_tokens", prompt_param: str = "prompt") -> int:
    """max_tokens of a request: the requested value (bounded by the server limit) or the default.

    The default shrinks to fit the context, so a long prompt without max_tokens
    still gets an answer; an explicit value that does not fit is a 400, as
    is a prompt that fills the whole context.
    """
    if num_prompt_tokens >= max_model_len:
        raise ApiError(400, f"the prompt has {num_prompt_tokens} tokens but the context holds {max_model_len}: "
                            f"at most {max_model_len - 1} prompt tokens are allowed", prompt_param,
                       "context_length_exceeded")
    if requested is None:
        return min(server.default_max_tokens, max_model_len - num_prompt_tokens)
    if requested > server.max_tokens_limit:
        raise ApiError(400, f"{param}={requested} is too large: this server allows at most "
                            f"{server.max_tokens_limit}", param)
    if num_prompt_tokens + requested > max_model_len:
        raise ApiError(400, f"prompt ({num_prompt_tokens} tokens) + {param} ({requested}) exceeds the context "
                            f"of {max_model_len} tokens: lower {param} or shorten the prompt", param,
                       "context_length_exceeded")
    return requested
