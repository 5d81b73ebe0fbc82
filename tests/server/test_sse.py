"""Server-sent events carry their JSON with non-ASCII text as UTF-8, as OpenAI's API and vLLM's server send it."""

from __future__ import annotations

import json

from rtp.server.streaming import _sse


def test_an_event_holds_the_text_as_utf8_and_parses_back():
    chunk = {"id": "cmpl-1", "choices": [{"index": 0, "text": "naïve café 你好 😀 \"q\"\n", "logprobs": None}]}
    event = _sse(chunk)
    assert event.startswith("data: ") and event.endswith("\n\n")
    assert "naïve café 你好 😀" in event  # not \u escapes
    assert json.loads(event[len("data: "):]) == chunk
    assert event == f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
    assert _sse("[DONE]") == "data: [DONE]\n\n"
