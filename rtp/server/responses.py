"""OpenAI response bodies built from RequestOutputs (plain dicts, serialized by the API layer).

Shapes (one choice per sample: ``n`` choices, index 0 to n-1; see :meth:`ResponseBuilder.for_choice`):

- completion: ``{"id", "object": "text_completion", "created", "model",
  "choices": [{"index", "text", "logprobs", "finish_reason"}], "usage"}``;
  logprobs ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``.
- chat: ``{"id", "object": "chat.completion", ..., "choices": [{"index",
  "message": {"role": "assistant", "content"}, "logprobs", "finish_reason"}], "usage"}``; with a
  ChatOutput (reasoning parser, tools) the message may add ``reasoning`` (and ``reasoning_content``) and ``tool_calls``
  and the deltas likewise;
  logprobs ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``; ``bytes`` are the
  token's own, also where they hold part of a character (its ``token``, decoded alone, is then U+FFFD), and a
  completions ``text_offset`` counts the characters the tokens before it complete.
- stream chunks: ``object`` "text_completion" / "chat.completion.chunk", the
  choice carries ``text`` / ``delta``; with ``include_usage`` a last chunk
  has ``"choices": []`` and the usage.

``usage`` is ``{"prompt_tokens", "completion_tokens", "total_tokens",
"prompt_tokens_details": {"cached_tokens"}}``; completion tokens count every
generated token of every choice, the EOS or stop token included; the prompt counts once.

Completions with ``echo``: the text starts with the prompt; with logprobs, the
logprobs start with the prompt tokens' (the first one's logprob and top_logprobs
are null, as OpenAI's), from the prompt logprobs of the same forward pass. With ``max_tokens: 0`` as
well, each choice is the prompt alone (finish_reason "length", no completion tokens): the engine makes one
token, which is left out, as vLLM does.
"""

from __future__ import annotations

import codecs
import copy
import functools
import time
from typing import Any

from rtp.outputs import CompletionOutput, RequestOutput
from rtp.runtime.detokenizer import TokenBytes
from rtp.server.chat_output import ChatOutput


class ResponseBuilder:
    """Builds the bodies of one request. ``kind`` is "text_completion" or "chat.completion"."""

    def __init__(self, kind: str, request_id: str, model: str, tokenizer: Any, num_prompt_tokens: int,
                 num_logprobs: int | None, chat_output: ChatOutput | None = None) -> None:
        assert kind in ("text_completion", "chat.completion")
        self.chat = kind == "chat.completion"
        # Chat only: how the text becomes the message (reasoning and tool calls); None: all content.
        self.chat_output = chat_output
        self.request_id, self.model, self.tokenizer = request_id, model, tokenizer
        self.num_prompt_tokens, self.num_logprobs = num_prompt_tokens, num_logprobs
        self.created = int(time.time())
        self._text_offset = 0  # completions logprobs: characters of the tokens already reported
        self._chars = _utf8_chars()  # their bytes -> the characters they complete (a token may hold part of one)
        self.index = 0  # the choice index this builder writes
        # Completions: the prompt text to echo before the completion; chat: the assistant's last message.
        self.echo: str | None = None
        self.continuous_usage = False  # every stream chunk carries the usage so far
        self._echo_sent = False
        self.prompt_logprobs: int | None = None  # how many top tokens prompt_logprobs name
        self._prompt_logprobs_sent = False
        self.prompt_only = False  # completions' echo with max_tokens 0: the generated token is left out

    def for_choice(self, index: int) -> ResponseBuilder:
        """A builder for choice ``index`` (n > 1), with its own offsets and chat parser; call on a fresh builder."""
        b = copy.copy(self)
        b.index, b._text_offset, b._echo_sent, b._prompt_logprobs_sent = index, 0, False, False
        b._chars = _utf8_chars()
        b.chat_output = copy.deepcopy(self.chat_output)
        return b

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def usage(self, out: RequestOutput) -> dict[str, Any]:
        """The request's usage (every choice's generated tokens)."""
        return {**self.counts(0 if self.prompt_only else out.num_completion_tokens),
                "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}

    def counts(self, completion: int) -> dict[str, Any]:
        """Token counts with ``completion`` generated tokens: a chunk's usage with continuous_usage_stats (vLLM's:
        the chunk's choice's tokens so far; the cached tokens are known only at the end)."""
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.num_prompt_tokens + completion}

    # ---- logprobs ----

    @staticmethod
    def _finite(logprob: float | None) -> float:
        # JSON has no -Infinity: a token the sampler ruled out gets a very small finite value.
        return -9999.0 if logprob is None or logprob != logprob or logprob < -9999.0 else float(logprob)

    @functools.cached_property
    def _bytes(self) -> TokenBytes:
        """Each token's bytes, made on first use (only a request with logprobs needs them)."""
        return TokenBytes(self.tokenizer)

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _top(self, entry: dict[int, float], n: int | None = None) -> list[tuple[int, float]]:
        """The ``n`` (default: the request's logprobs) likeliest entries, likeliest first."""
        return sorted(entry.items(), key=lambda kv: -kv[1])[: (self.num_logprobs if n is None else n) or 0]

    def _top_dict(self, entry: dict[int, float], chosen: int) -> dict[str, float]:
        """Completions top_logprobs: text -> logprob of the top tokens and of the ``chosen`` one (sampled, or the
        prompt's), as OpenAI's and vLLM's (up to logprobs + 1 entries); of two ids with the same text the likelier
        one wins."""
        top: dict[str, float] = {}
        for k, v in self._top(entry):
            top.setdefault(self._token(k), self._finite(v))
        if chosen in entry:
            top.setdefault(self._token(chosen), self._finite(entry[chosen]))
        return top

    def _prompt_logprobs(self, request: RequestOutput) -> list[dict[str, dict[str, Any]] | None] | None:
        """Completions ``prompt_logprobs`` (vLLM's shape): per prompt token None for the first, else token id ->
        ``{"logprob", "rank", "decoded_token"}`` of the top ``prompt_logprobs`` tokens and of the prompt's own
        (outside them, its rank is the engine's: the tokens at least as likely, itself included; null where the
        entry carries none)."""
        if self.prompt_logprobs is None or request.prompt_logprobs is None:
            return None
        out: list[dict[str, dict[str, Any]] | None] = []
        for tid, entry in zip(request.prompt_token_ids, request.prompt_logprobs):
            if entry is None:
                out.append(None)
                continue
            d = {str(k): {"logprob": self._finite(v), "rank": r, "decoded_token": self._token(k)}
                 for r, (k, v) in enumerate(self._top(entry, self.prompt_logprobs), 1)}
            if tid in entry:
                d.setdefault(str(tid), {"logprob": self._finite(entry[tid]), "rank": getattr(entry[tid], "rank", None),
                                        "decoded_token": self._token(tid)})
            out.append(d)
        return out

    def _echo_logprobs(self, request: RequestOutput) -> tuple[dict[str, Any], int]:
        """Completions logprobs of the prompt tokens (echo; the first token has none) and their text length."""
        prompt_lp = request.prompt_logprobs or [None] * len(request.prompt_token_ids)
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        offset, chars = 0, _utf8_chars()
        for tid, entry in zip(request.prompt_token_ids, prompt_lp):
            tokens.append(self._token(tid))
            token_logprobs.append(None if entry is None else self._finite(entry.get(tid)))
            top = None if entry is None else self._top_dict(entry, tid)
            top_logprobs.append(top)
            offsets.append(offset)
            offset += len(chars.decode(self._bytes(tid)))
        return ({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                 "text_offset": offsets}, offset)

    def _with_prompt(self, choice: dict[str, Any], request: RequestOutput) -> None:
        """The first completions choice this builder writes: its ``prompt_logprobs`` (when asked) and the echo."""
        if self.prompt_logprobs is not None and not self._prompt_logprobs_sent and not self.chat:
            plp = self._prompt_logprobs(request)
            if plp is not None:
                self._prompt_logprobs_sent = True
                choice["prompt_logprobs"] = plp
        if self.echo is None or self._echo_sent or self.chat:
            return
        self._echo_sent = True
        choice["text"] = self.echo + choice["text"]
        if self.num_logprobs is None:
            return
        prompt, shift = self._echo_logprobs(request)
        rest = choice.get("logprobs")
        if rest is not None:  # the completion's offsets (counted from 0 so far) follow the prompt's
            rest["text_offset"] = [o + shift for o in rest["text_offset"]]
        self._text_offset += shift
        choice["logprobs"] = prompt if rest is None else {k: prompt[k] + rest[k] for k in prompt}

    def _logprobs(self, out: RequestOutput | CompletionOutput, start: int) -> dict[str, Any] | None:
        """Logprobs of the generated tokens ``start:`` (None when the request asked for none)."""
        if self.num_logprobs is None or out.logprobs is None:
            return None
        if self.chat:
            return {"content": self.token_logprobs(out, start)}
        pairs = list(zip(out.token_ids[start:], out.logprobs[start:]))
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for tid, entry in pairs:
            tokens.append(self._token(tid))
            token_logprobs.append(self._finite(entry.get(tid)))
            top_logprobs.append(self._top_dict(entry, tid))
            offsets.append(self._text_offset)
            self._text_offset += len(self._chars.decode(self._bytes(tid)))
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}

    def token_logprobs(self, out: RequestOutput | CompletionOutput, start: int) -> list[dict[str, Any]]:
        """OpenAI's logprob objects (``token``, ``logprob``, ``bytes``, ``top_logprobs``) of the generated tokens
        ``start:``: chat's ``logprobs.content``, and the Responses API's ``output_text.logprobs``."""
        content = []
        for tid, entry in zip(out.token_ids[start:], (out.logprobs or [])[start:]):
            top = [{"token": self._token(k), "logprob": self._finite(v), "bytes": list(self._bytes(k))}
                   for k, v in self._top(entry)]
            content.append({"token": self._token(tid), "logprob": self._finite(entry.get(tid)),
                            "bytes": list(self._bytes(tid)), "top_logprobs": top})
        return content

    # ---- bodies ----

    def full_response(self, out: RequestOutput) -> dict[str, Any]:
        """The non-streaming response of a finished request: one choice per sample."""
        if out.samples is None:
            choices = [self._full_choice(out, out)]
        else:
            builders = [self.for_choice(c.index) for c in out.samples]
            choices = [b._full_choice(c, out) for b, c in zip(builders, out.samples)]
        body = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        if self.chat and self.prompt_logprobs is not None:  # vLLM's: the request's, beside the choices
            body["prompt_logprobs"] = self._prompt_logprobs(out)
        body["usage"] = self.usage(out)
        return body

    def _prompt_choice(self, request: RequestOutput) -> dict[str, Any]:
        """A prompt_only choice: the echo (and the prompt's logprobs where asked), finished for length."""
        choice = {"index": self.index, "text": "", "logprobs": None, "finish_reason": "length", "stop_reason": None}
        self._with_prompt(choice, request)
        return choice

    def _full_choice(self, out: RequestOutput | CompletionOutput, request: RequestOutput) -> dict[str, Any]:
        if self.prompt_only:
            return self._prompt_choice(request)
        choice: dict[str, Any] = {"index": self.index}
        finish_reason = out.finish_reason
        if self.chat and self.chat_output is not None:
            choice["message"] = self.chat_output.message(out.text)
            finish_reason = self.chat_output.finish_reason(finish_reason)
        elif self.chat:
            choice["message"] = {"role": "assistant", "content": out.text}
        else:
            choice["text"] = out.text
        if self.chat and self.echo:
            choice["message"]["content"] = self.echo + (choice["message"]["content"] or "")
        choice["logprobs"] = self._logprobs(out, 0)
        choice["finish_reason"], choice["stop_reason"] = finish_reason, out.stop_reason
        self._with_prompt(choice, request)
        return choice

    def first_chunk(self) -> dict[str, Any] | None:
        """Chat streams open with the assistant role (and the echoed message); completions have no opening
        chunk."""
        if not self.chat:
            return None
        choice = {"index": self.index, "delta": {"role": "assistant", "content": self.echo or ""}, "logprobs": None,
                  "finish_reason": None}
        return self._chunk(choice, 0)

    def _chunk(self, choice: dict[str, Any], completion: int) -> dict[str, Any]:
        """A stream chunk of one choice, with ``completion`` generated tokens as its usage where every chunk has
        one."""
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])
        if self.continuous_usage:
            body["usage"] = self.counts(completion)
        return body

    def chunk(self, out: RequestOutput | CompletionOutput, start: int,
              request: RequestOutput | None = None) -> dict[str, Any] | None:
        """The chunk for tokens ``start:`` of ``out`` (None when it would carry nothing).

        ``out`` is the request's output, or one sample of it (n > 1) with ``request`` the request's.
        """
        request = request if request is not None else out  # type: ignore[assignment]
        assert isinstance(request, RequestOutput)
        if self.prompt_only:  # one chunk, once the engine's one token is made
            return self._chunk(self._prompt_choice(request), 0) if out.finished else None
        new_tokens = len(out.token_ids) > start
        logprobs = self._logprobs(out, start) if new_tokens else None
        echo_now = self.echo is not None and not self._echo_sent and not self.chat
        if not out.new_text and not out.finished and not new_tokens and not echo_now:
            return None  # nothing new (a prompt chunk)
        # New tokens whose text is held back (part of a character, or of a stop string) still get a chunk, with
        # empty text, as vLLM's server sends: a client sees each token when it is made (its time to first token
        # and inter-token latencies), and the text follows with a later chunk.
        choice: dict[str, Any] = {"index": self.index}
        finish_reason = out.finish_reason
        if self.chat and self.chat_output is not None:
            choice["delta"] = self.chat_output.delta(out.new_text, out.finished)
            if not choice["delta"] and not out.finished and logprobs is None:
                return None  # held back (maybe part of a tag)
            finish_reason = self.chat_output.finish_reason(finish_reason)
        elif self.chat:
            choice["delta"] = {"content": out.new_text} if out.new_text or not out.finished else {}
        else:
            choice["text"] = out.new_text
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish_reason if out.finished else None
        choice["stop_reason"] = out.stop_reason
        self._with_prompt(choice, request)
        return self._chunk(choice, len(out.token_ids))

    def usage_chunk(self, out: RequestOutput) -> dict[str, Any]:
        """The last chunk of a stream with ``stream_options.include_usage``."""
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = self.usage(out)
        return body


def _utf8_chars() -> codecs.IncrementalDecoder:
    """Bytes in, the characters they complete out (a partial character waits for its next bytes)."""
    return codecs.getincrementaldecoder("utf-8")(errors="replace")
