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
over when the request ends for another reason. Only the text's last
``max(len(stop)) - 1`` characters can take part in a later match, so only they
are searched: the text before them is kept as chunks, joined when
:attr:`IncrementalDetokenizer.text` is read. A token then costs the same
whatever the length of the output so far (a string grown by ``+`` is copied
whole on every token).

The engine does not pass the EOS or stop token that ends a request to
:meth:`IncrementalDetokenizer.add` (that token stays in ``token_ids`` but not
in the text, unless ``include_stop_str_in_output``, as vLLM's: see
:meth:`IncrementalDetokenizer.with_text`), so this class just decodes what it is given.

Cost: this runs once per generated token on rank 0 for every running request,
on the step's critical path, so :class:`TokenDecoder` makes decoding cheap:

* It calls the Rust tokenizer directly (the Hugging Face ``decode`` wrapper
  costs several times the decode itself), and remembers the text of single
  tokens.
* Byte-level decoders (GPT-2 style, Qwen's) are *additive at character
  boundaries*: when ``decode(a)`` does not end in U+FFFD, the bytes of ``a``
  end on a complete character, so ``decode(a + b) == decode(a) + decode(b)``
  (the text is the lossy UTF-8 decoding of the tokens' bytes, concatenated).
  The window's context always ends on such a boundary, so while no token is
  pending, a new token's text is its remembered single-token text: no decode
  at all. Tokens that leave a character incomplete, or add no text, take the
  window path above. Other decoders (Metaspace, WordPiece, ...) always do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenizers import decoders

from rtp.log import get_logger
from rtp.outputs import joined
from rtp.sampling import SamplingParams

logger = get_logger(__name__)

# How many prompt tokens serve as decoding context for the first generated
# token (enough for a leading space or a character split at the boundary).
_PROMPT_CONTEXT = 6
_REPLACEMENT = "\ufffd"


def _has_plain_decode(tokenizer: Any) -> bool:
    """True when ``tokenizer.decode(ids, skip_special_tokens=s, clean_up_tokenization_spaces=False)``
    is exactly ``tokenizer.backend_tokenizer.decode(ids, s)``: a fast tokenizer whose class keeps the
    ``decode``/``_decode`` of the transformers base classes (a subclass that overrides them may do more)."""
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        return False
    cls = type(tokenizer)
    # transformers 5 names the fast base class TokenizersBackend, transformers 4 PreTrainedTokenizerFast.
    plain_inner = {"TokenizersBackend._decode", "PreTrainedTokenizerFast._decode"}
    decode, inner = getattr(cls, "decode", None), getattr(cls, "_decode", None)
    return (
        getattr(decode, "__qualname__", None) == "PreTrainedTokenizerBase.decode"
        and getattr(inner, "__qualname__", None) in plain_inner
    )


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable bytes stand for themselves, the other 68 for
    the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {b: chr(b) for b in printable}
    for b in (b for b in range(256) if b not in chars):
        chars[b] = chr(0x100 + len(chars) - len(printable))
    return {c: b for b, c in chars.items()}


_BYTE_OF = _byte_level_alphabet()


class TokenBytes:
    """Token id -> the UTF-8 bytes the token stands for, also where they are only part of a character (OpenAI's
    logprob ``bytes``): read from a byte-level vocabulary's token string (Qwen's, GPT-2's) or a ``<0xNN>``
    byte-fallback token; else the token's decoded text (U+FFFD for a partial character). Remembered per id."""

    def __init__(self, tokenizer: Any) -> None:  # noqa: ANN401
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._tokenizer = tokenizer
        self._byte_level = backend is not None and isinstance(backend.decoder, decoders.ByteLevel)
        self._added = set(getattr(tokenizer, "added_tokens_decoder", {}))  # their text is themselves
        self._memo: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        found = self._memo.get(token_id)
        if found is None:
            found = self._memo[token_id] = self._bytes(token_id)
        return found

    def _bytes(self, token_id: int) -> bytes:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and token_id not in self._added:
            if self._byte_level and all(c in _BYTE_OF for c in piece):
                return bytes(_BYTE_OF[c] for c in piece)
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                return bytes.fromhex(piece[3:5])
        return self._tokenizer.decode([token_id]).encode()


class TokenDecoder:
    """``tokenizer.decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)``, made cheap.

    Calls the Rust tokenizer behind a Hugging Face fast tokenizer directly when
    that is what ``decode`` would do (see :func:`_has_plain_decode`), else the
    tokenizer's own ``decode``. The text of each single token is remembered
    (at most one entry per vocabulary id and ``skip_special_tokens`` value).
    One instance may serve every request of an engine, from any thread; ``ids``
    must be a list of Python ints.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.uses_backend = _has_plain_decode(tokenizer)
        """True when decoding calls the Rust tokenizer directly."""
        self.additive = self.uses_backend and isinstance(tokenizer.backend_tokenizer.decoder, decoders.ByteLevel)
        """True when decode(a + b) == decode(a) + decode(b) whenever decode(a) does not end in U+FFFD
        (a byte-level decoder; see the module docstring)."""
        self.raw_decode: Callable[[list[int], bool], str] = (
            tokenizer.backend_tokenizer.decode if self.uses_backend else self._hf_decode
        )
        """(ids, skip_special_tokens) -> text, without the memo."""
        self._single: dict[bool, dict[int, str]] = {False: {}, True: {}}  # skip_special_tokens -> id -> text

    def _hf_decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        # No cleanup of tokenization spaces: it is not additive over windows.
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        """The text of ``ids``."""
        if len(ids) == 1:
            return self.decode_one(ids[0], skip_special_tokens)
        return self.raw_decode(ids, skip_special_tokens)

    def decode_one(self, token_id: int, skip_special_tokens: bool) -> str:
        """The text of the single token ``token_id`` (remembered)."""
        memo = self._single[skip_special_tokens]
        text = memo.get(token_id)
        if text is None:
            text = memo[token_id] = self.raw_decode([token_id], skip_special_tokens)
        return text

    def memo(self, skip_special_tokens: bool) -> dict[int, str]:
        """The remembered single-token texts (id -> text) for ``skip_special_tokens``, to read from."""
        return self._single[skip_special_tokens]


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas that are safe to stream.

    ``tokenizer`` is a Hugging Face fast tokenizer, or a :class:`TokenDecoder`
    around one (an engine shares one among its requests). The concatenation of
    every delta returned by :meth:`add` (and :meth:`flush`) is :attr:`text`.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        decoder = tokenizer if isinstance(tokenizer, TokenDecoder) else TokenDecoder(tokenizer)
        self._decoder = decoder
        self._skip_special_tokens = params.skip_special_tokens
        self._additive = decoder.additive
        self._memo = decoder.memo(params.skip_special_tokens)  # read directly on the hot path
        self._stop_strings = list(params.stop_strings)
        self._keep_stop = params.include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self._stop_strings), default=0)
        # A tail of the text can only be the start of a stop string if it ends in one of these.
        self._stop_heads = frozenset(c for stop in self._stop_strings for c in stop[:-1])

        context = [int(t) for t in prompt_token_ids[-_PROMPT_CONTEXT:]]
        if context and self._decode(context).endswith(_REPLACEMENT):
            # The prompt ends inside a character: it is no clean boundary to
            # continue from, so decode the output on its own.
            context = []
        # The decoding window: ids[:read_offset] is context (already emitted, or
        # prompt), ids[read_offset:] is not emitted yet. Older ids are dropped,
        # so prefix_offset is always 0. The context always ends on a character
        # boundary (its text does not end in U+FFFD, or it is empty).
        self._ids: list[int] = context
        self._read_offset = len(context)
        self._prefix_text: str | None = None  # cached decode of ids[:read_offset]
        self._window_consumed = 0  # chars past prefix_text already handed over from the current window

        # Stop strings count only once min_tokens tokens were generated (as stop tokens do):
        # text decoded before that can neither match nor be held back.
        self._min_tokens = params.min_tokens
        self._num_added = 0
        self._stop_floor = 0  # matches must start at or after this index of the text
        # The decoded output (cut before a stop string once one matched) is "".join(_done) + _tail: _tail is
        # what a later stop string can still overlap (the last max_stop_len - 1 characters; empty without stop
        # strings) and starts at index _tail_start of the text.
        self._done: list[str] = []
        self._tail = ""
        self._tail_start = 0
        self._emitted = 0  # characters of the text already returned to the caller
        self.stop_string: str | None = None
        """The stop string that matched, once one did."""

    @property
    def text(self) -> str:
        """The output text returned so far: the deltas of :meth:`add` and :meth:`flush` concatenated (the
        held-back text is not in it until :meth:`flush` or a stop string lets it out, as in vLLM's outputs)."""
        # _done is all returned: the held-back text is inside the tail.
        return joined(self._done) + self._tail[: self._emitted - self._tail_start]

    @property
    def stopped(self) -> bool:
        """True once a stop string matched."""
        return self.stop_string is not None

    def with_text(self, tokens: list[int], stop_token_last: bool) -> list[int]:
        """The ``tokens`` to :meth:`add`: where the last one is the stop or EOS token ending the output
        (``stop_token_last``), it has no text unless include_stop_str_in_output (as vLLM's)."""
        return tokens[:-1] if stop_token_last and not self._keep_stop else tokens

    def add(self, token_id: int) -> tuple[str, bool]:
        """Add one generated token; returns (text safe to emit now, stopped by a stop string)."""
        if self.stop_string is not None:
            return "", True
        self._num_added += 1
        new_text = None
        if self._additive and self._read_offset == len(self._ids):
            # No token pending and the context ends on a character boundary: the
            # window's new text is this token's own text (module docstring).
            text = self._memo.get(token_id)
            if text is None:
                text = self._decoder.decode_one(token_id, self._skip_special_tokens)
            if text and text[-1] != _REPLACEMENT:  # complete: it becomes the whole context
                self._ids = [token_id]
                self._read_offset = 1
                self._prefix_text = new_text = text
        if new_text is None:
            self._ids.append(token_id)
            new_text = self._decode_new(final=False)
            if not new_text:
                return "", False
        if not self._stop_strings:  # nothing to match or hold back: all of it goes out now
            self._done.append(new_text)
            self._emitted = self._tail_start = self._tail_start + len(new_text)  # (the tail stays empty)
            return new_text, False
        return self._append(new_text)

    def flush(self) -> str:
        """At the end of the request: the text still held back (never part of a stop string).

        Tokens that never completed a character are decoded as they are (with
        U+FFFD), as a one-shot decode of all tokens would.
        """
        out = ""
        if self.stop_string is None and self._read_offset < len(self._ids):
            new_text = self._decode_new(final=True)
            if new_text:
                out, _ = self._append(new_text)
        if self.stop_string is None:
            out += self._tail[self._emitted - self._tail_start :]  # held back: always inside the tail
            self._emitted = self._tail_start + len(self._tail)
        return out

    def _decode(self, ids: list[int]) -> str:
        return self._decoder.decode(ids, self._skip_special_tokens)

    def _decode_new(self, final: bool) -> str:
        """Text of the tokens past read_offset that became stable with the latest token."""
        ids = self._ids
        prefix_text = self._prefix_text
        if prefix_text is None:
            prefix_text = self._prefix_text = self._decode(ids[: self._read_offset]) if self._read_offset else ""
        # Empty when, e.g., only skipped special tokens were added; they stay in the window.
        new_text = self._decode(ids)[len(prefix_text) :]
        if not new_text:
            return ""
        if final or new_text[-1] != _REPLACEMENT:
            out = new_text[self._window_consumed :] if self._window_consumed else new_text
            # The emitted chunk becomes the context of the next window; older
            # ids are never needed again. (After a final decode that left a
            # character incomplete, nothing is: the context must end on a boundary.)
            del ids[: len(ids) if final and new_text[-1] == _REPLACEMENT else self._read_offset]
            self._read_offset = len(ids)
            self._prefix_text = None
            self._window_consumed = 0
            return out
        # While a character is incomplete, the text before it is already final:
        # hand it over now so that stop strings are seen as early as possible.
        out = new_text.rstrip(_REPLACEMENT)[self._window_consumed :]
        self._window_consumed += len(out)
        return out

    def _append(self, new_text: str) -> tuple[str, bool]:
        """Append decoded text, check the stop strings, and return what may be emitted."""
        # text is the output from index base on: the tail (all a new match can overlap) and new_text.
        text, base, emitted = self._tail + new_text, self._tail_start, self._emitted
        end = base + len(text)
        # A new match must end inside new_text, so it starts at most max_stop_len - 1 characters before it
        # (at or after base: the tail holds that many).
        search_from = max(self._stop_floor, base + len(self._tail) - self._max_stop_len + 1) - base
        if self._num_added < self._min_tokens:  # stop strings do not count yet
            self._stop_floor = self._emitted = end
            self._keep(text, base)
            return text[emitted - base :], False

        match, stop_end, matched = -1, -1, None
        for stop in self._stop_strings:
            pos = text.find(stop, search_from)
            if pos >= 0 and (match < 0 or pos < match):
                match, stop_end, matched = pos, pos + len(stop), stop
        if match >= 0:
            self.stop_string = matched
            # Held-back text covers every partial stop string, so nothing
            # emitted so far can belong to this match.
            assert match + base >= emitted, (match + base, emitted)
            cut = stop_end if self._keep_stop else match  # (text after the stop string is dropped either way)
            self._tail = text[:cut]
            self._emitted = base + cut
            return text[emitted - base : cut], True

        # Held back: the longest end of the text that may grow into a stop string, never text before the
        # floor (stop strings do not count there).
        floor = max(0, self._stop_floor - base)
        safe_end = len(text) - self._partial_stop_len(text[floor:]) if text[-1] in self._stop_heads else len(text)
        assert safe_end + base >= emitted, (safe_end + base, emitted)
        self._emitted = base + safe_end
        self._keep(text, base)
        return text[emitted - base : safe_end], False

    def _keep(self, text: str, base: int) -> None:
        """Store ``text`` (the output from index ``base`` on) as done chunks and the tail a later match can overlap
        (the held-back text is always inside it: it is shorter than a stop string)."""
        cut = max(0, len(text) - max(0, self._max_stop_len - 1))
        if cut:
            self._done.append(text[:cut])
        self._tail, self._tail_start = text[cut:], base + cut

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest tail of ``text`` (the output's end) that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stop_strings:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
