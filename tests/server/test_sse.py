"""Server-sent events carry their JSON on one line: text as UTF-8 (as OpenAI's API and vLLM's server send it),
except the characters that line readers take as line breaks although JSON leaves them raw."""

from __future__ import annotations

import json

from rtp.server.streaming import _sse


def _lines(event: str) -> list[str]:
    """The lines an httpx client's ``iter_lines`` reads from ``event``: it breaks them as str.splitlines does."""
    return [line for line in event.splitlines() if line]


def test_an_event_holds_the_text_as_utf8_and_parses_back():
    chunk = {"id": "cmpl-1", "choices": [{"index": 0, "text": "naïve café 你好 😀 \"q\"\n\r\t", "logprobs": None}]}
    event = _sse(chunk)
    assert event.startswith("data: ") and event.endswith("\n\n")
    assert "naïve café 你好 😀" in event  # not \u escapes
    assert json.loads(event[len("data: "):]) == chunk
    assert event == f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
    assert _sse("[DONE]") == "data: [DONE]\n\n"


def test_characters_that_line_readers_break_at_stay_inside_one_line():
    text = "a\x85b\u2028c\u2029d\x1ce\x0bf"
    assert len(text.splitlines()) == 6  # what an httpx client would cut the text into
    chunk = {"choices": [{"index": 0, "text": text}]}
    lines = _lines(_sse(chunk))
    assert len(lines) == 1 and lines[0].startswith("data: ")
    assert json.loads(lines[0][len("data: "):]) == chunk
