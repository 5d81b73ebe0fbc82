"""A server-sent-event response that closes its engine request streams however the response ends."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from rtp.server.async_engine import RequestStream

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

json_text = json.JSONEncoder(ensure_ascii=False).encode
"""``json.dumps(obj, ensure_ascii=False)``, with one encoder for all calls (dumps builds one per call with
non-default arguments: a stream chunk 9.6 -> 5.8 us, and a stream sends one per token)."""


class ClosingEventStream(StreamingResponse):
    """``events`` as text/event-stream; every stream of ``streams`` is closed (its request aborted if
    unfinished) when the response ends, also when it is cancelled before the generator first ran
    (a client that leaves right away), which the generator's own ``finally`` would miss.
    """

    def __init__(self, events: AsyncIterator[str], streams: list[RequestStream]) -> None:
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)
        self.request_streams = streams

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for stream in self.request_streams:
                stream.close()
