"""The messages between rank 0's engine loop and the API frontend processes, and their encoding.

Every message is one frame on a Unix-domain stream socket: ``u32 length``,
``u8 kind``, then the payload (little-endian throughout). The kinds:

=========  ===================  ==============================================================
kind       direction            payload
=========  ===================  ==============================================================
HELLO      engine -> frontend   JSON: the config, the model and what the frontend validates with
READY      frontend -> engine   empty: the frontend accepts connections
ADD        frontend -> engine   an :class:`EngineRequest`: JSON head, then the prompt as int32
ABORT      frontend -> engine   u32 handles of requests to abort
OUTPUTS    engine -> frontend   a :class:`StepOutputs`: every changed request of one step
FAIL       engine -> frontend   UTF-8: the runtime failed; every stream ends with this error
SHUTDOWN   both ways            empty: stop gracefully (the server received SIGTERM); from a frontend: it
                                stopped gracefully (another node's replica, which got no signal, stops too)
BEAT       frontend -> engine   empty: the frontend's event loop runs (every HELLO's ``beat_interval_s``)
=========  ===================  ==============================================================

A request is known on the wire by a ``handle``, a u32 its frontend chose; the
engine's request id is the frontend's (unique per frontend: a uuid). One
OUTPUTS frame per step per frontend carries the new tokens of every request
of that frontend that changed, as flat arrays, so the engine builds no
Python object per streamed chunk and the frontend decodes one frame per step::

    head    struct  num_updates U, stats (len(STAT_KEYS) float64), trailer length
    handle  u32[U]  sample u16[U]  num_tokens u16[U]  finish u8[U]  num_cached u32[U]
    tokens  i32[sum(num_tokens)]
    logprob entries of the updates whose finish byte has LOGPROBS set: per token a u16 count
            (NO_LOGPROBS: None), then the (i32 id, f64 logprob) pairs of every entry
    trailer JSON, only when something rare happened: {"errors": {handle: message},
            "prompt_logprobs": {handle: [null | [[id, logprob, rank], ...], ...]}}

Text is not on the wire: detokenization and stop strings run in the frontend.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from rtp.outputs import Logprob
from rtp.sampling import SamplingParams
from rtp.structured import GrammarSpec

_FRAME = struct.Struct("<IB")  # payload length (kind byte included), kind
MAX_FRAME_BYTES = 1 << 30


class Kind(IntEnum):
    HELLO = 1
    READY = 2
    ADD = 3
    ABORT = 4
    OUTPUTS = 5
    FAIL = 6
    SHUTDOWN = 7
    BEAT = 8


def frame(kind: Kind, payload: bytes | bytearray | memoryview = b"") -> bytes:
    """One framed message."""
    return _FRAME.pack(len(payload) + 1, kind) + bytes(payload)


class FrameReader:
    """Splits a byte stream into (kind, payload) frames; feed it what the socket returned."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[Kind, memoryview]]:
        """Append ``data``; returns the frames completed by it, in order."""
        self._buf += data
        out: list[tuple[Kind, memoryview]] = []
        buf, pos = self._buf, 0
        while len(buf) - pos >= _FRAME.size:
            length, kind = _FRAME.unpack_from(buf, pos)
            if not 1 <= length <= MAX_FRAME_BYTES:
                raise ValueError(f"corrupt frame: length {length}")
            end = pos + 4 + length
            if end > len(buf):
                break
            out.append((Kind(kind), memoryview(bytes(buf[pos + _FRAME.size : end]))))
            pos = end
        del buf[:pos]
        return out


def encode_hello(hello: dict[str, Any]) -> bytes:
    """HELLO: what a frontend needs to serve (the server config, the model, the engine's limits)."""
    return frame(Kind.HELLO, json.dumps(hello).encode())


def decode_hello(payload: memoryview) -> dict[str, Any]:
    return dict(json.loads(bytes(payload)))


# ---------------------------------------------------------------------------- requests

# The SamplingParams fields that travel (``constraint`` is a compiled object: the grammar's spec
# travels instead, and the engine builds its matcher from it).
_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.init and f.name != "constraint")
_ADD_HEAD = struct.Struct("<II")  # handle, JSON length


@dataclass
class EngineRequest:
    """A request as the engine gets it: prompt token ids and sampling parameters, validated by the frontend."""

    handle: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    grammar: GrammarSpec | None = None
    """The structured-output constraint, compiled on the engine side into ``params.constraint``."""

    def encode(self) -> bytes:
        p = self.params
        head: dict[str, Any] = {"id": self.request_id, "params": {k: getattr(p, k) for k in _PARAM_FIELDS}}
        if p.logit_bias is not None:  # JSON keys are strings
            head["params"]["logit_bias"] = [[k, v] for k, v in p.logit_bias.items()]
        if self.grammar is not None:
            g = self.grammar
            head["grammar"] = [g.kind, g.spec, g.field, g.after]
        text = json.dumps(head).encode()
        return frame(Kind.ADD, _ADD_HEAD.pack(self.handle, len(text)) + text
                     + array("i", self.prompt_token_ids).tobytes())

    @staticmethod
    def decode(payload: memoryview) -> EngineRequest:
        handle, n = _ADD_HEAD.unpack_from(payload)
        head = json.loads(bytes(payload[_ADD_HEAD.size : _ADD_HEAD.size + n]))
        ids = array("i")
        ids.frombytes(payload[_ADD_HEAD.size + n :])
        kw = head["params"]
        if kw.get("logit_bias") is not None:
            kw["logit_bias"] = {int(k): v for k, v in kw["logit_bias"]}
        grammar = GrammarSpec(*head["grammar"]) if head.get("grammar") else None
        return EngineRequest(handle, head["id"], ids.tolist(), SamplingParams(**kw), grammar)


def encode_abort(handles: list[int]) -> bytes:
    return frame(Kind.ABORT, array("I", handles).tobytes())


def decode_abort(payload: memoryview) -> list[int]:
    a = array("I")
    a.frombytes(payload)
    return a.tolist()


# ---------------------------------------------------------------------------- step outputs

SPEC_POSITIONS_ON_WIRE = 8
"""Draft positions whose accepted-token counters reach the frontends' /metrics (the first 8 of k)."""

STAT_KEYS = ("num_running", "num_waiting", "kv_usage", "num_blocks", "prefix_hit_tokens", "prefix_query_tokens",
             "num_preemptions", "num_prefill_tokens_computed", "num_decode_tokens",
             "spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens", "spec_num_refused_draft_tokens",
             *(f"spec_accepted_pos_{i}" for i in range(SPEC_POSITIONS_ON_WIRE)))
"""The engine stats (Engine.stats keys) every OUTPUTS frame carries, for the frontends' /metrics."""

FINISH_REASONS = (None, "stop", "length", "abort")
LOGPROBS = 0x80  # finish byte: logprob entries follow for this update's tokens
NO_LOGPROBS = 0xFFFF  # a token's count: no logprobs for it
_OUT_HEAD = struct.Struct(f"<I{len(STAT_KEYS)}dI")
_FINISH_CODE = {r: i for i, r in enumerate(FINISH_REASONS)}


@dataclass
class SampleUpdate:
    """What one step added to one sample of a request (decoded; the frontend's view)."""

    handle: int
    sample: int
    token_ids: list[int]
    finish_reason: str | None
    num_cached_tokens: int
    logprobs: list[dict[int, float] | None] | None = None


@dataclass
class StepOutputs:
    """One OUTPUTS frame, built by the engine update after update (flat arrays, no object per update)."""

    stats: dict[str, float] = field(default_factory=dict)
    handles: array = field(default_factory=lambda: array("I"))
    samples: array = field(default_factory=lambda: array("H"))
    counts: array = field(default_factory=lambda: array("H"))
    finishes: array = field(default_factory=lambda: array("B"))
    cached: array = field(default_factory=lambda: array("I"))
    tokens: array = field(default_factory=lambda: array("i"))
    lp_counts: array = field(default_factory=lambda: array("H"))
    lp_ids: array = field(default_factory=lambda: array("i"))
    lp_values: array = field(default_factory=lambda: array("d"))
    errors: dict[int, str] = field(default_factory=dict)
    prompt_logprobs: dict[int, list[dict[int, float] | None]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.handles) + len(self.errors)

    def add(self, handle: int, sample: int, tokens: list[int], finish_reason: str | None, num_cached: int,
            logprobs: Sequence[dict[int, float] | None] | None = None) -> None:
        """One sample's new tokens (and their logprobs, when the request asked for them)."""
        self.handles.append(handle)
        self.samples.append(sample)
        self.counts.append(len(tokens))
        self.tokens.extend(tokens)
        self.cached.append(num_cached)
        code = _FINISH_CODE[finish_reason]
        if logprobs is not None:
            code |= LOGPROBS
            for lp in logprobs:
                if lp is None:
                    self.lp_counts.append(NO_LOGPROBS)
                    continue
                self.lp_counts.append(len(lp))
                self.lp_ids.extend(lp.keys())
                self.lp_values.extend(lp.values())
        self.finishes.append(code)

    def encode(self) -> bytes:
        trailer = b""
        if self.errors or self.prompt_logprobs:
            plp = {h: [None if e is None else [[t, lp, getattr(lp, "rank", None)] for t, lp in e.items()] for e in v]
                   for h, v in self.prompt_logprobs.items()}
            trailer = json.dumps({"errors": self.errors, "prompt_logprobs": plp}).encode()
        stats = [float(self.stats.get(k, 0.0)) for k in STAT_KEYS]
        parts = [_OUT_HEAD.pack(len(self.handles), *stats, len(trailer)), self.handles.tobytes(),
                 self.samples.tobytes(), self.counts.tobytes(), self.finishes.tobytes(), self.cached.tobytes(),
                 self.tokens.tobytes(), struct.pack("<I", len(self.lp_counts)), self.lp_counts.tobytes(),
                 struct.pack("<I", len(self.lp_ids)), self.lp_ids.tobytes(), self.lp_values.tobytes(), trailer]
        return frame(Kind.OUTPUTS, b"".join(parts))


def decode_outputs(payload: memoryview) -> tuple[dict[str, float], list[SampleUpdate], dict[int, str],
                                                 dict[int, list[dict[int, float] | None]]]:
    """An OUTPUTS frame: (stats, updates in order, errors by handle, prompt logprobs by handle)."""
    n, *rest = _OUT_HEAD.unpack_from(payload)
    stats = dict(zip(STAT_KEYS, rest[:-1]))
    trailer_len = rest[-1]
    pos = _OUT_HEAD.size

    def take(code: str, count: int) -> array:
        nonlocal pos
        a = array(code)
        end = pos + count * a.itemsize
        a.frombytes(payload[pos:end])
        pos = end
        return a

    handles, samples, counts = take("I", n), take("H", n), take("H", n)
    finishes, cached = take("B", n), take("I", n)
    tokens = take("i", sum(counts))
    num_lp = struct.unpack_from("<I", payload, pos)[0]
    pos += 4
    lp_counts = take("H", num_lp)
    num_ids = struct.unpack_from("<I", payload, pos)[0]
    pos += 4
    lp_ids, lp_values = take("i", num_ids), take("d", num_ids)
    updates: list[SampleUpdate] = []
    t = c = e = 0
    for i in range(n):
        k, code = counts[i], finishes[i]
        upd = SampleUpdate(handles[i], samples[i], tokens[t : t + k].tolist(), FINISH_REASONS[code & 0x7F],
                           cached[i])
        t += k
        if code & LOGPROBS:
            lps: list[dict[int, float] | None] = []
            for _ in range(k):
                m = lp_counts[c]
                c += 1
                if m == NO_LOGPROBS:
                    lps.append(None)
                    continue
                lps.append(dict(zip(lp_ids[e : e + m], lp_values[e : e + m])))
                e += m
            upd.logprobs = lps
        updates.append(upd)
    errors: dict[int, str] = {}
    prompt_lps: dict[int, list[dict[int, float] | None]] = {}
    if trailer_len:
        extra = json.loads(bytes(payload[pos : pos + trailer_len]))
        errors = {int(h): m for h, m in extra["errors"].items()}
        prompt_lps = {int(h): [None if v is None else {int(i): Logprob(lp, rank) for i, lp, rank in v} for v in entries]
                      for h, entries in extra["prompt_logprobs"].items()}
    return stats, updates, errors, prompt_lps
