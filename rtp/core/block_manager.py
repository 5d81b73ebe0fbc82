"""Paged KV blocks: allocation, reference counts and a chained-hash prefix cache.

The KV cache of every rank is cut into ``num_blocks`` blocks of ``block_size``
token slots. Rank 0 decides which block holds which positions of which
sequence; this module is that bookkeeping.

Prefix cache. Block ``i`` of a sequence that is full is named by
``h_i = xxh64(h_{i-1} || token_ids of block i)``, so equal hashes mean equal
prefixes (up to 64-bit collisions). A hash is registered once the block is
full and its KV is computed or being computed (``cache_computed_blocks``): the
blocks a chunk of known tokens fills (an admitted sequence's first chunk, a
running one's next) as soon as its step is scheduled, so that a sequence
admitted after it in the same step may share them, because every layer stores
the step's keys and values in the cache before its attention reads the cache
(vLLM too registers a block when it allocates it for a step); the blocks draft
positions fill, once verified. Steps run in the order they are scheduled, so
every later step finds the KV written.

A block whose reference count drops to 0 keeps its hash and stays findable,
parked in an LRU pool; it is evicted (hash entry dropped) only when a fresh
block is needed and no hash-less free block is left. Blocks of one sequence are
released tail first, so the tail of a prefix is evicted before its head.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque

import xxhash

from rtp.core.sequence import Sequence
from rtp.log import get_logger

logger = get_logger(__name__)


def hash_block(parent_hash: int | None, token_ids: list[int]) -> int:
    """Chained hash of one full block: xxh64 over the parent's hash and the block's tokens."""
    h = xxhash.xxh64()
    if parent_hash is not None:  # the first block of a sequence has no parent
        h.update(parent_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return h.intdigest()


def seq_block_hashes(seq: Sequence, block_size: int) -> list[int]:
    """Chained hashes of the full blocks of ``seq.token_ids`` (extends ``seq.block_hashes``, with prefix caching
    off too: EAGLE-3's proposer names its reusable blocks by them)."""
    hashes = seq.block_hashes
    for i in range(len(hashes), seq.num_tokens // block_size):
        parent = hashes[i - 1] if i > 0 else None
        hashes.append(hash_block(parent, seq.token_ids[i * block_size : (i + 1) * block_size]))
    return hashes


class BlockManager:
    """Owns the KV blocks: free pools, reference counts and the hash -> block map."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 recompute_last_hit: bool = False) -> None:
        assert num_blocks >= 1 and block_size >= 1
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.recompute_last_hit = recompute_last_hit  # see find_cached_prefix
        self._ref: list[int] = [0] * num_blocks  # number of block tables holding the block
        self._hash: list[int | None] = [None] * num_blocks  # registered hash, or None
        self._hash_to_block: dict[int, int] = {}
        # Free blocks without a hash (reused first, the most recently freed first: a KV page is faulted in
        # where it is first written, and a reused one is resident and warm) and free blocks with one (LRU
        # order, least recently freed first; evicted only when the hash-less pool is empty).
        self._free_plain: deque[int] = deque(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (hash-less free plus evictable cached)."""
        return len(self._free_plain) + len(self._free_cached)

    def ref_count(self, block_id: int) -> int:
        """Number of block tables holding ``block_id``."""
        return self._ref[block_id]

    def block_hash(self, block_id: int) -> int | None:
        """The hash registered for ``block_id``, or None."""
        return self._hash[block_id]

    def cached_blocks(self) -> dict[int, int]:
        """A copy of the hash -> block id map (for tests and debugging)."""
        return dict(self._hash_to_block)

    def free_block_ids(self) -> tuple[list[int], list[int]]:
        """Free block ids: (hash-less pool, cached pool in eviction order)."""
        return list(self._free_plain), list(self._free_cached)

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` positions."""
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of ``seq``'s known tokens.

        At most ``(num_tokens - 1) // block_size`` blocks are returned, so at least
        one token is always left to compute: a step needs a non-empty query to
        produce the logits of the next token. When the whole sequence is cached,
        its last block is recomputed into a fresh block rather than writing the
        last token into a block that other sequences share. With ``recompute_last_hit``
        the last block found is left out as well: the sequence computes it again, in
        a block of its own (for EAGLE-3's head, see :mod:`rtp.spec.eagle3`).
        """
        if not self.enable_prefix_caching:
            return []
        hashes = seq_block_hashes(seq, self.block_size)
        limit = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in hashes[:limit]:
            block_id = self._hash_to_block.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits[:-1] if self.recompute_last_hit else hits

    def can_allocate(self, cached: list[int], num_tokens: int) -> bool:
        """Whether a waiting sequence can get blocks for ``num_tokens`` positions reusing ``cached``."""
        fresh = self.num_blocks_for(num_tokens) - len(cached)
        # A cached hit that is currently free leaves the free pool when taken.
        revived = sum(1 for b in cached if self._ref[b] == 0)
        return fresh + revived <= self.num_free_blocks

    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether ``seq`` (holding blocks or not) can grow to ``num_tokens`` positions with the free blocks."""
        return self.num_blocks_for(num_tokens) - len(seq.block_table) <= self.num_free_blocks

    def appendable_tokens(self, seq: Sequence) -> int:
        """How many more positions of a running ``seq`` could be computed with the free blocks."""
        return len(seq.block_table) * self.block_size - seq.num_computed_tokens + self.num_free_blocks * self.block_size

    # ------------------------------------------------------------------ updates

    def allocate(self, seq: Sequence, cached: list[int], num_tokens: int) -> None:
        """Give a waiting ``seq`` its cached prefix blocks plus fresh blocks up to ``num_tokens`` positions."""
        assert not seq.block_table, f"{seq} already holds blocks"
        assert self.can_allocate(cached, num_tokens)
        for block_id in cached:  # take the hits first so that allocating fresh blocks cannot evict them
            self._take(block_id)
        seq.block_table = list(cached)
        seq.num_hashed_blocks = len(cached)  # hits are registered already
        self.append(seq, num_tokens)

    def append(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq.block_table`` so that it holds ``num_tokens`` positions."""
        need = self.num_blocks_for(num_tokens) - len(seq.block_table)
        assert need <= self.num_free_blocks, f"{seq} needs {need} blocks, {self.num_free_blocks} free"
        for _ in range(need):
            seq.block_table.append(self._alloc())

    def share(self, parent: Sequence, child: Sequence, num_blocks: int) -> None:
        """Give ``child`` (holding nothing) the first ``num_blocks`` blocks of ``parent`` (ref counts +1).

        Only full, computed blocks may be shared: their content never changes again.
        """
        assert not child.block_table, f"{child} already holds blocks"
        assert num_blocks <= len(parent.block_table)
        shared = parent.block_table[:num_blocks]
        for block_id in shared:
            self._take(block_id)
        child.block_table = list(shared)
        child.block_hashes = list(parent.block_hashes[:num_blocks])
        child.num_hashed_blocks = min(parent.num_hashed_blocks, num_blocks)

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq`` (tail first, so the tail is evicted first)."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.num_hashed_blocks = 0

    def truncate(self, seq: Sequence, num_tokens: int) -> int:
        """Cut ``seq``'s KV back to its first ``num_tokens`` positions; returns the positions it keeps.

        For tokens that turn out not to belong to the sequence (rejected
        speculative tokens). Blocks past the cut are released, tail first; a
        full one keeps its hash (its KV is still that of the tokens it was
        computed from). The block the cut falls into is written again, so it
        cannot stay findable: it loses its hash, or, if another block table
        holds it too (a prefix hit, a fork), it is released as well and the
        positions of ``seq`` in it are dropped, since a shared block is never
        written. ``seq.num_computed_tokens`` is capped to what is kept.
        """
        bs = self.block_size
        table = seq.block_table
        assert 0 <= num_tokens <= len(table) * bs, f"cannot truncate {seq} to {num_tokens} positions"
        full, keep = num_tokens // bs, self.num_blocks_for(num_tokens)
        if keep > full and self._ref[table[full]] > 1:  # the cut falls into a shared block
            num_tokens, keep = full * bs, full
        for block_id in reversed(table[keep:]):
            self._release(block_id)
        del table[keep:]
        if keep > full:  # a partial last block: this sequence alone holds it
            self._unhash(table[full])
        seq.num_hashed_blocks = min(seq.num_hashed_blocks, full)
        del seq.block_hashes[full:]  # the tokens past the cut may change: hash them again when needed
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens)
        return num_tokens

    def cache_computed_blocks(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Register the hashes of ``seq``'s full blocks among its first ``num_tokens`` positions (default: its
        computed ones), which must be known tokens, computed or computed by the step being scheduled.

        If another block already holds the same content (a fully cached prompt whose last block was
        recomputed, say), the existing entry is kept and this block stays hash-less: it returns to the plain
        pool when freed. One hash never maps to two blocks and no block is lost.
        """
        if not self.enable_prefix_caching:
            return
        full = (seq.num_computed_tokens if num_tokens is None else num_tokens) // self.block_size
        if full <= seq.num_hashed_blocks:
            return
        hashes = seq_block_hashes(seq, self.block_size)
        for i in range(seq.num_hashed_blocks, full):
            block_id, h = seq.block_table[i], hashes[i]
            registered = self._hash[block_id]
            if registered is not None:
                assert registered == h, f"block {block_id} of {seq} is registered under another hash"
            elif h not in self._hash_to_block:
                self._hash[block_id] = h
                self._hash_to_block[h] = block_id
        seq.num_hashed_blocks = full

    # ------------------------------------------------------------------ internals

    def _alloc(self) -> int:
        """A fresh block with ref count 1, evicting the least recently freed cached block if needed."""
        if self._free_plain:
            block_id = self._free_plain.popleft()
        else:
            block_id, _ = self._free_cached.popitem(last=False)
            # The block is about to hold other content: its hash must stop pointing at it.
            assert self._hash[block_id] is not None
            self._unhash(block_id)
        assert self._ref[block_id] == 0
        self._ref[block_id] = 1
        return block_id

    def _unhash(self, block_id: int) -> None:
        """Drop the hash of ``block_id`` (if it has one): it will hold other content."""
        h = self._hash[block_id]
        if h is not None:
            assert self._hash_to_block.get(h) == block_id
            del self._hash_to_block[h]
            self._hash[block_id] = None

    def _take(self, block_id: int) -> None:
        """Share a cached block (revive it from the cached pool if it was free)."""
        if self._ref[block_id] == 0:
            del self._free_cached[block_id]
        self._ref[block_id] += 1

    def _release(self, block_id: int) -> None:
        assert self._ref[block_id] > 0, f"double free of block {block_id}"
        self._ref[block_id] -= 1
        if self._ref[block_id] == 0:
            if self._hash[block_id] is not None:
                self._free_cached[block_id] = None  # most recently freed: evicted last
            else:
                self._free_plain.appendleft(block_id)  # reused first: its pages are resident and warm
