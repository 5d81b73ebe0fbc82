"""POST /v1/responses: OpenAI's Responses API over the chat path.

The request is mapped onto a chat completion (rtp.server.responses_protocol), so the prompt, the
tool grammars and the sampling are the chat route's; the generated text goes through the same
:class:`ChatOutput` (Qwen3 reasoning parser, tool-call parsing) and its message is then written as
Responses output items: a ``reasoning`` item (the think block, with ``--reasoning-parser qwen3``),
a ``message`` item with the text, and one ``function_call`` item per tool call.

A stream sends OpenAI's events, each as ``event: <type>`` and ``data: <json>``: response.created
and response.in_progress; per output item response.output_item.added, its content part's
added/delta/done events (response.output_text.delta, response.reasoning_text.delta, or
response.function_call_arguments.delta/done for a call) and response.output_item.done; and last
response.completed (or response.incomplete when max_output_tokens ran out), carrying the whole
Response. An error after the stream started is an ``error`` event, and the stream ends there.

With ``include: ["message.output_text.logprobs"]``, the message's ``output_text`` lists the logprobs
of every generated token (``top_logprobs`` alternatives each, reasoning tokens included), as vLLM's;
streamed, each response.output_text.delta carries those of the tokens since the one before it, and a
last delta with no text those left when the message ends. Tokens generated after the message's
item closed (a function call after the text, in "auto" mode) are listed on the message in the final
Response only (its events were sent).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from rtp.outputs import RequestOutput
from rtp.sampling import SamplingParams
from rtp.server.async_engine import RequestStream
from rtp.server.chat_output import ChatOutput
from rtp.server.http_errors import ClientGone, runtime_error
from rtp.server.responses import ResponseBuilder
from rtp.server.responses_protocol import ResponsesRequest
from rtp.server.sse import ClosingEventStream, json_text
from rtp.server.streaming import Tracker

if TYPE_CHECKING:
    from rtp.server.context import ServerContext


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseWriter:
    """Builds one request's Response object and, when streamed, its events in order."""

    def __init__(self, req: ResponsesRequest, response_id: str, model: str, num_prompt_tokens: int,
                 output: ChatOutput, params: SamplingParams, logprobs: ResponseBuilder | None = None) -> None:
        self.req, self.id, self.model, self.output = req, response_id, model, output
        self.logprobs = logprobs  # writes the tokens' logprob objects, when the request includes them
        self._logprobs_seen = 0  # streamed: generated tokens whose logprobs were taken
        self._pending: list[dict[str, Any]] = []  # streamed: logprobs not sent yet
        self.params = params  # what the request runs with: the Response repeats its temperature and top_p
        self.num_prompt_tokens = num_prompt_tokens
        self.created = int(time.time())  # whole seconds, as OpenAI's
        self.items: list[dict[str, Any]] = []  # output items, in order
        self._open: dict[str, Any] | None = None  # the item being streamed
        self._seq = 0

    # ---- the Response object ----

    def response(self, status: str, out: RequestOutput | None, reasoning_tokens: int = 0) -> dict[str, Any]:
        usage = None
        if out is not None:
            output_tokens = out.num_completion_tokens
            usage = {"input_tokens": self.num_prompt_tokens,
                     "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
                     "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                     "total_tokens": self.num_prompt_tokens + output_tokens}
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": list(self.items), "usage": usage, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                **self.req.echo_fields(self.params)}

    @staticmethod
    def status_of(out: RequestOutput) -> str:
        return "incomplete" if out.finish_reason == "length" else "completed"

    def items_of(self, message: dict[str, Any], status: str, out: RequestOutput | None = None) -> list[dict[str, Any]]:
        """Output items of a finished chat message (reasoning, text, tool calls); the text lists the logprobs of
        ``out``'s tokens when the request includes them."""
        items: list[dict[str, Any]] = []
        if message.get("reasoning_content"):
            items.append({"type": "reasoning", "id": _id("rs"), "summary": [], "status": status,
                          "content": [{"type": "reasoning_text", "text": message["reasoning_content"]}]})
        calls = message.get("tool_calls") or []
        if message.get("content") or not calls:
            items.append({"type": "message", "id": _id("msg"), "status": status, "role": "assistant",
                          "content": [{"type": "output_text", "text": message.get("content") or "",
                                       "annotations": [], "logprobs": self._all_logprobs(out)}]})
        for call in calls:
            items.append({"type": "function_call", "id": _id("fc"), "call_id": call["id"],
                          "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                          "status": status})
        for item in items[:-1]:  # only the last item can have been cut off
            item["status"] = "completed"
        return items

    def _all_logprobs(self, out: RequestOutput | None) -> list[dict[str, Any]]:
        return [] if self.logprobs is None or out is None else self.logprobs.token_logprobs(out, 0)

    # ---- stream events ----

    def take_logprobs(self, out: RequestOutput) -> None:
        """Streamed: queue the logprobs of the tokens ``out`` added, for the next output_text delta."""
        if self.logprobs is not None and len(out.token_ids) > self._logprobs_seen:
            self._pending += self.logprobs.token_logprobs(out, self._logprobs_seen)
            self._logprobs_seen = len(out.token_ids)

    def event(self, type_: str, **fields: Any) -> str:
        body = {"type": type_, "sequence_number": self._seq, **fields}
        self._seq += 1
        return f"event: {type_}\ndata: {json_text(body)}\n\n"

    def opening(self) -> list[str]:
        r = self.response("in_progress", None)
        return [self.event("response.created", response=r), self.event("response.in_progress", response=r)]

    def _start(self, kind: str, call: dict[str, Any] | None = None) -> list[str]:
        events = self._finish_open()
        index = len(self.items)
        part: dict[str, Any] | None
        if kind == "function_call":
            assert call is not None
            item: dict[str, Any] = {"type": "function_call", "id": _id("fc"), "call_id": call["id"],
                                    "name": call["function"]["name"], "arguments": "", "status": "in_progress"}
            part = None
        elif kind == "reasoning":
            item = {"type": "reasoning", "id": _id("rs"), "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"type": "message", "id": _id("msg"), "status": "in_progress", "role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        events.append(self.event("response.output_item.added", output_index=index, item=dict(item)))
        if part is not None:
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                     content_index=0, part=dict(part)))
            item["content"] = [part]
        self.items.append(item)
        self._open = item
        return events

    def _append(self, kind: str, text: str) -> list[str]:
        item = self._open
        assert item is not None
        index = len(self.items) - 1
        if kind == "function_call":
            item["arguments"] += text
            return [self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                               delta=text)]
        part = item["content"][0]
        part["text"] += text
        if kind == "reasoning":
            return [self.event("response.reasoning_text.delta", item_id=item["id"], output_index=index,
                               content_index=0, delta=text)]
        logprobs, self._pending = self._pending, []
        part["logprobs"] += logprobs
        return [self.event("response.output_text.delta", item_id=item["id"], output_index=index, content_index=0,
                           delta=text, logprobs=logprobs)]

    def _finish_open(self, status: str = "completed") -> list[str]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = len(self.items) - 1
        item["status"] = status
        events = []
        if item["type"] == "function_call":
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                     arguments=item["arguments"]))
        else:
            part = item["content"][0]
            name = "response.reasoning_text" if item["type"] == "reasoning" else "response.output_text"
            extra: dict[str, Any] = {} if item["type"] == "reasoning" else {"logprobs": part["logprobs"]}
            events.append(self.event(f"{name}.done", item_id=item["id"], output_index=index, content_index=0,
                                     text=part["text"], **extra))
            events.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                     content_index=0, part=dict(part)))
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events

    def delta_events(self, delta: dict[str, Any]) -> list[str]:
        """Events for one chat delta ({"reasoning_content", "content", "tool_calls"}, any of them)."""
        events: list[str] = []
        for key, kind in (("reasoning_content", "reasoning"), ("content", "message")):
            text = delta.get(key)
            if not text:
                continue
            if self._open is None or self._open["type"] != kind:
                events += self._start(kind)
            events += self._append(kind, text)
        for call in delta.get("tool_calls") or []:
            if "id" in call:  # a new call (its first delta names it)
                events += self._start("function_call", call)
            arguments = (call.get("function") or {}).get("arguments")
            if arguments:
                events += self._append("function_call", arguments)
        return events

    def closing(self, out: RequestOutput, reasoning_tokens: int) -> list[str]:
        status = self.status_of(out)
        events = []
        if not any(item["type"] in ("message", "function_call") for item in self.items):
            # No text and no call (only EOS, or only reasoning): an empty message ends the output, as a
            # non-streamed answer has (the open item, if any, completes), and only it can be incomplete.
            events += self._start("message")
        if self._pending and self._open is not None and self._open["type"] == "message":
            events += self._append("message", "")  # the last tokens' logprobs (their text was held back or empty)
        events += self._finish_open(status)
        message = next((i for i in reversed(self.items) if i["type"] == "message"), None)
        if self._pending and message is not None:
            # Tokens after the message item closed (a function call): the final Response lists them on the
            # message, as a full one does (its events are sent already).
            message["content"][0]["logprobs"] += self._pending
            self._pending = []
        name = "response.incomplete" if status == "incomplete" else "response.completed"
        return [*events, self.event(name, response=self.response(status, out, reasoning_tokens))]


async def create_response(api: ServerContext, request: Request) -> Response:
    """The handler of POST /v1/responses."""
    req: ResponsesRequest = await api.read_body(request, ResponsesRequest)
    if req.model is not None:
        api.check_model_name(req.model)
    chat = req.to_chat()
    chat.check_supported()
    mode, tool_name = api.tool_mode(chat)
    text = await api.render_chat(chat.conversation(), chat.tool_dicts(), chat.chat_template_kwargs, True)
    spec = api.after_thinking(chat.tool_grammar() or chat.grammar_spec(), text)
    constraint = await api.constraint(spec)
    num_logprobs = req.num_logprobs()
    stream, ids, rid, params = await api.submit(chat, text, num_logprobs, "resp", "input", constraint,
                                                "max_output_tokens")
    output = api.chat_output(text, mode, tool_name, chat.parallel_tool_calls is False, spec)
    logprobs = None
    if num_logprobs is not None:
        logprobs = ResponseBuilder("chat.completion", rid, api.model_name, api.tokenizer, len(ids), num_logprobs)
    writer = ResponseWriter(req, _id("resp"), api.model_name, len(ids), output, params, logprobs)
    if req.stream:
        return ClosingEventStream(_events(api, stream, writer), [stream])
    try:
        out = await api.collect(request, stream, len(ids))
    except ClientGone:
        raise
    except Exception as e:  # noqa: BLE001
        raise runtime_error(e, "input") from None
    message = output.message(out.text)
    writer.items = writer.items_of(message, writer.status_of(out), out)
    reasoning_tokens = await _count_tokens(api, message.get("reasoning_content"))
    return JSONResponse(writer.response(writer.status_of(out), out, reasoning_tokens))


async def _count_tokens(api: ServerContext, text: str | None) -> int:
    if not text:
        return 0
    return len(await api.off_loop(api.tokenizer.encode, text, add_special_tokens=False))


async def _events(api: ServerContext, stream: RequestStream, writer: ResponseWriter) -> AsyncIterator[str]:
    tracker = Tracker(api.metrics, writer.num_prompt_tokens)
    reasoning = ""
    try:
        for event in writer.opening():
            yield event
        async for out in stream:
            tracker.update(out)
            writer.take_logprobs(out)
            delta = writer.output.delta(out.new_text, out.finished)
            reasoning += delta.get("reasoning_content") or ""
            for event in writer.delta_events(delta):
                yield event
            if out.finished:
                for event in writer.closing(out, await _count_tokens(api, reasoning)):
                    yield event
    except Exception as e:  # noqa: BLE001 - the status line is gone: report in-band
        err = runtime_error(e, "input")
        yield writer.event("error", code=err.code, message=err.message, param=err.param)
    finally:
        stream.close()
        tracker.done()
