"""Step plans for a dry run: prefill, mixed, decode, with consistent block tables and no scheduler.

The dry run cannot read sampled tokens (fake logits hold no values), so every sequence "samples"
a fixed token; the plans keep the mirror invariant of :mod:`rtp.core.step` (a chunk that reached
the end of its known tokens is followed by a delta carrying one new token).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rtp.core.step import CachedSeq, CachedSeqs, NewSeq, StepPlan

SAMPLED_TOKEN = 7  # the token every sequence pretends to have sampled


@dataclass
class _Seq:
    known: int  # tokens known (prompt + sampled)
    computed: int  # tokens whose KV is in the cache after the last step
    blocks: list[int] = field(default_factory=list)


class ScriptedPlans:
    """Plans scripted by the dry run instead of a scheduler: hands out block ids, builds matching deltas."""

    def __init__(self, block_size: int, vocab_size: int) -> None:
        self.block_size, self.vocab_size = block_size, vocab_size
        self.seqs: dict[int, _Seq] = {}
        self._next_block = 1  # block 0 is what CUDA-graph padding rows read: keep it unused
        self._next_id = 0

    def _blocks_for(self, seq: _Seq, tokens: int) -> list[int]:
        """New block ids so that ``seq`` can hold ``tokens`` tokens."""
        need = -(-tokens // self.block_size) - len(seq.blocks)
        new = list(range(self._next_block, self._next_block + max(0, need)))
        self._next_block += len(new)
        seq.blocks += new
        return new

    def new_seq(self, prompt_len: int, chunk: int | None = None) -> NewSeq:
        """A prompt of ``prompt_len`` tokens, of which ``chunk`` (all by default) are computed now."""
        seq_id, self._next_id = self._next_id, self._next_id + 1
        seq = self.seqs[seq_id] = _Seq(known=prompt_len, computed=0)
        self._blocks_for(seq, prompt_len)
        n = prompt_len if chunk is None else chunk
        tokens = [(seq_id * 31 + i) % (self.vocab_size - 3) + 3 for i in range(prompt_len)]
        seq.computed = n
        return NewSeq(seq_id, tokens, list(seq.blocks), 0, n)

    def next_chunk(self, seq_id: int, n: int | None = None) -> CachedSeq:
        """The next ``n`` prompt tokens of a chunked prefill (the rest by default)."""
        seq = self.seqs[seq_id]
        n = seq.known - seq.computed if n is None else n
        seq.computed += n
        return CachedSeq(seq_id, n, [], [])

    def decode(self, seq_id: int) -> CachedSeq:
        """One decode token for a sequence whose last chunk reached its end."""
        seq = self.seqs[seq_id]
        if seq.computed != seq.known:
            raise ValueError(f"sequence {seq_id} has {seq.known - seq.computed} prompt tokens left to compute")
        seq.known += 1
        seq.computed += 1
        return CachedSeq(seq_id, 1, [SAMPLED_TOKEN], self._blocks_for(seq, seq.known))

    def decode_plan(self, seq_ids: list[int]) -> StepPlan:
        return StepPlan(cached_seqs=CachedSeqs(self.decode(i) for i in seq_ids))
