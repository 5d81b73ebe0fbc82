"""BlockManager: allocation, ref counts, chained hashing, LRU eviction of cached blocks."""

from __future__ import annotations

import xxhash

from rtp.core.block_manager import BlockManager, hash_block, seq_block_hashes
from rtp.core.sequence import Sequence
from rtp.sampling import SamplingParams


def make_seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, tokens, SamplingParams())


def admit(bm: BlockManager, seq: Sequence, num_tokens: int | None = None) -> list[int]:
    """Allocate like the scheduler does; return the prefix-cache hits."""
    hits = bm.find_cached_prefix(seq)
    total = seq.num_tokens if num_tokens is None else num_tokens
    assert bm.can_allocate(hits, total)
    bm.allocate(seq, hits, total)
    seq.num_computed_tokens = len(hits) * bm.block_size
    return hits


def compute(bm: BlockManager, seq: Sequence, upto: int) -> None:
    """Pretend a step computed the KV of positions [num_computed, upto)."""
    seq.num_computed_tokens = upto
    bm.cache_computed_blocks(seq)


def check_accounting(bm: BlockManager, seqs: list[Sequence]) -> None:
    plain, cached = bm.free_block_ids()
    free = plain + cached
    assert len(free) == len(set(free)), "a block is free twice"
    held = [b for s in seqs for b in s.block_table]
    for b in range(bm.num_blocks):
        assert bm.ref_count(b) == held.count(b)
        assert (bm.ref_count(b) == 0) == (b in free)
    assert len(free) + len(set(held)) == bm.num_blocks
    for h, b in bm.cached_blocks().items():
        assert bm.block_hash(b) == h
    for b in cached:
        assert bm.block_hash(b) is not None
    for b in plain:
        assert bm.block_hash(b) is None


def test_hash_is_chained_xxh64() -> None:
    # Independent reference: xxh64 of the parent's 8 little-endian bytes then int64 tokens.
    tokens = [3, 1, 4, 1]
    ref0 = xxhash.xxh64(b"".join(t.to_bytes(8, "little", signed=True) for t in tokens)).intdigest()
    assert hash_block(None, tokens) == ref0
    ref1 = xxhash.xxh64(
        ref0.to_bytes(8, "little") + b"".join(t.to_bytes(8, "little", signed=True) for t in [5, 9, 2, 6])
    ).intdigest()
    assert hash_block(ref0, [5, 9, 2, 6]) == ref1
    # Same block content behind a different prefix is a different block.
    assert hash_block(hash_block(None, [0, 0, 0, 0]), [5, 9, 2, 6]) != ref1


def test_seq_block_hashes_cover_full_blocks_only() -> None:
    seq = make_seq(0, list(range(10)))
    hashes = seq_block_hashes(seq, 4)
    assert len(hashes) == 2
    assert hashes[1] == hash_block(hash_block(None, [0, 1, 2, 3]), [4, 5, 6, 7])
    seq.token_ids += [10, 11]
    assert len(seq_block_hashes(seq, 4)) == 3


def test_allocate_free_and_reuse_across_requests() -> None:
    bm = BlockManager(8, 4)
    a = make_seq(0, list(range(10)))
    assert admit(bm, a) == []
    assert len(a.block_table) == 3 and bm.num_free_blocks == 5
    compute(bm, a, 10)
    assert len(bm.cached_blocks()) == 2  # the partial third block is not cached
    bm.free(a)
    check_accounting(bm, [])
    assert bm.num_free_blocks == 8
    b = make_seq(1, list(range(8)) + [99, 98])
    hits = admit(bm, b)
    assert len(hits) == 2 and b.block_table[:2] == hits
    assert b.num_computed_tokens == 8
    check_accounting(bm, [b])


def test_shared_blocks_are_ref_counted() -> None:
    bm = BlockManager(8, 2)
    a = make_seq(0, [1, 2, 3, 4, 5])
    admit(bm, a)
    compute(bm, a, 5)
    b = make_seq(1, [1, 2, 3, 4, 7])
    hits = admit(bm, b)
    assert hits == a.block_table[:2]
    assert all(bm.ref_count(x) == 2 for x in hits)
    check_accounting(bm, [a, b])
    bm.free(a)
    assert all(bm.ref_count(x) == 1 for x in hits)
    check_accounting(bm, [b])
    bm.free(b)
    check_accounting(bm, [])


def test_stale_hash_dropped_when_block_reused() -> None:
    """Bug (a): a cached free block that is reused for other content must not be found by its old hash."""
    bm = BlockManager(2, 2)
    a = make_seq(0, [1, 2, 3, 4])
    admit(bm, a)
    compute(bm, a, 4)
    old = dict(bm.cached_blocks())
    assert len(old) == 2
    bm.free(a)
    b = make_seq(1, [7, 7, 7, 7, 7])  # needs both blocks (of which one partial) -> evicts both
    admit(bm, b, 4)
    for h in old:
        assert h not in bm.cached_blocks()
    check_accounting(bm, [b])
    bm.free(b)
    # Nothing of [1, 2, 3, 4] is in the cache any more: a naive map would return b's blocks.
    again = make_seq(2, [1, 2, 3, 4, 5])
    assert bm.find_cached_prefix(again) == []


def test_lru_eviction_prefers_plain_blocks_then_oldest_freed() -> None:
    bm = BlockManager(6, 2)
    a = make_seq(0, [1, 1, 2, 2])
    b = make_seq(1, [3, 3, 4, 4])
    admit(bm, a)
    admit(bm, b)
    compute(bm, a, 4)
    compute(bm, b, 4)
    a_table, b_table = list(a.block_table), list(b.block_table)
    bm.free(a)  # freed first: evicted first
    bm.free(b)
    _, cached = bm.free_block_ids()
    # Tail first within a sequence, sequences in the order they were freed.
    assert cached == [a_table[1], a_table[0], b_table[1], b_table[0]]
    plain_before, _ = bm.free_block_ids()
    c = make_seq(2, [9, 9, 9, 9, 9, 9])
    admit(bm, c)  # 3 blocks: the 2 plain ones, then the least recently freed cached one
    assert set(c.block_table[:2]) == set(plain_before)
    evicted = c.block_table[2]
    assert evicted == cached[0]
    # a's tail block went, a's head and all of b are still findable.
    assert len(bm.find_cached_prefix(make_seq(3, [1, 1, 2, 2, 0]))) == 1
    assert len(bm.find_cached_prefix(make_seq(4, [3, 3, 4, 4, 0]))) == 2
    check_accounting(bm, [c])


def test_hit_on_free_cached_block_is_not_evicted_by_same_allocation() -> None:
    bm = BlockManager(3, 2)
    a = make_seq(0, [5, 6, 7, 8])
    admit(bm, a)
    compute(bm, a, 4)
    bm.free(a)
    # Needs 3 blocks: 2 hits (both free) + 1 fresh; the fresh one must not evict a hit.
    b = make_seq(1, [5, 6, 7, 8, 9])
    hits = admit(bm, b)
    assert len(hits) == 2 and len(set(b.block_table)) == 3
    check_accounting(bm, [b])


def test_can_allocate_counts_revived_hits() -> None:
    bm = BlockManager(2, 2)
    a = make_seq(0, [1, 2, 3])
    admit(bm, a)
    compute(bm, a, 2)
    bm.free(a)  # block 0 cached+free, block 1 plain
    b = make_seq(1, [1, 2, 3, 4, 5])  # hit 1 block, needs 3 blocks in total
    hits = bm.find_cached_prefix(b)
    assert len(hits) == 1
    assert not bm.can_allocate(hits, 5)
    assert bm.can_allocate(hits, 4)


def test_full_hit_leaves_last_block_to_compute() -> None:
    """Bug (c): the hit stops short of the last token, so the query is never empty."""
    for prompt_len in (8, 9):
        bm = BlockManager(8, 4)
        a = make_seq(0, list(range(prompt_len)))
        admit(bm, a)
        compute(bm, a, prompt_len)
        bm.free(a)
        b = make_seq(1, list(range(prompt_len)))
        hits = bm.find_cached_prefix(b)
        assert len(hits) * 4 < prompt_len
        assert len(hits) == (prompt_len - 1) // 4


def test_duplicate_content_not_registered_twice() -> None:
    """Bug (b): two blocks with one content -> one map entry, the other block stays plain."""
    bm = BlockManager(8, 2)
    a = make_seq(0, [1, 2, 3, 4, 5])
    b = make_seq(1, [1, 2, 3, 4, 6])
    admit(bm, a)
    admit(bm, b)  # nothing registered yet: no hit, separate blocks
    assert not set(a.block_table) & set(b.block_table)
    compute(bm, a, 5)
    compute(bm, b, 5)
    cached = bm.cached_blocks()
    assert len(cached) == 2 and set(cached.values()) <= set(a.block_table)
    check_accounting(bm, [a, b])
    bm.free(b)
    bm.free(a)
    check_accounting(bm, [])
    assert bm.num_free_blocks == 8


def test_registration_only_after_compute() -> None:
    """Bug (e): allocating a full block does not make it findable."""
    bm = BlockManager(8, 2)
    a = make_seq(0, [1, 2, 3, 4, 5])
    admit(bm, a)
    assert bm.cached_blocks() == {}
    assert bm.find_cached_prefix(make_seq(1, [1, 2, 3, 4, 5])) == []
    compute(bm, a, 3)  # only the first block is full and computed
    assert list(bm.cached_blocks().values()) == [a.block_table[0]]


def test_prefix_caching_disabled() -> None:
    bm = BlockManager(4, 2, enable_prefix_caching=False)
    a = make_seq(0, [1, 2, 3, 4, 5])
    admit(bm, a)
    compute(bm, a, 5)
    assert bm.cached_blocks() == {}
    bm.free(a)
    assert bm.find_cached_prefix(make_seq(1, [1, 2, 3, 4, 5])) == []
    check_accounting(bm, [])


def test_truncate_releases_the_tail_and_keeps_full_hashes() -> None:
    bm = BlockManager(8, 2)
    a = make_seq(0, [1, 2, 3, 4, 5, 6, 7])
    admit(bm, a)
    compute(bm, a, 6)  # blocks 0..2 full and hashed, block 3 holds position 6 only
    table = list(a.block_table)
    hashes = {b: bm.block_hash(b) for b in table[:3]}
    assert bm.truncate(a, 4) == 4
    assert a.block_table == table[:2] and a.num_computed_tokens == 4 and a.num_hashed_blocks == 2
    assert [bm.ref_count(b) for b in table] == [1, 1, 0, 0]
    plain, cached = bm.free_block_ids()
    # The full block past the cut still holds the KV its hash names: it stays findable.
    assert table[2] in cached and bm.block_hash(table[2]) == hashes[table[2]]
    assert table[3] in plain
    check_accounting(bm, [a])
    again = make_seq(1, [1, 2, 3, 4, 5, 6, 9])
    assert bm.find_cached_prefix(again) == table[:3]


def test_truncate_into_a_hashed_block_drops_its_hash() -> None:
    bm = BlockManager(8, 4)
    a = make_seq(0, list(range(1, 10)))
    admit(bm, a)
    compute(bm, a, 9)  # blocks 0 and 1 full and hashed
    h1 = bm.block_hash(a.block_table[1])
    assert h1 is not None
    assert bm.truncate(a, 6) == 6  # the cut falls into block 1, which is written again from position 6
    assert len(a.block_table) == 2 and bm.block_hash(a.block_table[1]) is None
    assert h1 not in bm.cached_blocks() and a.num_hashed_blocks == 1 and a.num_computed_tokens == 6
    check_accounting(bm, [a])
    # Nothing finds the old block 1 any more; block 0 still is a hit.
    assert bm.find_cached_prefix(make_seq(1, list(range(1, 10)))) == a.block_table[:1]
    # The tokens past the cut change: the re-filled block is hashed from the new tokens.
    a.token_ids[6:] = [50, 51, 52]
    compute(bm, a, 9)
    assert bm.block_hash(a.block_table[1]) == hash_block(bm.block_hash(a.block_table[0]), [5, 6, 50, 51])


def test_truncate_never_keeps_writing_into_a_shared_block() -> None:
    bm = BlockManager(8, 2)
    a = make_seq(0, [1, 2, 3, 4, 5])
    admit(bm, a)
    compute(bm, a, 5)
    b = make_seq(1, [1, 2, 3, 4, 9])
    hits = admit(bm, b)
    assert hits == a.block_table[:2]
    compute(bm, b, 5)
    # Cutting b at 3 falls into the shared block 1: b gives it up and keeps positions 0..1 only.
    assert bm.truncate(b, 3) == 2
    assert b.block_table == hits[:1] and b.num_computed_tokens == 2
    assert bm.ref_count(hits[1]) == 1 and bm.block_hash(hits[1]) is not None  # a's block is untouched
    check_accounting(bm, [a, b])
    bm.append(b, 5)
    assert b.block_table[1] not in a.block_table
    check_accounting(bm, [a, b])


def test_truncate_to_the_current_length_changes_nothing() -> None:
    bm = BlockManager(8, 2)
    a = make_seq(0, [1, 2, 3, 4, 5])
    admit(bm, a)
    compute(bm, a, 5)
    before = (list(a.block_table), bm.cached_blocks(), bm.free_block_ids())
    assert bm.truncate(a, 5) == 5
    assert (a.block_table, bm.cached_blocks(), bm.free_block_ids()) == before
    bm.truncate(a, 0)
    assert a.block_table == [] and a.num_computed_tokens == 0
    check_accounting(bm, [a])
