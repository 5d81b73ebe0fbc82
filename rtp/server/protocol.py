"""OpenAI request bodies (pydantic, strict types) and their mapping to SamplingParams.

These models are both the validation that runs and the request schema that
``/openapi.json`` publishes (see rtp.server.schemas): a bound or a type
changes in one place. Field names follow OpenAI's API; unknown fields are ignored as OpenAI does,
but a known field of the wrong type is an error (strict mode: "5" is not an
integer, true is not a number). Features rtp does not implement (best_of > 1,
suffix, the legacy ``functions``) are rejected with a 400 rather than silently
ignored, so a client never gets an answer to a question it did not ask; their
fields admit only the supported value (``best_of`` at most 1, ``suffix`` empty
...), so the published schema says so too, and :func:`unsupported_hint`
turns such an error into a message that says what rtp supports.
rtp extras (vLLM names): top_k, min_p, min_tokens, ignore_eos, stop_token_ids, include_stop_str_in_output,
skip_special_tokens, repetition_penalty, allowed_token_ids, truncate_prompt_tokens, prompt_logprobs (completions),
echo (chat: the assistant's last message), ``stream_options.continuous_usage_stats``;
structured outputs as ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar`` or the ``structured_outputs`` object (and OpenAI's ``response_format`` in chat);
``chat_template_kwargs``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
)
from pydantic_core import PydanticCustomError

from rtp.config import ServerConfig
from rtp.errors import RequestError
from rtp.sampling import SamplingParams
from rtp.server.tools import parameters_schema, required_schema
from rtp.structured import GrammarSpec


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
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)  # NaN and infinities: not numbers here


# Pieces of the request schema, shared by the fields below.
NonEmptyText = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
MAX_PROMPTS = 256  # prompts in one /v1/completions request (each one is a request in the engine)
# Text, token ids, or a batch of either (OpenAI's shape): one choice per prompt (n per prompt).
Prompt = (NonEmptyText | TokenIds | Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_PROMPTS)]
          | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)])


class StreamOptions(_Strict):
    """Options of a streamed response."""

    include_usage: bool = Field(default=False, description="send a last chunk with the usage and no choices")
    continuous_usage_stats: bool = Field(default=False, description="with include_usage: every chunk also carries "
                                                                     "the usage so far (vLLM's option)")


def _api_spec(make: Any, value: Any, field: str) -> GrammarSpec:  # noqa: ANN401
    """``make(value, field)``, a GrammarCompileError becoming a 400 naming the field."""
    try:
        return make(value, field)
    except RequestError as e:
        raise ApiError(400, str(e), field) from None


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs`` object: at most one of these constraints (any other key, vLLM's
    ``structural_tag`` or its backend options, is a 400: ignored, it would leave the output unconstrained)."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(default=None, alias="json", description="a JSON schema")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = Field(default=None, description="an EBNF grammar (xgrammar's dialect)")
    json_object: bool | None = Field(default=None, description="any JSON object")
    # vLLM's backend options that change nothing here (rtp's JSON is compact, and it has one backend): taken.
    disable_any_whitespace: bool | None = None
    disable_fallback: bool | None = None
    whitespace_pattern: str | None = None


def _one_error(field: str, code: str, message: str) -> Any:  # noqa: ANN401
    """A wrap validator of ``field`` that answers one error, ``message``, instead of one per member of its union."""

    def check(cls: type, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:  # noqa: ANN401
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError(code, message) from None

    return field_validator(field, mode="wrap")(classmethod(check))


class CommonRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int | None = Field(default=None, ge=1, le=128, description="choices to generate (one shared prefill)")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[NonEmptyText] | None = None  # "" means no stop string, as in SamplingParams
    include_stop_str_in_output: bool | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=1)] | Literal[-1] | None = Field(
        default=None, description="keep only the prompt's last k tokens (k < max_model_len); -1: fit the prompt to "
                                  "the context (its last max_model_len - max_tokens)")
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(
        default=None, description="token id (as a string) -> bias in [-100, 100] added to its logit (clamped)")
    user: str | None = None
    # rtp extras with vLLM's names.
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool | None = None
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)
    allowed_token_ids: list[TokenId] | None = Field(default=None, min_length=1)
    bad_words: list[NonEmptyText] | None = None
    data_parallel_rank: int | None = Field(
        default=None, ge=0, description="run on this data-parallel replica (header X-Data-Parallel-Rank too)")
    # Structured outputs, vLLM's spellings: at most one constraint per request.
    guided_json: dict[str, Any] | str | None = Field(default=None, description="a JSON schema the output follows")
    guided_regex: str | None = Field(default=None, description="a regular expression the output matches")
    guided_choice: list[str] | None = Field(default=None, min_length=1, description="the output is one of these")
    guided_grammar: str | None = Field(default=None, description="an EBNF grammar (xgrammar's dialect)")
    structured_outputs: StructuredOutputs | None = None

    _stop_strings = _one_error("stop", "stop_type", "must be a string or a list of non-empty strings")
    _truncate = _one_error("truncate_prompt_tokens", "truncate_type",
                           "must be a positive integer or -1 (the model's context)")

    def check_supported(self) -> None:
        """Raise ApiError(400) for what the field types cannot say (combinations of fields)."""
        self.grammar_spec()

    def grammar_spec(self) -> GrammarSpec | None:
        """The request's output constraint, if any; ApiError(400) when it names more than one."""
        found: list[GrammarSpec] = []
        so = self.structured_outputs
        sources = [("guided_", self.guided_json, self.guided_regex, self.guided_choice, self.guided_grammar, False)]
        if so is not None:
            sources.append(("structured_outputs.", so.json_, so.regex, so.choice, so.grammar, bool(so.json_object)))
        for prefix, json_v, regex, choice, grammar, json_object in sources:
            if json_object:
                found.append(GrammarSpec("json_object", "", prefix + "json_object"))
            if json_v is not None:
                found.append(_api_spec(GrammarSpec.json_schema, json_v, prefix + "json"))
            if regex is not None:
                found.append(GrammarSpec("regex", regex, prefix + "regex"))
            if choice is not None:
                found.append(_api_spec(GrammarSpec.choice, choice, prefix + "choice"))
            if grammar is not None:
                found.append(GrammarSpec("grammar", grammar, prefix + "grammar"))
        rf = getattr(self, "response_format", None)  # chat only
        if rf is not None and rf.type == "json_object":
            found.append(GrammarSpec("json_object", "", "response_format"))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise ApiError(400, 'response_format of type "json_schema" needs a json_schema object',
                               "response_format.json_schema")
            schema = rf.json_schema.schema_ if rf.json_schema.schema_ is not None else {"type": "object"}
            found.append(_api_spec(GrammarSpec.json_schema, schema, "response_format.json_schema.schema"))
        if len(found) > 1:
            raise ApiError(400, f"give one output constraint, not {len(found)}: "
                                f"{', '.join(f.field for f in found)}", found[1].field)
        return found[0] if found else None

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        defaults: dict[str, Any] | None = None) -> SamplingParams:
        """SamplingParams for this request; ``max_tokens`` was already resolved by the server; ``defaults``
        (the checkpoint's recommended settings) fill the fields the request leaves unset."""
        kwargs: dict[str, Any] = {**(defaults or {}), "max_tokens": max_tokens, "logprobs": logprobs}
        for name in ("temperature", "top_p", "seed", "stop", "top_k", "min_p", "min_tokens", "ignore_eos",
                     "stop_token_ids", "skip_special_tokens", "n", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "allowed_token_ids", "bad_words", "prompt_logprobs",
                     "include_stop_str_in_output", "truncate_prompt_tokens"):
            value = getattr(self, name, None)
            if value is not None:
                kwargs[name] = value
        if self.logit_bias:
            bias: dict[int, float] = {}
            for key, value in self.logit_bias.items():
                if not key.strip().isdigit():
                    raise ApiError(400, f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
                bias[int(key)] = value
            kwargs["logit_bias"] = bias
        if getattr(self, "echo", None) and logprobs is not None:
            # echo + logprobs: the prompt's logprobs too, from the same forward pass.
            kwargs["prompt_logprobs"] = max(logprobs, kwargs.get("prompt_logprobs") or 0)
        return SamplingParams(**kwargs)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options is not None and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every chunk carries the usage so far (``stream_options.continuous_usage_stats`` with include_usage)."""
        return self.include_usage and self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(CommonRequest):
    """Body of POST /v1/completions: one prompt (text or token ids) or a list of prompts."""

    prompt: Prompt = Field(description="text, token ids, or a list of prompts (texts or token-id lists): "
                                       "choice i * n + j is sample j of prompt i")
    max_tokens: int | None = Field(default=None, ge=0, description="0 with echo: the prompt alone (with logprobs: "
                                                                   "scored), nothing generated")
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool | None = Field(default=None, description="return the prompt before the completion (with logprobs: "
                                                          "the prompt tokens' logprobs too)")
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    best_of: int | None = _unsupported("1", ge=1, le=1)
    suffix: str | None = _unsupported('"" (or leave it out)', max_length=0)

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _one_prompt(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:  # noqa: ANN401
        """One error that says what a prompt may be, instead of one per member of the union."""
        try:
            return handler(value)
        except ValidationError:
            if isinstance(value, list) and len(value) > MAX_PROMPTS and all(isinstance(x, (str, list)) for x in value):
                raise PydanticCustomError("prompt_batch", "got {n} prompts: at most {limit} per request",
                                          {"n": len(value), "limit": MAX_PROMPTS}) from None
            raise PydanticCustomError(
                "prompt_type", "must be a non-empty string, a non-empty list of non-negative token ids, "
                "or a list of these (one per prompt)") from None

    @property
    def prompt_only(self) -> bool:
        """echo with max_tokens 0 (vLLM's, OpenAI's legacy scoring): each choice is the prompt alone, with its
        logprobs where asked; the engine makes one token, which the response leaves out."""
        return bool(self.echo) and self.max_tokens == 0

    def check_supported(self) -> None:
        super().check_supported()
        if self.max_tokens == 0 and not self.echo:
            raise ApiError(400, "max_tokens=0 generates nothing: it is only allowed with echo (the prompt alone)",
                           "max_tokens")
        if self.prompt_only and self.min_tokens:
            raise ApiError(400, "min_tokens asks for generated tokens, which max_tokens=0 with echo leaves out",
                           "min_tokens")

    def requested_max_tokens(self) -> int | None:
        return 1 if self.prompt_only else self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        """Every prompt, as text or token ids (one for a single prompt)."""
        p = self.prompt
        if isinstance(p, list) and isinstance(p[0], (str, list)):
            return list(p)
        return [p]

    def prompt_value(self) -> str | list[int]:
        """The first (for a single-prompt request: the) prompt, as text or token ids."""
        return self.prompts()[0]


class ContentPart(_Strict):
    """One part of a message's content; only text parts are supported (see :func:`content_text`)."""

    type: str
    text: str | None = None


def content_text(content: str | list[ContentPart] | None, kinds: tuple[str, ...], where: str) -> str:
    """A message's content as text: its text parts (of the types ``kinds``) joined; ApiError(400) at
    ``where``.j.type for a part of another type (an image, a file), at ``where``.j.text for one without text."""
    if content is None or isinstance(content, str):
        return content or ""
    for j, part in enumerate(content):
        if part.type not in kinds:
            raise ApiError(400, f"content part of type {part.type!r} is not supported: only text parts "
                                f"({', '.join(kinds)})", f"{where}.{j}.type")
        if part.text is None:
            raise ApiError(400, f'a content part of type "{part.type}" needs its "text"', f"{where}.{j}.text")
    return "".join(part.text or "" for part in content)


class FunctionCall(_Strict):
    """The function an assistant message called: its name and its arguments as JSON text."""

    name: str
    arguments: str | dict[str, Any] = Field(
        description="JSON text (an object is taken too, as vLLM does, and written as JSON text)")

    @field_validator("arguments", mode="before")
    @classmethod
    def _object_as_text(cls, value: Any) -> Any:  # noqa: ANN401
        return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else value


class ToolCallParam(_Strict):
    """One tool call of an earlier assistant message."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    """One message of a conversation (a ``tool`` message answers the call ``tool_call_id``)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # vLLM's newer name for reasoning_content

    def text(self, index: int) -> str:
        return content_text(self.content, ("text",), f"messages.{index}.content")


class JsonSchemaFormat(_Strict):
    """The schema of ``response_format: {"type": "json_schema"}``."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    name: str = Field(default="response", description="a name for the schema")
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema", description="the JSON schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """``text`` (no constraint), ``json_object`` (any JSON object) or ``json_schema`` (JSON following a schema)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDef(_Strict):
    """A function the model may call."""

    name: NonEmptyText
    description: str | None = None
    parameters: dict[str, Any] | None = Field(default=None, description="JSON schema of the arguments")
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: NonEmptyText


class NamedToolChoice(_Strict):
    """``{"type": "function", "function": {"name": ...}}``: the model must call this function."""

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(CommonRequest):
    """Body of POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None, description='"auto" (the default with tools), "none", "required" or a named function')
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = _unsupported("[] (use tools)", max_length=0)
    response_format: ResponseFormat | None = None
    chat_template: str | None = _unsupported("the model's own template (leave it out)", max_length=0)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20, description="the prompt tokens' logprobs, in the "
                                        "response's top-level prompt_logprobs (vLLM's; not with stream)")
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description='extra chat template variables, e.g. {"enable_thinking": false}')
    echo: bool = Field(default=False, description="when the last message is the assistant's, the reply's content "
                                                  "starts with it (with continue_final_message: the whole turn)")
    add_generation_prompt: bool = Field(default=True, description="open the assistant's turn after the messages")
    continue_final_message: bool = Field(
        default=False, description="continue the last message, an assistant's, instead of closing it (with "
                                   "add_generation_prompt false)")

    @field_validator("tool_choice", mode="wrap")
    @classmethod
    def _one_tool_choice(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:  # noqa: ANN401
        """A named choice's own error (e.g. its missing function), not the first member of the union's."""
        try:
            return handler(value)
        except ValidationError:
            if not isinstance(value, dict):
                raise PydanticCustomError("tool_choice_type", 'must be "none", "auto", "required" or '
                                          '{"type": "function", "function": {"name": ...}}') from None
            try:
                NamedToolChoice.model_validate(value)
            except ValidationError as e:
                err = e.errors()[0]
                where = ".".join(str(x) for x in err["loc"])
                raise PydanticCustomError("named_tool_choice", 'a named tool_choice is {"type": "function", '
                                          '"function": {"name": ...}}: {where}: {msg}',
                                          {"where": where, "msg": err["msg"]}) from None
            raise

    def check_supported(self) -> None:
        super().check_supported()
        if self.stream and self.prompt_logprobs:
            raise ApiError(400, "prompt_logprobs are not available with stream: true (as vLLM's)", "prompt_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise ApiError(400, "continue_final_message continues the last message: send add_generation_prompt "
                                "false with it", "continue_final_message")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ApiError(400, f"continue_final_message continues the last message, which is a "
                                f"{self.messages[-1].role!r} one: it must be the assistant's", "continue_final_message")
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            raise ApiError(400, f"tool_choice={_choice_name(choice)} needs tools", "tool_choice")
        if isinstance(choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if choice.function.name not in names:
                raise ApiError(400, f"tool_choice names the function {choice.function.name!r}, which is not "
                                    f"among the tools ({', '.join(names)})", "tool_choice.function.name")
        if choice not in (None, "none", "auto") and self.grammar_spec() is not None:
            raise ApiError(400, f"tool_choice={_choice_name(choice)} constrains the output itself: drop the "
                                "other output constraint", "tool_choice")

    def effective_tool_choice(self) -> str | NamedToolChoice:
        """The tool choice in force: "auto" with tools and no tool_choice (OpenAI's default), "none" without tools."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def tool_grammar(self) -> GrammarSpec | None:
        """The grammar forcing a "required" or named tool choice (vLLM's way: a JSON schema)."""
        choice, tools = self.tool_choice, [t.model_dump(exclude_none=True) for t in self.tools or []]
        if choice == "required":
            try:
                schema = required_schema(tools, parallel=self.parallel_tool_calls is not False)
            except ValueError as e:
                raise ApiError(400, str(e), "tools") from None
            return _api_spec(GrammarSpec.json_schema, schema, "tools")
        if isinstance(choice, NamedToolChoice):
            fn = next(t["function"] for t in tools if t["function"]["name"] == choice.function.name)
            return _api_spec(GrammarSpec.json_schema, parameters_schema(fn), "tools")
        return None

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as chat-template input (OpenAI's shape)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is the newer name; it wins when both are given.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict[str, Any]]:
        return conversation(self.messages)


def conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat-template input ("developer" is OpenAI's newer name for "system")."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text(i)}
        if m.tool_calls is not None:
            msg["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        for key, value in (("tool_call_id", m.tool_call_id), ("name", m.name),
                           ("reasoning_content", m.reasoning if m.reasoning is not None else m.reasoning_content)):
            if value is not None:
                msg[key] = value
        out.append(msg)
    return out


def _choice_name(choice: Any) -> str:  # noqa: ANN401
    return repr(choice.function.name) if isinstance(choice, NamedToolChoice) else repr(choice)


# apply_chat_template's own arguments: chat_template_kwargs may not override them.
TEMPLATE_RESERVED = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                               "add_generation_prompt", "continue_final_message", "padding", "truncation",
                               "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                               "tokenizer_kwargs"})


class TokenizeRequest(_Strict):
    """Body of POST /tokenize (vLLM's shape): either ``prompt`` or chat ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = Field(default=None, description="default true for prompt, false for messages")
    add_generation_prompt: bool | None = Field(default=None, description="messages only; default true")
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(_Strict):
    """Body of POST /detokenize (vLLM's shape)."""

    model: str | None = None
    tokens: list[TokenId]


def resolve_max_tokens(requested: int | None, server: ServerConfig, num_prompt_tokens: int,
                       max_model_len: int, param: str = "max_tokens", prompt_param: str = "prompt",
                       default: int | None = None) -> int:
    """max_tokens of a request: the requested value (bounded by the server limit) or the default
    (``default``, the checkpoint's max_new_tokens held to the server limit, else the server's
    default_max_tokens).

    The default shrinks to fit the context, so a long prompt without max_tokens
    still gets an answer; an explicit value that does not fit is a 400, as
    is a prompt that fills the whole context.
    """
    if num_prompt_tokens >= max_model_len:
        raise ApiError(400, f"the prompt has {num_prompt_tokens} tokens but the context holds {max_model_len}: "
                            f"at most {max_model_len - 1} prompt tokens are allowed", prompt_param,
                       "context_length_exceeded")
    if requested is None:
        default = min(default, server.max_tokens_limit) if default else server.default_max_tokens
        return min(default, max_model_len - num_prompt_tokens)
    if requested > server.max_tokens_limit:
        raise ApiError(400, f"{param}={requested} is too large: this server allows at most "
                            f"{server.max_tokens_limit}", param)
    if num_prompt_tokens + requested > max_model_len:
        raise ApiError(400, f"prompt ({num_prompt_tokens} tokens) + {param} ({requested}) exceeds the context "
                            f"of {max_model_len} tokens: lower {param} or shorten the prompt", param,
                       "context_length_exceeded")
    return requested
