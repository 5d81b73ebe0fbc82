"""Incremental detokenization with stop strings, one instance per request (rank 0).

Tokens arrive one at a time, but text cannot be decoded token by token: a
multi-byte UTF-8 character may be split over several byte-level tokens, and
some tokenizers drop a leading space when a token is decoded on its own. So we
keep two offsets into the token list, in the style of vLLM and TGI:

    ids:  ... [prefix_offset ......... read_offset ......... end)
                 already emitted (context)   not yet emitted

and decode the window ``ids[prefix_offset:]``. The text beyond the decoding of
``ids[prefix_offset:read_offset]`` is new. When it does not end in U+FFFD it
is complete and both offsets move forward; when it does, the last character is
still incomplete, so only the text before the trailing U+FFFD run is taken and
the window keeps growing. Offsets only move on a character boundary, so the
deltas add up exactly to decoding all generated tokens at once.

Stop strings: once the text contains one, it is cut just before it and the
request is stopped. While streaming, the longest tail of the text that could
still grow into a stop string is held back, so a delta never contains any part
of a stop string; :meth:`IncrementalDetokenizer.flush` hands the held-back text
over when the request ends for another reason.

The engine does not pass the EOS or stop token that ends a request to
:meth:`IncrementalDetokenizer.add` (that token stays in ``token_ids`` but never
in the text), so this class just decodes what it is given.
"""

from __future__ import annotations

from typing import Any

from rtp.log import get_logger
from rtp.sampling import SamplingParams

logger = get_logger(__name__)

# How many prompt tokens serve as decoding context for the first generated
# token (enough for a leading space or a character split at the boundary).
_PROMPT_CONTEXT = 6
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas that are safe to stream.

    ``tokenizer`` is a Hugging Face fast tokenizer. The concatenation of every
    delta returned by :meth:`add` plus :meth:`flush` equals :attr:`text`.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        self._stop_strings = list(params.stop_strings)
        self._max_stop_len = max((len(s) for s in self._stop_strings), default=0)

        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        if context and self._decode(context).endswith(_REPLACEMENT):
            # The prompt ends inside a character: it is no clean boundary to
            # continue from, so decode the output on its own.
            context = []
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text: str | None = None  # cached decode of ids[prefix_offset:read_offset]
        self._window_consumed = 0  # chars past prefix_text already handed over from the current window

        # Stop strings count only once min_tokens tokens were generated (as stop tokens do):
        # text decoded before that can neither match nor be held back.
        self._min_tokens = params.min_tokens
        self._num_added = 0
        self._stop_floor = 0  # matches must start at or after this index of _text
        self._text = ""  # decoded output (cut before a stop string once one matched)
        self._emitted = 0  # characters of _text already returned to the caller
        self._stopped = False

    @property
    def text(self) -> str:
        """The output text decoded so far, held-back text included."""
        return self._text

    @property
    def stopped(self) -> bool:
        """True once a stop string matched."""
        return self._stopped

    def add(self, token_id: int) -> tuple[str, bool]:
        """Add one generated token; returns (text safe to emit now, stopped by a stop string)."""
        if self._stopped:
            return "", True
        self._ids.append(token_id)
        self._num_added += 1
        new_text = self._decode_new(final=False)
        if not new_text:
            return "", False
        return self._append(new_text)

    def flush(self) -> str:
        """At the end of the request: the text still held back (never part of a stop string).

        Tokens that never completed a character are decoded as they are (with
        U+FFFD), as a one-shot decode of all tokens would.
        """
        out = ""
        if not self._stopped and self._read_offset < len(self._ids):
            new_text = self._decode_new(final=True)
            if new_text:
                out, _ = self._append(new_text)
        if not self._stopped:
            out += self._text[self._emitted :]
            self._emitted = len(self._text)
        return out

    def _decode(self, ids: list[int]) -> str:
        # No cleanup of tokenization spaces: it is not additive over windows.
        return self._tokenizer.decode(
            ids, skip_special_tokens=self._skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def _decode_new(self, final: bool) -> str:
        """Text of the tokens past read_offset that became stable with the latest token."""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(self._ids[self._prefix_offset :])
        # Empty when, e.g., only skipped special tokens were added; they stay in the window.
        new_text = window_text[len(self._prefix_text) :]
        complete = final or not new_text.endswith(_REPLACEMENT)
        # While a character is incomplete, the text before it is already final:
        # hand it over now so that stop strings are seen as early as possible.
        stable = new_text if complete else new_text.rstrip(_REPLACEMENT)
        out = stable[self._window_consumed :]
        if complete and new_text:
            # The emitted chunk becomes the context of the next window; older
            # ids are never needed again.
            del self._ids[: self._read_offset]
            self._prefix_offset, self._read_offset = 0, len(self._ids)
            self._prefix_text = None
            self._window_consumed = 0
        else:
            self._window_consumed += len(out)
        return out

    def _append(self, new_text: str) -> tuple[str, bool]:
        """Append decoded text, check the stop strings, and return what may be emitted."""
        # A new match must end inside new_text, so it starts at most
        # max_stop_len - 1 characters before it.
        search_from = max(self._stop_floor, len(self._text) - self._max_stop_len + 1)
        self._text += new_text
        if self._num_added < self._min_tokens:
            self._stop_floor = len(self._text)
        if not self._stop_strings or self._num_added < self._min_tokens:
            out = self._text[self._emitted :]
            self._emitted = len(self._text)
            return out, False

        match = min(
            (pos for s in self._stop_strings if (pos := self._text.find(s, search_from)) >= 0),
            default=-1,
        )
        if match >= 0:
            # Held-back text covers every partial stop string, so nothing
            # emitted so far can belong to this match.
            assert match >= self._emitted, (match, self._emitted)
            self._text = self._text[:match]
            self._stopped = True
            out = self._text[self._emitted :]
            self._emitted = len(self._text)
            return out, True

        safe_end = len(self._text) - self._partial_stop_len()
        assert safe_end >= self._emitted, (safe_end, self._emitted)
        out = self._text[self._emitted : safe_end]
        self._emitted = safe_end
        return out, False

    def _partial_stop_len(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stop_strings:
            for n in range(min(len(stop) - 1, len(self._text)), longest, -1):
                if self._text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
