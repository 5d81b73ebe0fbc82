"""One request's response: a JSON body once it finished, or server-sent events while it runs.

Both paths watch the client: a client that disconnects aborts its request, so
its KV blocks are freed at the next step. Both feed the server metrics (token
counts, inter-token gaps, the outcome). Streams use OpenAI's chunk format and
end with ``data: [DONE]``; an error after the stream started arrives as one
``data: {"error": ...}`` event before it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from rtp.outputs import RequestOutput
from rtp.server.async_engine import RequestStream
from rtp.server.http_errors import ClientGone, runtime_error
from rtp.server.metrics import ServerMetrics
from rtp.server.protocol import CommonRequest
from rtp.server.responses import ResponseBuilder
from rtp.server.sse import ClosingEventStream, json_text


def _sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json_text(data)}\n\n"


class Tracker:
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



async def respond(metrics: ServerMetrics, request: Request, req: CommonRequest, stream: RequestStream, ids: list[int],
                  build: ResponseBuilder) -> Response:
    """The response to a submitted request: an event stream if it asked for one, else the final JSON body."""
    if req.stream:
        build.continuous_usage = req.continuous_usage
        return ClosingEventStream(stream_events(metrics, stream, len(ids), build, req.include_usage), [stream])
    try:
        out = await collect(metrics, request, stream, len(ids))
    except ClientGone:
        raise
    except Exception as e:  # noqa: BLE001
        raise runtime_error(e, "prompt") from None
    return JSONResponse(build.full_response(out))


async def collect(metrics: ServerMetrics, request: Request, stream: RequestStream, num_prompt_tokens: int
                  ) -> RequestOutput:
    """Wait for the final output; abort the request if the client disconnects first."""
    tracker = Tracker(metrics, num_prompt_tokens)

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
            raise ClientGone()
        return work.result()
    finally:
        for task in (work, watch):
            task.cancel()
        stream.close()
        tracker.done()


async def stream_events(metrics: ServerMetrics, stream: RequestStream, num_prompt_tokens: int, build: ResponseBuilder,
                        include_usage: bool) -> AsyncIterator[str]:
    """SSE events of one request; closing the generator (a disconnect) aborts the request."""
    tracker = Tracker(metrics, num_prompt_tokens)
    try:
        # Chat's opening chunk (the role) goes with the first output, as vLLM's: a client that times the first
        # chunk (vLLM's benchmark) times the first token, not the request's arrival.
        first = build.first_chunk()
        choices: list[ResponseBuilder] = []  # n > 1: one builder per choice
        sent: list[int] = []  # n > 1: tokens of each choice already sent
        async for out in stream:
            if first is not None:
                yield _sse(first)
                first = None
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
                    if (opening := b.first_chunk()) is not None:
                        yield _sse(opening)
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
        yield _sse(runtime_error(e, "prompt").body())
    finally:
        stream.close()
        tracker.done()
    yield _sse("[DONE]")
