"""StepPlan: what rank 0 tells every rank to compute in one step.

Batch order of one step is ``new_seqs`` followed by ``cached_seqs``; each
contributes ``num_new_tokens`` consecutive query tokens to the flattened batch.

Workers keep a mirror of every running sequence (token ids, block table,
number of computed tokens), so a sequence is sent in full only when it is
(re)scheduled for the first time, and as a small delta afterwards.

Mirror invariant used by the delta encoding: after a step in which a sequence's
chunk reached the end of its known tokens, rank 0 sampled exactly one token for
it; unless the sequence was freed, the next delta carries that token.
"""

from __future__ import annotations

import struct
import sys
import zlib
from array import array
from dataclasses import dataclass, field
from enum import IntEnum
from itertools import accumulate

import numpy as np

from rtp.errors import RtpError


class StepKind(IntEnum):
    """What a message asks the ranks to do."""

    STEP = 0  # run the forward pass of the plan
    SHUTDOWN = 1  # leave the worker loop and exit cleanly
    HEALTH = 2  # no-op round trip (liveness probe)
    PROFILE = 3  # reserved: toggle the profiler


@dataclass
class NewSeq:
    """A sequence scheduled for the first time (or again after preemption)."""

    seq_id: int
    token_ids: list[int]  # every known token: prompt + tokens generated so far
    block_table: list[int]  # KV block ids, in order
    num_computed_tokens: int  # tokens whose KV is already in the cache (prefix-cache hit)
    num_new_tokens: int  # query length of this step (a prefill chunk)


@dataclass
class CachedSeq:
    """A sequence the workers already mirror: only what changed."""

    seq_id: int
    num_new_tokens: int  # query length of this step (1 for decode)
    new_token_ids: list[int]  # tokens appended since the last step (the sampled one)
    new_block_ids: list[int]  # blocks appended to the block table since the last step


@dataclass
class StepPlan:
    """One step's metadata, identical on every rank."""

    kind: StepKind = StepKind.STEP
    new_seqs: list[NewSeq] = field(default_factory=list)
    cached_seqs: list[CachedSeq] = field(default_factory=list)
    freed_seq_ids: list[int] = field(default_factory=list)  # finished, aborted or preempted

    @property
    def num_tokens(self) -> int:
        """Total number of query tokens in this step."""
        return sum(s.num_new_tokens for s in self.new_seqs) + sum(
            s.num_new_tokens for s in self.cached_seqs
        )


# ----------------------------------------------------------------------------
# Wire format
#
# A message is a fixed header followed by flat little-endian arrays:
#
#   header  magic "RTPS" | version u8 | kind u8 | 7 count-dtype codes u8 | pad
#           n_new u32 | n_cached u32 | n_freed u32
#           totals u32 x4 (flat lengths: new tokens, new blocks, cached new
#           tokens, cached new blocks) | body_len u32 | crc32 u32
#   body    int32 arrays first (ids, token ids, block ids), so they stay
#           4-byte aligned after the 52-byte header:
#             new_seq_ids [n_new], new_tokens [tot0], new_blocks [tot1],
#             cached_seq_ids [n_cached], cached_tokens [tot2],
#             cached_blocks [tot3], freed_seq_ids [n_freed]
#           then the seven count arrays, each in the smallest encoding that
#           holds this message's values (uniform / u8 / u16 / u32):
#             new: token counts, block counts, num_computed, num_new [n_new]
#             cached: num_new, token counts, block counts [n_cached]
#
# The crc32 covers the header (minus the crc field) and the body, so a
# corrupted or truncated buffer is rejected instead of decoded into garbage.
# A decode step of 256 sequences costs 52 + 256*4 (ids) + 256*4 (tokens) + 3*4
# (three uniform count arrays) = 2112 bytes.
# ----------------------------------------------------------------------------

_MAGIC = b"RTPS"
WIRE_VERSION = 1
_HEADER = struct.Struct("<4sBB7s3x9I")
_CRC_OFFSET = _HEADER.size - 4  # the crc32 is the last header field
_INT32 = np.dtype("<i4")
_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1
_U32_MAX = 2**32 - 1

# Count-array encodings. _UNIFORM stores one u32 that every element equals.
_UNIFORM = 0
_UINT_DTYPES = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 3: np.dtype("<u4")}
_UINT_TYPECODES = {1: "B", 2: "H", 3: "I"}
_BIG_ENDIAN_HOST = sys.byteorder == "big"
assert array("i").itemsize == 4 and array("I").itemsize == 4 and array("H").itemsize == 2


class StepFormatError(RtpError, ValueError):
    """A StepPlan cannot be encoded, or a buffer is not a valid encoded StepPlan."""


def _int_array(typecode: str, values: list[int], what: str, lo: int, hi: int) -> array:
    """``values`` as a little-endian ``array`` of ``typecode``; ints in ``[lo, hi]`` only."""
    try:
        arr = array(typecode, values)
    except (OverflowError, TypeError):
        bad = next((v for v in values if not isinstance(v, int) or not lo <= v <= hi), None)
        raise StepFormatError(f"{what} must be integers in [{lo}, {hi}], got {bad!r}") from None
    if _BIG_ENDIAN_HOST:
        arr.byteswap()
    return arr


def _pack_int32(values: list[int], what: str) -> bytes:
    return _int_array("i", values, what, _I32_MIN, _I32_MAX).tobytes()


def _pack_counts(values: list[int], what: str) -> tuple[int, bytes, int]:
    """Encode non-negative counts compactly; returns (code, bytes, sum)."""
    if not values:
        return 1, b"", 0
    first = values[0]
    if len(values) > 4 and isinstance(first, int) and 0 <= first <= _U32_MAX and values.count(first) == len(values):
        # Fast path for the decode step (every count equal): one u32, no per-element work.
        return _UNIFORM, struct.pack("<I", first), first * len(values)
    lo, hi = min(values), max(values)
    if lo < 0 or hi > _U32_MAX:
        bad = lo if lo < 0 else hi
        raise StepFormatError(f"{what} must be integers in [0, {_U32_MAX}], got {bad!r}")
    code = 1 if hi <= 0xFF else 2 if hi <= 0xFFFF else 3
    arr = _int_array(_UINT_TYPECODES[code], values, what, 0, _U32_MAX)  # also rejects non-ints
    if lo == hi and len(values) * arr.itemsize > 4:
        return _UNIFORM, struct.pack("<I", hi), hi * len(values)
    return code, arr.tobytes(), sum(values)


def encode(plan: StepPlan) -> bytes:
    """Serialize ``plan`` into the explicit binary wire format (see module comment)."""
    try:
        kind = StepKind(plan.kind)
    except ValueError:
        raise StepFormatError(f"unknown StepKind {plan.kind!r}; allowed: {[k.name for k in StepKind]}") from None
    new, cached = plan.new_seqs, plan.cached_seqs

    int_parts = [
        _pack_int32([s.seq_id for s in new], "NewSeq.seq_id"),
        _pack_int32([t for s in new for t in s.token_ids], "NewSeq.token_ids"),
        _pack_int32([b for s in new for b in s.block_table], "NewSeq.block_table"),
        _pack_int32([s.seq_id for s in cached], "CachedSeq.seq_id"),
        _pack_int32([t for s in cached for t in s.new_token_ids], "CachedSeq.new_token_ids"),
        _pack_int32([b for s in cached for b in s.new_block_ids], "CachedSeq.new_block_ids"),
        _pack_int32(plan.freed_seq_ids, "StepPlan.freed_seq_ids"),
    ]
    counts = [
        _pack_counts([len(s.token_ids) for s in new], "len(NewSeq.token_ids)"),
        _pack_counts([len(s.block_table) for s in new], "len(NewSeq.block_table)"),
        _pack_counts([s.num_computed_tokens for s in new], "NewSeq.num_computed_tokens"),
        _pack_counts([s.num_new_tokens for s in new], "NewSeq.num_new_tokens"),
        _pack_counts([s.num_new_tokens for s in cached], "CachedSeq.num_new_tokens"),
        _pack_counts([len(s.new_token_ids) for s in cached], "len(CachedSeq.new_token_ids)"),
        _pack_counts([len(s.new_block_ids) for s in cached], "len(CachedSeq.new_block_ids)"),
    ]
    totals = [counts[0][2], counts[1][2], counts[5][2], counts[6][2]]
    if max(totals + [len(new), len(cached), len(plan.freed_seq_ids)]) > _U32_MAX:
        raise StepFormatError("a StepPlan array is longer than 2**32-1 elements")
    body = b"".join(int_parts + [c[1] for c in counts])
    header = _HEADER.pack(
        _MAGIC,
        WIRE_VERSION,
        int(kind),
        bytes(c[0] for c in counts),
        len(new),
        len(cached),
        len(plan.freed_seq_ids),
        *totals,
        len(body),
        0,
    )
    crc = zlib.crc32(body, zlib.crc32(memoryview(header)[:_CRC_OFFSET]))
    return header[:_CRC_OFFSET] + struct.pack("<I", crc) + body


class _Reader:
    """Cursor over the body; every read is bounds-checked."""

    def __init__(self, buf: memoryview, offset: int) -> None:
        self.buf, self.pos = buf, offset

    def take(self, nbytes: int, what: str) -> memoryview:
        end = self.pos + nbytes
        if end > len(self.buf):
            raise StepFormatError(f"truncated StepPlan buffer while reading {what}")
        view, self.pos = self.buf[self.pos : end], end
        return view

    def int32(self, n: int, what: str) -> list[int]:
        return np.frombuffer(self.take(4 * n, what), dtype=_INT32).tolist()

    def counts(self, code: int, n: int, what: str) -> list[int]:
        if n == 0 and code != _UNIFORM:
            return []
        if code == _UNIFORM:
            (value,) = struct.unpack("<I", self.take(4, what))
            return [value] * n
        dtype = _UINT_DTYPES[code]
        return np.frombuffer(self.take(dtype.itemsize * n, what), dtype=dtype).tolist()


def _split(flat: list[int], lengths: list[int]) -> list[list[int]]:
    """Cut ``flat`` into consecutive lists of the given lengths."""
    if lengths and lengths.count(lengths[0]) == len(lengths):
        # Uniform lengths (the decode case: one token, zero blocks): no running offset.
        n = lengths[0]
        if n == 0:
            return [[] for _ in lengths]
        if n == 1:
            return [[x] for x in flat]
        return [flat[i : i + n] for i in range(0, len(flat), n)]
    ends = accumulate(lengths)
    return [flat[end - n : end] for end, n in zip(ends, lengths)]


def decode(buf: bytes | bytearray | memoryview) -> StepPlan:
    """Parse a buffer produced by :func:`encode`; raises StepFormatError (a ValueError) if invalid."""
    mv = memoryview(buf).cast("B") if not isinstance(buf, (bytes, bytearray)) else memoryview(buf)
    if len(mv) < _HEADER.size:
        raise StepFormatError(f"StepPlan buffer too short: {len(mv)} bytes, the header alone is {_HEADER.size}")
    magic, version, kind, codes, n_new, n_cached, n_freed, *totals, body_len, crc = _HEADER.unpack_from(mv)
    if magic != _MAGIC:
        raise StepFormatError(f"not a StepPlan buffer: magic {magic!r}, expected {_MAGIC!r}")
    if version != WIRE_VERSION:
        raise StepFormatError(f"StepPlan wire version {version}; this build reads version {WIRE_VERSION}")
    if len(mv) != _HEADER.size + body_len:
        raise StepFormatError(
            f"StepPlan buffer is {len(mv)} bytes but its header announces {_HEADER.size + body_len} "
            "(truncated or trailing bytes)"
        )
    if zlib.crc32(mv[_HEADER.size :], zlib.crc32(mv[:_CRC_OFFSET])) != crc:
        raise StepFormatError("StepPlan buffer failed its crc32 check (corrupted)")
    try:
        step_kind = StepKind(kind)
    except ValueError:
        raise StepFormatError(f"unknown StepKind {kind} in StepPlan buffer") from None
    for code in codes:
        if code != _UNIFORM and code not in _UINT_DTYPES:
            raise StepFormatError(f"unknown count encoding {code} in StepPlan buffer")

    r = _Reader(mv, _HEADER.size)
    new_ids = r.int32(n_new, "new seq ids")
    new_tokens = r.int32(totals[0], "new seq token ids")
    new_blocks = r.int32(totals[1], "new seq block tables")
    cached_ids = r.int32(n_cached, "cached seq ids")
    cached_tokens = r.int32(totals[2], "cached seq new token ids")
    cached_blocks = r.int32(totals[3], "cached seq new block ids")
    freed = r.int32(n_freed, "freed seq ids")
    sizes = [n_new] * 4 + [n_cached] * 3
    c = [r.counts(code, n, f"count array {i}") for i, (code, n) in enumerate(zip(codes, sizes))]
    if r.pos != len(mv):
        raise StepFormatError(f"StepPlan buffer has {len(mv) - r.pos} unexpected trailing bytes")
    checks = ((c[0], totals[0], "new token"), (c[1], totals[1], "new block"),
              (c[5], totals[2], "cached token"), (c[6], totals[3], "cached block"))
    for lengths, total, what in checks:
        if sum(lengths) != total:
            raise StepFormatError(
                f"StepPlan buffer is inconsistent: {what} counts sum to {sum(lengths)}, header says {total}"
            )

    new_seqs = [
        NewSeq(i, t, b, nc, nn)
        for i, t, b, nc, nn in zip(new_ids, _split(new_tokens, c[0]), _split(new_blocks, c[1]), c[2], c[3])
    ]
    cached_seqs = [
        CachedSeq(i, nn, t, b)
        for i, nn, t, b in zip(cached_ids, c[4], _split(cached_tokens, c[5]), _split(cached_blocks, c[6]))
    ]
    return StepPlan(kind=step_kind, new_seqs=new_seqs, cached_seqs=cached_seqs, freed_seq_ids=freed)
