"""OpenAI response bodies built from RequestOutputs (plain dicts, serialized by the API layer).

Shapes (one choice, index 0):

- completion: ``{"id", "object": "text_completion", "created", "model",
  "choices": [{"index", "text", "logprobs", "finish_reason"}], "usage"}``;
  logprobs ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``.
- chat: ``{"id", "object": "chat.completion", ..., "choices": [{"index",
  "message": {"role": "assistant", "content"}, "logprobs", "finish_reason"}], "usage"}``;
  logprobs ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``.
- stream chunks: ``object`` "text_completion" / "chat.completion.chunk", the
  choice carries ``text`` / ``delta``; with ``include_usage`` a last chunk
  has ``"choices": []`` and the usage.

``usage`` is ``{"prompt_tokens", "completion_tokens", "total_tokens",
"prompt_tokens_details": {"cached_tokens"}}``; completion tokens count every
generated token, the EOS or stop token included.
"""

from __future__ import annotations

import time
from typing import Any

from rtp.outputs import RequestOutput


class ResponseBuilder:
    """Builds the bodies of one request. ``kind`` is "text_completion" or "chat.completion"."""

    def __init__(self, kind: str, request_id: str, model: str, tokenizer: Any, num_prompt_tokens: int,
                 num_logprobs: int | None) -> None:
        assert kind in ("text_completion", "chat.completion")
        self.chat = kind == "chat.completion"
        self.request_id, self.model, self.tokenizer = request_id, model, tokenizer
        self.num_prompt_tokens, self.num_logprobs = num_prompt_tokens, num_logprobs
        self.created = int(time.time())
        self._text_offset = 0  # completions logprobs: characters of the tokens already reported

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def usage(self, out: RequestOutput) -> dict[str, Any]:
        completion = len(out.token_ids)
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.num_prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}

    # ---- logprobs ----

    @staticmethod
    def _finite(logprob: float | None) -> float:
        # JSON has no -Infinity: a token the sampler ruled out gets a very small finite value.
        return -9999.0 if logprob is None or logprob != logprob or logprob < -9999.0 else float(logprob)

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _top(self, entry: dict[int, float]) -> list[tuple[int, float]]:
        return sorted(entry.items(), key=lambda kv: -kv[1])[: self.num_logprobs or 0]

    def _logprobs(self, out: RequestOutput, start: int) -> dict[str, Any] | None:
        """Logprobs of the generated tokens ``start:`` (None when the request asked for none)."""
        if self.num_logprobs is None or out.logprobs is None:
            return None
        pairs = list(zip(out.token_ids[start:], out.logprobs[start:]))
        if self.chat:
            content = []
            for tid, entry in pairs:
                tok = self._token(tid)
                top = [{"token": (t := self._token(k)), "logprob": self._finite(v), "bytes": list(t.encode())}
                       for k, v in self._top(entry)]
                content.append({"token": tok, "logprob": self._finite(entry.get(tid)),
                                "bytes": list(tok.encode()), "top_logprobs": top})
            return {"content": content}
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for tid, entry in pairs:
            tok = self._token(tid)
            tokens.append(tok)
            token_logprobs.append(self._finite(entry.get(tid)))
            top_logprobs.append({self._token(k): self._finite(v) for k, v in self._top(entry)})
            offsets.append(self._text_offset)
            self._text_offset += len(tok)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}

    # ---- bodies ----

    def full_response(self, out: RequestOutput) -> dict[str, Any]:
        """The non-streaming response of a finished request."""
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": out.text}
        else:
            choice["text"] = out.text
        choice["logprobs"] = self._logprobs(out, 0)
        choice["finish_reason"] = out.finish_reason
        body = self._envelope("chat.completion" if self.chat else "text_completion", [choice])
        body["usage"] = self.usage(out)
        return body

    def first_chunk(self) -> dict[str, Any] | None:
        """Chat streams open with the assistant role; completions have no opening chunk."""
        if not self.chat:
            return None
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        return self._envelope("chat.completion.chunk", [choice])

    def chunk(self, out: RequestOutput, start: int) -> dict[str, Any] | None:
        """The chunk for tokens ``start:`` of ``out`` (None when it would carry nothing)."""
        logprobs = self._logprobs(out, start) if len(out.token_ids) > start else None
        if not out.new_text and not out.finished and logprobs is None:
            return None  # text held back (a partial character or stop string): nothing to send yet
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["delta"] = {"content": out.new_text} if out.new_text or not out.finished else {}
        else:
            choice["text"] = out.new_text
        choice["logprobs"] = logprobs
        choice["finish_reason"] = out.finish_reason if out.finished else None
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def usage_chunk(self, out: RequestOutput) -> dict[str, Any]:
        """The last chunk of a stream with ``stream_options.include_usage``."""
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = self.usage(out)
        return body
