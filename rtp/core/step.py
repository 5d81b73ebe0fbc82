"""StepPlan: what rank 0 tells every rank to compute in one step.

Batch order of one step is ``new_seqs`` followed by ``cached_seqs``; each
contributes ``num_new_tokens`` consecutive query tokens to the flattened batch.

Workers keep a mirror of every running sequence (token ids, block table,
number of computed tokens), so a sequence is sent in full only when it is
(re)scheduled for the first time, and as a small delta afterwards.

A delta first drops ``rollback_tokens`` tokens and ``rollback_blocks`` block
ids from the tail of the mirror (tokens that were cut back on rank 0, such as
rejected speculative tokens; the number of computed tokens is capped to what
is left), then appends ``new_token_ids`` (any number: the sampled token of a
decode step, or several) and ``new_block_ids``.

Speculative decoding: the last ``num_draft_tokens`` of a delta's new tokens
are drafts, not known tokens. The step computes them like any other query
token, and the logits of its last ``1 + num_draft_tokens`` positions come back
(the verification rows); rank 0 rolls the rejected ones back in a later delta.
"""

from __future__ import annotations

import struct
import sys
import zlib
from array import array
from collections.abc import Iterable, Iterator
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


@dataclass(slots=True)
class NewSeq:
    """A sequence scheduled for the first time (or again after preemption)."""

    seq_id: int
    token_ids: list[int]  # every known token: prompt + tokens generated so far
    block_table: list[int]  # KV block ids, in order
    num_computed_tokens: int  # tokens whose KV is already in the cache (prefix-cache hit)
    num_new_tokens: int  # query length of this step (a prefill chunk)


@dataclass(slots=True)
class CachedSeq:
    """A sequence the workers already mirror: only what changed (one row of :class:`CachedSeqs`)."""

    seq_id: int
    num_new_tokens: int  # query length of this step (1 for decode)
    new_token_ids: list[int]  # tokens appended since the last step (the sampled one for a decode)
    new_block_ids: list[int]  # blocks appended to the block table since the last step
    rollback_tokens: int = 0  # tokens dropped from the mirror's tail before new_token_ids are appended
    rollback_blocks: int = 0  # block ids dropped from the mirror's tail before new_block_ids are appended
    num_draft_tokens: int = 0  # of new_token_ids, the last ones that are drafts to verify (speculative decoding)


class CachedSeqs:
    """The cached sequences of one step, stored as columns; reads like a list of :class:`CachedSeq`.

    A decode step of 256 sequences is eight flat int lists instead of 256
    objects, so the scheduler fills it with a few appends per sequence, the wire
    format packs each column in one call, and the mirror applies the columns
    with array operations. Indexing and iteration build :class:`CachedSeq`
    copies: changing one does not change the plan; use :meth:`append`.
    """

    __slots__ = ("seq_ids", "num_new_tokens", "token_counts", "token_ids", "block_counts", "block_ids",
                 "rollback_tokens", "rollback_blocks", "draft_counts")

    def __init__(self, seqs: Iterable[CachedSeq] = ()) -> None:
        self.seq_ids: list[int] = []  # [n]
        self.num_new_tokens: list[int] = []  # [n] query length of each sequence
        self.token_counts: list[int] = []  # [n] new token ids of each sequence
        self.token_ids: list[int] = []  # [sum(token_counts)] every sequence's new token ids, in order
        self.block_counts: list[int] = []  # [n] new block ids of each sequence
        self.block_ids: list[int] = []  # [sum(block_counts)] every sequence's new block ids, in order
        self.rollback_tokens: list[int] = []  # [n] tokens each sequence drops from its mirrored tail first
        self.rollback_blocks: list[int] = []  # [n] block ids each sequence drops from its mirrored tail first
        self.draft_counts: list[int] = []  # [n] of each sequence's new tokens, the trailing drafts
        for seq in seqs:
            self.append(seq)

    @classmethod
    def from_columns(
        cls, seq_ids: list[int], num_new_tokens: list[int], token_counts: list[int], token_ids: list[int],
        block_counts: list[int], block_ids: list[int], rollback_tokens: list[int] | None = None,
        rollback_blocks: list[int] | None = None, draft_counts: list[int] | None = None,
    ) -> CachedSeqs:
        """Wrap existing columns (not copied). The counts must sum to the lengths of the flat lists.

        Rollback and draft columns left out mean no rollback and no drafts (zeros).
        """
        out = cls()
        out.seq_ids, out.num_new_tokens = seq_ids, num_new_tokens
        out.token_counts, out.token_ids = token_counts, token_ids
        out.block_counts, out.block_ids = block_counts, block_ids
        out.rollback_tokens = rollback_tokens if rollback_tokens is not None else [0] * len(seq_ids)
        out.rollback_blocks = rollback_blocks if rollback_blocks is not None else [0] * len(seq_ids)
        out.draft_counts = draft_counts if draft_counts is not None else [0] * len(seq_ids)
        return out

    def add(
        self, seq_id: int, num_new_tokens: int, new_token_ids: list[int], new_block_ids: list[int],
        rollback_tokens: int = 0, rollback_blocks: int = 0, num_draft_tokens: int = 0,
    ) -> None:
        """Append one sequence's delta."""
        self.seq_ids.append(seq_id)
        self.num_new_tokens.append(num_new_tokens)
        self.token_counts.append(len(new_token_ids))
        self.token_ids += new_token_ids
        self.block_counts.append(len(new_block_ids))
        self.block_ids += new_block_ids
        self.rollback_tokens.append(rollback_tokens)
        self.rollback_blocks.append(rollback_blocks)
        self.draft_counts.append(num_draft_tokens)

    def append(self, seq: CachedSeq) -> None:
        """Append one sequence's delta given as a record."""
        self.add(seq.seq_id, seq.num_new_tokens, seq.new_token_ids, seq.new_block_ids, seq.rollback_tokens,
                 seq.rollback_blocks, seq.num_draft_tokens)

    def has_rollback(self) -> bool:
        """True if any sequence of the step drops tokens or blocks from its mirrored tail."""
        return any(self.rollback_tokens) or any(self.rollback_blocks)

    def has_drafts(self) -> bool:
        """True if any sequence of the step carries draft tokens to verify."""
        return any(self.draft_counts)

    def __len__(self) -> int:
        return len(self.seq_ids)

    def __iter__(self) -> Iterator[CachedSeq]:
        tok_ends, blk_ends = accumulate(self.token_counts), accumulate(self.block_counts)
        for seq_id, n, nt, t_end, nb, b_end, rt, rb, nd in zip(
            self.seq_ids, self.num_new_tokens, self.token_counts, tok_ends, self.block_counts, blk_ends,
            self.rollback_tokens, self.rollback_blocks, self.draft_counts,
        ):
            yield CachedSeq(seq_id, n, self.token_ids[t_end - nt : t_end], self.block_ids[b_end - nb : b_end], rt, rb,
                            nd)

    def __getitem__(self, index: int) -> CachedSeq:
        return list(self)[index]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, CachedSeqs):
            return all(getattr(self, name) == getattr(other, name) for name in self.__slots__)
        if isinstance(other, list):
            return list(self) == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return f"CachedSeqs({list(self)!r})"


@dataclass
class StepPlan:
    """One step's metadata, identical on every rank.

    ``cached_seqs`` may be given as a list of :class:`CachedSeq`; it is stored as
    :class:`CachedSeqs`.
    """

    kind: StepKind = StepKind.STEP
    new_seqs: list[NewSeq] = field(default_factory=list)
    cached_seqs: CachedSeqs = field(default_factory=CachedSeqs)
    freed_seq_ids: list[int] = field(default_factory=list)  # finished, aborted or preempted
    # Sequences of this step whose every chunk position needs logits (prompt logprobs), not only the last.
    prompt_logprob_seq_ids: list[int] = field(default_factory=list)
    # Every sampled row takes the plain argmax of its logits (rank 0's requests are all plain greedy): the
    # ranks pick the tokens from their vocabulary shards and rank 0 gets token ids, not logits.
    sample_argmax: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.cached_seqs, CachedSeqs):
            self.cached_seqs = CachedSeqs(self.cached_seqs)

    @property
    def num_tokens(self) -> int:
        """Total number of query tokens in this step."""
        return sum(s.num_new_tokens for s in self.new_seqs) + sum(self.cached_seqs.num_new_tokens)


# ----------------------------------------------------------------------------
# Wire format
#
# A message is a fixed header followed by flat little-endian arrays:
#
#   header  magic "RTPS" | version u8 | kind u8 | 10 count-dtype codes u8
#           n_new u32 | n_cached u32 | n_freed u32 | n_prompt_logprob u32
#           totals u32 x4 (flat lengths: new tokens, new blocks, cached new
#           tokens, cached new blocks) | flags u32 (bit 0: sample_argmax)
#           | body_len u32 | crc32 u32
#   body    int32 arrays first (ids, token ids, block ids), so they stay
#           4-byte aligned after the 60-byte header:
#             new_seq_ids [n_new], new_tokens [tot0], new_blocks [tot1],
#             cached_seq_ids [n_cached], cached_tokens [tot2],
#             cached_blocks [tot3], freed_seq_ids [n_freed],
#             prompt_logprob_seq_ids [n_prompt_logprob]
#           then the ten count arrays, each in the smallest encoding that
#           holds this message's values (all zero: no bytes / uniform: one
#           u32 / u8 / u16 / u32):
#             new: token counts, block counts, num_computed, num_new [n_new]
#             cached: num_new, token counts, block counts, rollback tokens,
#                     rollback blocks, draft tokens [n_cached]
#           (the cached arrays are exactly the columns of CachedSeqs).
#
# The crc32 covers the header (minus the crc field) and the body, so a
# corrupted or truncated buffer is rejected instead of decoded into garbage.
# A decode step of 256 sequences costs 60 + 256*4 (ids) + 256*4 (tokens) + 2*4
# (num_new and token counts, uniform; block counts and both rollbacks are all
# zero: no bytes) = 2116 bytes. A speculative step adds the draft tokens it
# sends and a u8 count array per column that is not uniform (or one u32 when
# every sequence drafts the same number).
# ----------------------------------------------------------------------------

_MAGIC = b"RTPS"
WIRE_VERSION = 5
_NUM_COUNT_ARRAYS = 10
_HEADER = struct.Struct("<4sBB10s11I")
_FLAG_ARGMAX = 1
_CRC_OFFSET = _HEADER.size - 4  # the crc32 is the last header field
_INT32 = np.dtype("<i4")
_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1
_U32_MAX = 2**32 - 1

# Count-array encodings. _UNIFORM stores one u32 that every element equals; _ZEROS stores nothing.
_UNIFORM = 0
_ZEROS = 4
_UINT_DTYPES: dict[int, np.dtype] = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 3: np.dtype("<u4")}
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


def _pack_int32(fields: list[tuple[list[int], str]]) -> bytes:
    """The int32 arrays of the body, back to back; ``fields`` holds (values, name for errors) pairs."""
    arr = array("i")
    for values, what in fields:
        try:
            arr.fromlist(values if isinstance(values, list) else list(values))  # fromlist: 3x faster than extend
        except (OverflowError, TypeError):
            bad = next((v for v in values if not isinstance(v, int) or not _I32_MIN <= v <= _I32_MAX), None)
            raise StepFormatError(f"{what} must be integers in [{_I32_MIN}, {_I32_MAX}], got {bad!r}") from None
    if _BIG_ENDIAN_HOST:
        arr.byteswap()
    return arr.tobytes()


def _pack_counts(values: list[int], what: str) -> tuple[int, bytes, int]:
    """Encode non-negative counts compactly; returns (code, bytes, sum)."""
    if not values:
        return 1, b"", 0
    first = values[0]
    if len(values) > 4 and isinstance(first, int) and 0 <= first <= _U32_MAX and values.count(first) == len(values):
        # Fast path for the decode step (every count equal): one u32 or nothing, no per-element work.
        if first == 0:
            return _ZEROS, b"", 0
        return _UNIFORM, struct.pack("<I", first), first * len(values)
    lo, hi = min(values), max(values)
    if lo < 0 or hi > _U32_MAX:
        bad = lo if lo < 0 else hi
        raise StepFormatError(f"{what} must be integers in [0, {_U32_MAX}], got {bad!r}")
    code = 1 if hi <= 0xFF else 2 if hi <= 0xFFFF else 3
    arr = _int_array(_UINT_TYPECODES[code], values, what, 0, _U32_MAX)  # also rejects non-ints
    if lo == hi == 0:
        return _ZEROS, b"", 0
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

    ints = _pack_int32([
        ([s.seq_id for s in new], "NewSeq.seq_id"),
        ([t for s in new for t in s.token_ids], "NewSeq.token_ids"),
        ([b for s in new for b in s.block_table], "NewSeq.block_table"),
        (cached.seq_ids, "CachedSeq.seq_id"),
        (cached.token_ids, "CachedSeq.new_token_ids"),
        (cached.block_ids, "CachedSeq.new_block_ids"),
        (plan.freed_seq_ids, "StepPlan.freed_seq_ids"),
        (plan.prompt_logprob_seq_ids, "StepPlan.prompt_logprob_seq_ids"),
    ])
    counts = [
        _pack_counts([len(s.token_ids) for s in new], "len(NewSeq.token_ids)"),
        _pack_counts([len(s.block_table) for s in new], "len(NewSeq.block_table)"),
        _pack_counts([s.num_computed_tokens for s in new], "NewSeq.num_computed_tokens"),
        _pack_counts([s.num_new_tokens for s in new], "NewSeq.num_new_tokens"),
        _pack_counts(cached.num_new_tokens, "CachedSeq.num_new_tokens"),
        _pack_counts(cached.token_counts, "len(CachedSeq.new_token_ids)"),
        _pack_counts(cached.block_counts, "len(CachedSeq.new_block_ids)"),
        _pack_counts(cached.rollback_tokens, "CachedSeq.rollback_tokens"),
        _pack_counts(cached.rollback_blocks, "CachedSeq.rollback_blocks"),
        _pack_counts(cached.draft_counts, "CachedSeq.num_draft_tokens"),
    ]
    totals = [counts[0][2], counts[1][2], counts[5][2], counts[6][2]]
    n_cached = len(cached.seq_ids)
    if not (len(cached.num_new_tokens) == len(cached.token_counts) == len(cached.block_counts) == n_cached
            and len(cached.rollback_tokens) == len(cached.rollback_blocks) == len(cached.draft_counts) == n_cached
            and totals[2] == len(cached.token_ids) and totals[3] == len(cached.block_ids)):
        raise StepFormatError("CachedSeqs columns are inconsistent: per-sequence columns differ in length, "
                              "or the counts do not sum to the flat token / block lists")
    n_plp = len(plan.prompt_logprob_seq_ids)
    if max(totals + [len(new), len(cached), len(plan.freed_seq_ids), n_plp]) > _U32_MAX:
        raise StepFormatError("a StepPlan array is longer than 2**32-1 elements")
    body = b"".join([ints, *(c[1] for c in counts)])
    header = _HEADER.pack(
        _MAGIC,
        WIRE_VERSION,
        int(kind),
        bytes(c[0] for c in counts),
        len(new),
        len(cached),
        len(plan.freed_seq_ids),
        n_plp,
        *totals,
        _FLAG_ARGMAX if plan.sample_argmax else 0,
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
        if code == _ZEROS:
            return [0] * n
        if code == _UNIFORM:
            (value,) = struct.unpack("<I", self.take(4, what))
            return [value] * n
        dtype = _UINT_DTYPES[code]
        return np.frombuffer(self.take(dtype.itemsize * n, what), dtype=dtype).tolist()


def _split(flat: list[int], lengths: list[int]) -> list[list[int]]:
    """Cut ``flat`` into consecutive lists of the given lengths."""
    ends = accumulate(lengths)
    return [flat[end - n : end] for end, n in zip(ends, lengths)]


def decode(buf: bytes | bytearray | memoryview) -> StepPlan:
    """Parse a buffer produced by :func:`encode`; raises StepFormatError (a ValueError) if invalid."""
    mv = memoryview(buf).cast("B") if not isinstance(buf, (bytes, bytearray)) else memoryview(buf)
    if len(mv) < _HEADER.size:
        raise StepFormatError(f"StepPlan buffer too short: {len(mv)} bytes, the header alone is {_HEADER.size}")
    magic, version, kind, codes, n_new, n_cached, n_freed, n_plp, *totals, flags, body_len, crc = (
        _HEADER.unpack_from(mv))
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
        if code not in (_UNIFORM, _ZEROS) and code not in _UINT_DTYPES:
            raise StepFormatError(f"unknown count encoding {code} in StepPlan buffer")

    r = _Reader(mv, _HEADER.size)
    # The int32 arrays lie back to back: read them in one go, then cut.
    int_lengths = [n_new, totals[0], totals[1], n_cached, totals[2], totals[3], n_freed, n_plp]
    ints = r.int32(sum(int_lengths), "the id, token and block arrays")
    new_ids, new_tokens, new_blocks, cached_ids, cached_tokens, cached_blocks, freed, plp = _split(
        ints, int_lengths
    )
    sizes = [n_new] * 4 + [n_cached] * (_NUM_COUNT_ARRAYS - 4)
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
    # Cached sequences stay in columns: a decode step builds no per-sequence objects.
    if any(c[9]) and any(d > n for d, n in zip(c[9], c[5])):  # (no drafts: all zeros, one C call)
        raise StepFormatError("StepPlan buffer is inconsistent: a sequence has more draft tokens than new tokens")
    cached_seqs = CachedSeqs.from_columns(cached_ids, c[4], c[5], cached_tokens, c[6], cached_blocks, c[7], c[8],
                                          c[9])
    return StepPlan(kind=step_kind, new_seqs=new_seqs, cached_seqs=cached_seqs, freed_seq_ids=freed,
                    prompt_logprob_seq_ids=plp, sample_argmax=bool(flags & _FLAG_ARGMAX))
