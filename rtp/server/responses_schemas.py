"""The documented bodies of /v1/responses: the Response object, its output items and its stream events.

Like rtp.server.schemas, these models document what rtp.server.responses_api builds; they never
validate inside the server. Field names and event types are OpenAI's, as the ``openai`` SDK parses them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from rtp.server.schemas import _Doc

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(_Doc):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any] | None = None


class ReasoningText(_Doc):
    type: Literal["reasoning_text"]
    text: str


class MessageItem(_Doc):
    """The assistant's answer text."""

    type: Literal["message"]
    id: str
    status: ItemStatus
    role: Literal["assistant"]
    content: list[OutputText]


class ReasoningItem(_Doc):
    """The think block (with --reasoning-parser qwen3)."""

    type: Literal["reasoning"]
    id: str
    summary: list[Any]
    content: list[ReasoningText] | None = None
    status: ItemStatus | None = None


class FunctionCallItem(_Doc):
    """A call of one of the request's function tools; answer it with a function_call_output input item."""

    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str = Field(description="the arguments as JSON text")
    status: ItemStatus | None = None


OutputItem = MessageItem | ReasoningItem | FunctionCallItem


class InputTokensDetails(_Doc):
    cached_tokens: int = Field(ge=0)


class OutputTokensDetails(_Doc):
    reasoning_tokens: int = Field(ge=0)


class ResponseUsage(_Doc):
    input_tokens: int = Field(ge=0)
    input_tokens_details: InputTokensDetails
    output_tokens: int = Field(ge=0)
    output_tokens_details: OutputTokensDetails
    total_tokens: int = Field(ge=0)


class IncompleteDetails(_Doc):
    reason: Literal["max_output_tokens"]


class ResponseObject(_Doc):
    """A /v1/responses response (``stream: true``: a stream of the events below instead)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None
    error: None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool


class ResponseLifecycleEvent(_Doc):
    """The first events (created, in_progress) and the last one (completed or incomplete)."""

    type: Literal["response.created", "response.in_progress", "response.completed", "response.incomplete"]
    sequence_number: int
    response: ResponseObject


class OutputItemEvent(_Doc):
    type: Literal["response.output_item.added", "response.output_item.done"]
    sequence_number: int
    output_index: int
    item: OutputItem


class ContentPartEvent(_Doc):
    type: Literal["response.content_part.added", "response.content_part.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class TextDeltaEvent(_Doc):
    """New answer (output_text) or reasoning (reasoning_text) text."""

    type: Literal["response.output_text.delta", "response.reasoning_text.delta"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str


class TextDoneEvent(_Doc):
    type: Literal["response.output_text.done", "response.reasoning_text.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str


class FunctionArgumentsEvent(_Doc):
    """Arguments of a function call: deltas, then the whole text (done)."""

    type: Literal["response.function_call_arguments.delta", "response.function_call_arguments.done"]
    sequence_number: int
    item_id: str
    output_index: int
    delta: str | None = None
    arguments: str | None = None


class ErrorEvent(_Doc):
    """An error after the stream started; the stream ends after it."""

    type: Literal["error"]
    sequence_number: int
    code: str | None
    message: str
    param: str | None


STREAM_EVENTS: tuple[type[_Doc], ...] = (ResponseLifecycleEvent, OutputItemEvent, ContentPartEvent, TextDeltaEvent,
                                         TextDoneEvent, FunctionArgumentsEvent, ErrorEvent)


def responses_sse() -> dict[str, Any]:
    """``openapi_extra`` of /v1/responses: the text/event-stream form of its 200 (``stream: true``)."""
    refs = [{"$ref": f"#/components/schemas/{m.__name__}"} for m in STREAM_EVENTS]
    event = {
        "type": "object",
        "required": ["data"],
        "properties": {"event": {"type": "string", "description": "the event's type"},
                       "data": {"type": "string", "contentMediaType": "application/json",
                                "contentSchema": {"anyOf": refs}}},
        "description": "one server-sent event: `event: <type>` and `data: <the event as JSON>`; the stream ends "
                       "with response.completed or response.incomplete (or an error event)",
    }
    return {"responses": {"200": {"content": {"text/event-stream": {"schema": event}}}}}

