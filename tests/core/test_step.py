"""StepPlan wire format: exact round trips, compact decode steps, rejection of bad buffers."""

from __future__ import annotations

import pickle
import random
import struct
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rtp.core import step as step_mod
from rtp.core.step import CachedSeq, CachedSeqs, NewSeq, StepFormatError, StepKind, StepPlan, decode, encode

I32 = st.integers(-(2**31), 2**31 - 1)
TOKEN = st.integers(0, 2**31 - 1)
# Counts spanning every width the encoder can pick (u8, u16, u32).
COUNT = st.one_of(st.integers(0, 255), st.integers(256, 65535), st.integers(65536, 2**32 - 1))

new_seqs = st.builds(
    NewSeq,
    seq_id=I32,
    token_ids=st.lists(TOKEN, max_size=40),
    block_table=st.lists(I32, max_size=10),
    num_computed_tokens=COUNT,
    num_new_tokens=COUNT,
)
cached_seqs = st.builds(
    CachedSeq,
    seq_id=I32,
    num_new_tokens=COUNT,
    new_token_ids=st.lists(TOKEN, max_size=4),
    new_block_ids=st.lists(I32, max_size=3),
)
plans = st.builds(
    StepPlan,
    kind=st.sampled_from(list(StepKind)),
    new_seqs=st.lists(new_seqs, max_size=6),
    cached_seqs=st.lists(cached_seqs, max_size=30),
    freed_seq_ids=st.lists(I32, max_size=8),
    prompt_logprob_seq_ids=st.lists(I32, max_size=4),
    sample_argmax=st.booleans(),
)


def _assert_same(a: StepPlan, b: StepPlan) -> None:
    # Dataclass equality compares every field; also check types survive (IntEnum, plain ints).
    assert a == b
    assert type(b.kind) is StepKind
    for s in b.new_seqs:
        assert all(type(t) is int for t in s.token_ids + s.block_table)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plans)
def test_round_trip_random_plans(plan: StepPlan) -> None:
    buf = encode(plan)
    _assert_same(plan, decode(buf))
    # memoryview and bytearray inputs decode identically.
    assert decode(memoryview(buf)) == plan
    assert decode(bytearray(buf)) == plan


@pytest.mark.parametrize("kind", list(StepKind))
def test_empty_and_control_plans(kind: StepKind) -> None:
    plan = StepPlan(kind=kind)
    out = decode(encode(plan))
    assert out == plan and out.kind is kind
    assert out.new_seqs == [] and out.cached_seqs == [] and out.freed_seq_ids == []


def test_large_counts_and_lists() -> None:
    rng = random.Random(0)
    long_prompt = [rng.randrange(2**31) for _ in range(70_000)]  # > 65535 tokens: u32 counts
    plan = StepPlan(
        new_seqs=[
            NewSeq(7, long_prompt, list(range(4400)), 65_536, 70_000 - 65_536),
            NewSeq(8, [2**31 - 1] * 300, [0, 2**31 - 1], 0, 300),  # > 255: u16 counts
        ],
        cached_seqs=[CachedSeq(2**31 - 1, 1, [2**31 - 1], []), CachedSeq(0, 2**32 - 1, [], [5])],
        freed_seq_ids=[-(2**31), 2**31 - 1],
    )
    assert decode(encode(plan)) == plan


def test_uniform_arrays_of_every_width() -> None:
    # All-equal counts take the "uniform" encoding; values must still come back exactly.
    for value in (0, 1, 255, 256, 65535, 65536, 2**32 - 1):
        plan = StepPlan(cached_seqs=[CachedSeq(i, value, [i], []) for i in range(10)])
        assert decode(encode(plan)) == plan


def _decode_step(num_seqs: int = 256) -> StepPlan:
    return StepPlan(cached_seqs=[CachedSeq(1000 + i, 1, [151_000 + i], []) for i in range(num_seqs)])


def test_decode_step_is_compact() -> None:
    plan = _decode_step()
    buf = encode(plan)
    assert len(buf) < 3.5 * 1024, len(buf)
    # Lower bound from the information content: an int32 id and an int32 token per sequence.
    assert len(buf) >= 256 * 8
    # Pickling the per-sequence records (what a generic RPC would send) costs twice as much.
    assert len(buf) < len(pickle.dumps(list(plan.cached_seqs))) / 2
    # An occasional new block costs a u8 count per sequence more.
    records = list(plan.cached_seqs)
    records[3].new_block_ids.append(123)
    plan = StepPlan(cached_seqs=records)
    assert len(encode(plan)) < 3.5 * 1024
    assert decode(encode(plan)) == plan
    assert decode(encode(plan)).cached_seqs[3].new_block_ids == [123]


def test_every_truncation_is_rejected() -> None:
    plan = StepPlan(
        new_seqs=[NewSeq(1, [1, 2, 3], [9], 0, 3)],
        cached_seqs=[CachedSeq(2, 1, [4], [5, 6])],
        freed_seq_ids=[3],
    )
    buf = encode(plan)
    for n in range(len(buf)):
        with pytest.raises(ValueError):
            decode(buf[:n])
    with pytest.raises(ValueError, match="trailing|announces"):
        decode(buf + b"\x00")


def test_every_single_byte_corruption_is_rejected() -> None:
    buf = encode(_decode_step(20))
    rng = random.Random(1)
    for i in range(len(buf)):
        bad = bytearray(buf)
        bad[i] ^= rng.randrange(1, 256)
        with pytest.raises(StepFormatError):
            decode(bytes(bad))


def _reseal(buf: bytearray) -> bytes:
    """Recompute the crc so a deliberately inconsistent buffer passes the checksum."""
    hdr = step_mod._HEADER.size
    crc = zlib.crc32(bytes(buf[hdr:]), zlib.crc32(bytes(buf[: step_mod._CRC_OFFSET])))
    buf[step_mod._CRC_OFFSET : hdr] = struct.pack("<I", crc)
    return bytes(buf)


def test_structurally_inconsistent_buffer_is_rejected() -> None:
    plan = StepPlan(cached_seqs=[CachedSeq(1, 1, [4], []), CachedSeq(2, 1, [5, 6], [])])
    buf = bytearray(encode(plan))
    fields = list(step_mod._HEADER.unpack_from(buf))
    # fields: magic, version, kind, codes, n_new, n_cached, n_freed, n_prompt_logprob, 4 totals, flags,
    # body_len, crc
    fields[10] -= 1  # cached-token total no longer matches the per-seq counts...
    fields[6] += 1  # ...and the freed-id array absorbs the 4 bytes, so the length still adds up
    step_mod._HEADER.pack_into(buf, 0, *fields)
    with pytest.raises(StepFormatError, match="inconsistent"):
        decode(_reseal(buf))

    bad_kind = bytearray(encode(plan))
    bad_kind[5] = 200
    with pytest.raises(StepFormatError, match="StepKind"):
        decode(_reseal(bad_kind))

    bad_code = bytearray(encode(plan))
    bad_code[6] = 9
    with pytest.raises(StepFormatError, match="encoding"):
        decode(_reseal(bad_code))


def test_wrong_magic_version_and_garbage() -> None:
    buf = bytearray(encode(_decode_step(4)))
    with pytest.raises(ValueError, match="magic"):
        decode(b"XXXX" + bytes(buf[4:]))
    buf[4] = 99
    with pytest.raises(ValueError, match="version"):
        decode(bytes(buf))
    with pytest.raises(ValueError, match="too short"):
        decode(b"")
    with pytest.raises(ValueError):
        decode(random.Random(2).randbytes(4096))


@pytest.mark.parametrize(
    "plan",
    [
        StepPlan(cached_seqs=[CachedSeq(2**31, 1, [1], [])]),  # id beyond int32
        StepPlan(cached_seqs=[CachedSeq(1, 1, [2**40], [])]),
        StepPlan(cached_seqs=[CachedSeq(1, -1, [1], [])]),  # negative count
        StepPlan(new_seqs=[NewSeq(1, [1], [1], 2**32, 1)]),  # count beyond u32
        StepPlan(new_seqs=[NewSeq(1, [1.5], [1], 0, 1)]),  # type: ignore[list-item]
        StepPlan(kind=17),  # type: ignore[arg-type]
    ],
)
def test_unencodable_plans_raise_value_error(plan: StepPlan) -> None:
    with pytest.raises(StepFormatError):
        encode(plan)


def test_cached_seqs_read_like_a_list_of_records() -> None:
    records = [CachedSeq(5, 1, [7], []), CachedSeq(6, 3, [], [1, 2]), CachedSeq(9, 1, [8, 9], [4])]
    cols = CachedSeqs(records)
    assert len(cols) == 3 and list(cols) == records and cols == records and cols[1] == records[1]
    assert (cols.seq_ids, cols.num_new_tokens, cols.token_counts, cols.token_ids, cols.block_counts,
            cols.block_ids) == ([5, 6, 9], [1, 3, 1], [1, 0, 2], [7, 8, 9], [0, 2, 1], [1, 2, 4])
    assert StepPlan(cached_seqs=records) == StepPlan(cached_seqs=cols)  # a list is converted
    assert StepPlan(cached_seqs=records) != StepPlan(cached_seqs=records[:2])
    assert not CachedSeqs() and CachedSeqs() == []
    cols[0].new_token_ids.append(99)  # items are copies
    assert list(cols) == records


def test_inconsistent_columns_are_not_encoded() -> None:
    cols = CachedSeqs.from_columns([1, 2], [1, 1], [1, 1], [5], [0, 0], [])  # counts say 2 tokens, 1 given
    with pytest.raises(StepFormatError, match="inconsistent"):
        encode(StepPlan(cached_seqs=cols))
    cols = CachedSeqs.from_columns([1, 2], [1], [1, 1], [5, 6], [0, 0], [])  # num_new_tokens too short
    with pytest.raises(StepFormatError, match="inconsistent"):
        encode(StepPlan(cached_seqs=cols))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(I32, COUNT, st.lists(TOKEN, max_size=6), COUNT, COUNT), max_size=20))
def test_round_trip_of_several_tokens_and_rollbacks(rows: list[tuple[int, int, list[int], int, int]]) -> None:
    records = [CachedSeq(i, n, tokens, [], rollback_tokens=rt, rollback_blocks=rb) for i, n, tokens, rt, rb in rows]
    plan = StepPlan(cached_seqs=records)
    out = decode(encode(plan))
    assert out == plan and list(out.cached_seqs) == records
    assert out.cached_seqs.has_rollback() == any(rt or rb for *_, rt, rb in rows)


def test_rollback_columns_cost_nothing_when_unused() -> None:
    # A decode step of 256 sequences: 60 header bytes, an int32 id and token each, and one u32 for each
    # of the two uniform count arrays; zero block counts and rollbacks take no bytes.
    assert len(encode(_decode_step())) == 60 + 256 * 8 + 2 * 4
    speculative = StepPlan(cached_seqs=[CachedSeq(i, 4, [1, 2, 3, 4], [], rollback_tokens=i % 3) for i in range(256)])
    assert len(encode(speculative)) == 60 + 256 * 4 * 5 + 2 * 4 + 256  # u8 rollback counts
