"""Worker-side mirror of the running batch, and StepPlan -> flat model inputs.

Every rank (rank 0 included) applies the same StepPlan to its own mirror, so
every rank builds bit-identical inputs without receiving token lists again.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rtp.core.step import StepPlan


@dataclass
class MirroredSeq:
    """What a rank knows of one running sequence."""

    token_ids: list[int]
    block_table: list[int]
    num_computed: int  # tokens whose KV is in the cache


@dataclass
class BatchInputs:
    """Host arrays of one step, in batch order (new seqs, then cached seqs)."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    q_lens: list[int]  # [B]
    k_lens: list[int]  # [B]: cached + new keys
    block_tables: np.ndarray  # [B, max_blocks] int32, zero-padded
    sample_indices: np.ndarray  # [S] int64: flat positions whose logits are sampled
    seq_ids: list[int]  # [B]

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


class BatchMirror:
    """Applies StepPlans to a per-rank copy of the running sequences."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.seqs: dict[int, MirroredSeq] = {}

    def apply(self, plan: StepPlan) -> BatchInputs:
        """Update the mirror with ``plan`` and return the flat inputs of its step."""
        for seq_id in plan.freed_seq_ids:
            self.seqs.pop(seq_id, None)
        order: list[tuple[int, MirroredSeq, int]] = []
        for new in plan.new_seqs:
            seq = MirroredSeq(list(new.token_ids), list(new.block_table), new.num_computed_tokens)
            self.seqs[new.seq_id] = seq
            order.append((new.seq_id, seq, new.num_new_tokens))
        for delta in plan.cached_seqs:
            seq = self.seqs.get(delta.seq_id)
            if seq is None:
                raise RuntimeError(f"step plan names sequence {delta.seq_id}, which this rank does not mirror")
            seq.token_ids.extend(delta.new_token_ids)
            seq.block_table.extend(delta.new_block_ids)
            order.append((delta.seq_id, seq, delta.num_new_tokens))
        return self._flatten(order)

    def _flatten(self, order: list[tuple[int, MirroredSeq, int]]) -> BatchInputs:
        bs = self.block_size
        ids: list[int] = []
        positions: list[np.ndarray] = []
        q_lens, k_lens, samples, tables = [], [], [], []
        for _, seq, q_len in order:
            start, end = seq.num_computed, seq.num_computed + q_len
            if q_len < 1 or end > len(seq.token_ids) or -(-end // bs) > len(seq.block_table):
                raise RuntimeError(
                    f"inconsistent step: {q_len} new tokens at {start} of {len(seq.token_ids)} "
                    f"with {len(seq.block_table)} blocks"
                )
            ids.extend(seq.token_ids[start:end])
            positions.append(np.arange(start, end, dtype=np.int64))
            q_lens.append(q_len)
            k_lens.append(end)
            if end == len(seq.token_ids):  # the chunk reaches the last known token: sample it
                samples.append(len(ids) - 1)
            tables.append(seq.block_table)
            seq.num_computed = end
        pos = np.concatenate(positions) if positions else np.zeros(0, dtype=np.int64)
        max_blocks = max((len(t) for t in tables), default=0)
        block_tables = np.zeros((len(tables), max_blocks), dtype=np.int32)
        for i, t in enumerate(tables):
            block_tables[i, : len(t)] = t
        # Flat slot of each new token: block id * block size + offset in the block.
        seq_index = np.repeat(np.arange(len(order)), q_lens)
        slots = block_tables[seq_index, pos // bs].astype(np.int64) * bs + pos % bs if len(pos) else pos
        return BatchInputs(
            input_ids=np.asarray(ids, dtype=np.int64),
            positions=pos,
            slot_mapping=slots,
            q_lens=q_lens,
            k_lens=k_lens,
            block_tables=block_tables,
            sample_indices=np.asarray(samples, dtype=np.int64),
            seq_ids=[seq_id for seq_id, _, _ in order],
        )
