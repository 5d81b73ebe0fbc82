"""The request body of POST /v1/responses (OpenAI's Responses API) and its mapping onto a chat request.

What rtp accepts: ``input`` as text or a list of items — messages (``role`` user, system,
developer or assistant; ``content`` text or ``input_text`` / ``output_text`` parts), earlier
``function_call`` items and their ``function_call_output`` answers, and earlier ``reasoning``
items (dropped: the chat template of Qwen3 does not replay old thinking); ``instructions``
(a system message before the input); ``max_output_tokens``, ``temperature``, ``top_p``; function
``tools`` and ``tool_choice``; ``text.format`` (text, json_object, json_schema); plus vLLM's
extras ``seed``, ``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
``chat_template_kwargs``; ``top_logprobs`` with ``include: ["message.output_text.logprobs"]`` (the
logprobs of every generated token go with the message's ``output_text``, as vLLM's; the other
``include`` values OpenAI defines are accepted and change nothing: rtp has none of those tools,
and its reasoning items are never encrypted). rtp stores no responses: ``previous_response_id``
is refused, ``store`` and ``metadata`` are echoed and otherwise ignored.

The request becomes a :class:`ChatCompletionRequest` (:meth:`ResponsesRequest.to_chat`), so the
prompt, the tool grammars and the sampling are exactly the chat route's.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, ValidatorFunctionWrapHandler, field_validator
from pydantic_core import PydanticCustomError

from rtp.sampling import SamplingParams
from rtp.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    ContentPart,
    NonEmptyText,
    _Strict,
    _unsupported,
    content_text,
)

# An input message's text parts: ``input_text``, or ``output_text`` of an earlier answer (any other type, an
# ``input_image`` or ``input_file``, is refused by name).
_TEXT_PARTS = ("input_text", "output_text", "text")


class InputItem(_Strict):
    """One input item: a message (``type`` "message" or left out), a function call, its output, or reasoning."""

    type: Literal["message", "function_call", "function_call_output", "reasoning"] | None = None
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[ContentPart] | None = None
    id: str | None = None
    call_id: str | None = Field(default=None, description="function_call and function_call_output items")
    name: str | None = Field(default=None, description="function_call items: the function")
    arguments: str | None = Field(default=None, description="function_call items: the arguments as JSON text")
    output: str | list[ContentPart] | None = Field(
        default=None, description="function_call_output items: the function's answer (text, or its text parts)")
    status: str | None = None


class FunctionTool(_Strict):
    """A function the model may call (the Responses API's flat shape)."""

    type: Literal["function"]
    name: NonEmptyText
    description: str | None = None
    parameters: dict[str, Any] | None = Field(default=None, description="JSON schema of the arguments")
    strict: bool | None = None


class FunctionToolChoice(_Strict):
    """``{"type": "function", "name": ...}``: the model must call this function."""

    type: Literal["function"]
    name: NonEmptyText


class TextFormat(_Strict):
    """``text.format``: plain text, any JSON object, or JSON following ``schema``."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None


class ReasoningConfig(_Strict):
    """Accepted for compatibility; Qwen3 thinking is switched with chat_template_kwargs (enable_thinking)."""

    effort: str | None = None
    summary: str | None = None


# OpenAI's values of ``include``: only the first changes what rtp returns.
OUTPUT_LOGPROBS = "message.output_text.logprobs"
Includable = Literal["message.output_text.logprobs", "reasoning.encrypted_content", "code_interpreter_call.outputs",
                     "computer_call_output.output.image_url", "file_search_call.results",
                     "message.input_image.image_url", "web_search_call.action.sources", "web_search_call.results"]


class ResponsesRequest(_Strict):
    """Body of POST /v1/responses."""

    model: str | None = None
    # The list first: pydantic reports the first union member's errors, and an item's are the useful ones.
    input: Annotated[list[InputItem], Field(min_length=1)] | NonEmptyText = Field(
        description="text, or a list of input items")
    instructions: str | None = Field(default=None, description="a system message before the input")
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20, description="with include "
                                     "message.output_text.logprobs: the likeliest tokens listed at each position")
    include: list[Includable] | None = None
    previous_response_id: str | None = _unsupported("null: rtp stores no responses; send the whole conversation",
                                                    max_length=0)
    # vLLM's extras.
    seed: int | None = None
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)
    ignore_eos: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("input", mode="wrap")
    @classmethod
    def _input(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:  # noqa: ANN401
        """An empty input says so (pydantic would name its constrained-string type in the location)."""
        if isinstance(value, (str, list)) and not value:
            raise PydanticCustomError("input_empty", "must be a non-empty string or a non-empty list of items")
        return handler(value)

    def num_logprobs(self) -> int | None:
        """The top tokens to list per generated token; None when ``include`` does not ask for logprobs."""
        return (self.top_logprobs or 0) if OUTPUT_LOGPROBS in (self.include or []) else None

    def messages(self) -> list[dict[str, Any]]:
        """The input as chat messages (OpenAI chat shape); ApiError(400) naming the item at fault."""
        out: list[dict[str, Any]] = []
        if self.instructions:
            out.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*out, {"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            where = f"input.{i}"
            kind = item.type or "message"
            if kind == "reasoning":
                continue
            if kind == "function_call":
                if not item.name or item.arguments is None or not item.call_id:
                    raise ApiError(400, "a function_call item needs call_id, name and arguments", where)
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                    last["tool_calls"].append(call)  # parallel calls of one turn
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif kind == "function_call_output":
                if not item.call_id or item.output is None:
                    raise ApiError(400, "a function_call_output item needs call_id and output", where)
                if not any(c["id"] == item.call_id for m in out for c in m.get("tool_calls", [])):
                    raise ApiError(400, f"function_call_output {item.call_id!r} answers no function_call item "
                                   "before it", f"{where}.call_id")
                out.append({"role": "tool", "tool_call_id": item.call_id,
                            "content": content_text(item.output, _TEXT_PARTS, f"{where}.output")})
            else:
                if item.role is None:
                    raise ApiError(400, "a message item needs a role (user, system, developer or assistant)",
                                   f"{where}.role")
                out.append({"role": item.role, "content": content_text(item.content, _TEXT_PARTS,
                                                                           f"{where}.content")})
        if not any(m["role"] != "system" for m in out):
            raise ApiError(400, "the input holds no message besides instructions", "input")
        return out

    def to_chat(self) -> ChatCompletionRequest:
        """The equivalent chat completion request (validated as such); ApiError(400) when it is not one."""
        body: dict[str, Any] = {"model": self.model, "messages": self.messages(), "stream": self.stream,
                                "max_completion_tokens": self.max_output_tokens}
        for name in ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty", "ignore_eos",
                     "parallel_tool_calls", "chat_template_kwargs", "user"):
            body[name] = getattr(self, name)
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.tools]
        choice = self.tool_choice
        if isinstance(choice, FunctionToolChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            body["tool_choice"] = choice
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}}
        body = {k: v for k, v in body.items() if v is not None}
        try:
            chat = ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            err = e.errors()[0]
            param = ".".join(str(x) for x in err["loc"])
            raise ApiError(400, f"{param}: {err['msg']}", param) from None
        if isinstance(choice, FunctionToolChoice):
            chat.check_supported()  # "names a function that is not among the tools", in chat's words
        return chat

    def echo_fields(self, params: SamplingParams) -> dict[str, Any]:
        """The request settings a Response object repeats; temperature and top_p as ``params`` (what the
        request runs with, the checkpoint's defaults filling what it left unset)."""
        choice = self.tool_choice
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "temperature": params.temperature, "top_p": params.top_p,
                "tools": [t.model_dump(exclude_none=True) for t in self.tools or []],
                "tool_choice": choice.model_dump() if isinstance(choice, FunctionToolChoice) else (choice or "auto"),
                "parallel_tool_calls": self.parallel_tool_calls is not False,
                "text": {"format": (self.text.format.model_dump(by_alias=True, exclude_none=True)
                                    if self.text is not None and self.text.format is not None else {"type": "text"})},
                "metadata": self.metadata or {}, "store": False, "previous_response_id": None,
                "truncation": "disabled", "user": self.user, "reasoning": None}
