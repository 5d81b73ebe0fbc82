"""OpenAI request bodies (pydantic, strict types) and their mapping to SamplingParams.

Field names follow OpenAI's API; unknown fields are ignored as OpenAI does,
but a known field of the wrong type is an error (strict mode: "5" is not an
integer, true is not a number). Features rtp does not implement (n > 1,
non-zero presence/frequency penalties, logit_bias, best_of > 1, echo, suffix,
tools, JSON response formats) are rejected with a 400 rather than silently
ignored, so a client never gets an answer to a question it did not ask.
rtp extras (vLLM names): top_k, min_p, min_tokens, ignore_eos, stop_token_ids,
skip_special_tokens.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

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


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class CommonRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int | None = Field(default=None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # rtp extras with vLLM's names.
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None

    def check_supported(self) -> None:
        """Raise ApiError(400) for OpenAI features rtp does not implement."""
        if self.n not in (None, 1):
            raise ApiError(400, f"n={self.n} is not supported: rtp returns exactly one choice (n=1)", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ApiError(400, f"{name} is not supported: use 0 or leave it out", name)
        if self.logit_bias:
            raise ApiError(400, "logit_bias is not supported: leave it out or send {}", "logit_bias")

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

    prompt: Any = None  # checked by prompt_value(): pydantic's union errors would be confusing here
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool | None = None
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise ApiError(400, "echo is not supported: leave it out or set it to false", "echo")
        if self.best_of not in (None, 1):
            raise ApiError(400, f"best_of={self.best_of} is not supported: only 1", "best_of")
        if self.suffix:
            raise ApiError(400, "suffix is not supported", "suffix")

    def prompt_value(self) -> str | list[int]:
        """The single prompt as text or token ids."""
        p = self.prompt
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # a batch of one
        if isinstance(p, str):
            if not p:
                raise ApiError(400, "prompt is empty: give at least one character", "prompt")
            return p
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return p
        if isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
            raise ApiError(400, f"got {len(p)} prompts: rtp serves one prompt per request", "prompt")
        raise ApiError(400, "prompt must be a non-empty string or a non-empty list of token ids", "prompt")


class ContentPart(_Strict):
    type: str
    text: str | None = None


class ChatMessage(_Strict):
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
    type: str


class ChatCompletionRequest(CommonRequest):
    """Body of POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    response_format: ResponseFormat | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools or self.functions:
            name = "tools" if self.tools else "functions"
            raise ApiError(400, "tool calling is not supported: leave out tools and functions", name)
        if self.response_format is not None and self.response_format.type != "text":
            raise ApiError(400, f"response_format type {self.response_format.type!r} is not supported: only "
                                "'text'", "response_format")
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
