"""The workers' BatchMirror, fed the scheduler's plans through the wire format, builds exactly the
inputs the scheduler meant: token ids, positions, KV slots and which rows are sampled."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from rtp.core.block_manager import BlockManager
from rtp.core.plan_builder import PlanBuilder
from rtp.core.scheduler import Scheduler, SchedulerLimits
from rtp.core.sequence import Sequence
from rtp.core.step import CachedSeq, NewSeq, StepPlan, decode, encode
from rtp.runtime.batch import BatchMirror, MirroredSeq
from rtp.sampling import SamplingParams


def expected_inputs(result, block_size: int):
    ids, pos, slots, samples, offset = [], [], [], [], 0
    for item in result.scheduled:
        seq, n = item.seq, item.num_new_tokens
        start = seq.num_computed_tokens
        for p in range(start, start + n):
            ids.append(seq.token_ids[p])
            pos.append(p)
            slots.append(seq.block_table[p // block_size] * block_size + p % block_size)
        offset += n
        if item.needs_sample:
            samples.append(offset - 1)
    return ids, pos, slots, samples


def assert_same_inputs(a, b) -> None:
    for name in ("input_ids", "positions", "slot_mapping", "block_tables", "sample_indices", "cu_seqlens_q",
                 "cu_seqlens_k", "context_lens"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
        assert getattr(a, name).dtype == getattr(b, name).dtype, name
    assert (a.q_lens, a.k_lens, a.seq_ids, a.max_seqlen_q, a.max_seqlen_k) == (
        b.q_lens, b.k_lens, b.seq_ids, b.max_seqlen_q, b.max_seqlen_k)


@pytest.mark.parametrize("seed", range(5))
def test_mirror_rebuilds_the_schedulers_batch(seed):
    rng = random.Random(seed)
    block_size = 4
    sched = Scheduler(SchedulerLimits(max_num_seqs=6, max_num_batched_tokens=24, max_model_len=128,
                                      block_size=block_size, num_blocks=20), eos_token_ids=[0])
    mirror = BatchMirror(block_size, rows=1)  # a worker, starting small so that its arrays must grow
    rank0 = BatchMirror(block_size)  # rank 0 applies the plan object itself, not its decoded copy
    shared = [rng.randrange(1, 50) for _ in range(9)]  # a common prefix: prefix-cache hits
    next_id, steps = 0, 0
    while steps < 300 and (next_id < 25 or sched.has_unfinished()):
        if next_id < 25 and rng.random() < 0.4:
            own = [rng.randrange(1, 50) for _ in range(rng.randrange(1, 30))]
            prompt = (shared if rng.random() < 0.5 else []) + own
            sched.add(Sequence(next_id, prompt, SamplingParams(max_tokens=rng.randrange(1, 12), ignore_eos=True)))
            next_id += 1
        result = sched.schedule()
        if not result.scheduled:
            continue
        steps += 1
        batch = mirror.apply(decode(encode(result.plan)))
        ids, pos, slots, samples = expected_inputs(result, block_size)
        assert batch.input_ids.tolist() == ids
        assert batch.positions.tolist() == pos
        assert batch.slot_mapping.tolist() == slots
        assert batch.sample_indices.tolist() == samples
        assert batch.seq_ids == [item.seq.seq_id for item in result.scheduled]
        # Block tables: each sequence's own, zero-padded to the longest in the step.
        assert batch.block_tables.dtype == np.int32
        assert batch.block_tables.shape == (len(result.seqs), max(len(s.block_table) for s in result.seqs))
        for row, seq in zip(batch.block_tables.tolist(), result.seqs):
            assert row == seq.block_table + [0] * (len(row) - len(seq.block_table))
        # Attention lengths: q = this step's tokens, k = cached + new.
        q = [item.num_new_tokens for item in result.scheduled]
        k = [item.seq.num_computed_tokens + item.num_new_tokens for item in result.scheduled]
        assert batch.q_lens == q and batch.k_lens == k and batch.context_lens.tolist() == k
        assert batch.cu_seqlens_q.tolist() == [0, *itertools.accumulate(q)]
        assert batch.cu_seqlens_k.tolist() == [0, *itertools.accumulate(k)]
        assert (batch.max_seqlen_q, batch.max_seqlen_k) == (max(q), max(k))
        assert_same_inputs(batch, rank0.apply(result.plan))
        sched.postprocess(result, [rng.randrange(1, 50) for _ in samples])
    assert not sched.has_unfinished()
    assert sched.stats.num_preemptions > 0  # the small cache forces preempted sequences to be re-sent in full
    assert sched.stats.prefix_hit_tokens > 0


def test_rows_are_reused_and_arrays_grow_for_long_sequences():
    bs = 4
    mirror = BatchMirror(bs, rows=1)
    long_prompt = list(range(1, 301))  # longer than the initial token and block-table capacity
    plan = StepPlan(new_seqs=[NewSeq(7, long_prompt, list(range(100, 175)), 0, 300),
                              NewSeq(8, [5, 6, 7], [3], 0, 3)])
    batch = mirror.apply(plan)
    assert batch.input_ids.tolist() == long_prompt + [5, 6, 7]
    assert batch.block_tables.shape == (2, 75)
    assert batch.block_tables[1].tolist() == [3] + [0] * 74
    assert batch.sample_indices.tolist() == [299, 302]
    # A decode step: one new token each, and a new block for seq 7 (its 75 blocks are full).
    batch = mirror.apply(StepPlan(cached_seqs=[CachedSeq(7, 1, [9], [175]), CachedSeq(8, 1, [4], [])]))
    assert batch.input_ids.tolist() == [9, 4] and batch.positions.tolist() == [300, 3]
    assert batch.slot_mapping.tolist() == [175 * bs, 3 * bs + 3]
    assert mirror.get(7) == MirroredSeq(long_prompt + [9], list(range(100, 176)), 301)
    # Seq 7's row goes to seq 9, which must not see 7's blocks beyond its own.
    batch = mirror.apply(StepPlan(new_seqs=[NewSeq(9, [1, 2], [11], 0, 2)], freed_seq_ids=[7]))
    assert 7 not in mirror and len(mirror) == 2 and mirror.get(7) is None
    assert batch.block_tables.tolist() == [[11]]
    assert mirror.get(9) == MirroredSeq([1, 2], [11], 2)


def test_inconsistent_plans_are_refused():
    mirror = BatchMirror(4)
    mirror.apply(StepPlan(new_seqs=[NewSeq(1, [1, 2, 3], [0], 0, 3)]))
    with pytest.raises(RuntimeError, match="does not mirror"):
        mirror.apply(StepPlan(cached_seqs=[CachedSeq(2, 1, [4], [])]))
    with pytest.raises(RuntimeError, match="inconsistent step: 2 new tokens at 3 of 4"):
        mirror.apply(StepPlan(cached_seqs=[CachedSeq(1, 2, [4], [])]))  # only one token is new
    with pytest.raises(RuntimeError, match="with 1 blocks"):
        mirror.apply(StepPlan(cached_seqs=[CachedSeq(1, 2, [5], [])]))  # positions 3 and 4 need a second block


def test_rollback_of_speculative_tokens_reaches_the_mirror():
    """Rank 0 cuts a sequence's tokens and KV back (rejected speculative tokens): through the plan builder
    and the wire format, the mirror drops the same tail and builds the inputs of the tokens that follow."""
    bs = 4
    bm = BlockManager(16, bs)
    plans = PlanBuilder()
    mirror = BatchMirror(bs)
    seq = Sequence(3, [11, 12, 13, 14, 15, 16], SamplingParams())
    bm.allocate(seq, [], 6)
    mirror.apply(decode(encode(plans.build([seq], [6], [], []))))
    seq.num_computed_tokens = 6
    # A verification step: the sampled token and three drafts, four positions computed at once.
    seq.token_ids += [20, 21, 22, 23]
    bm.append(seq, 10)
    plan = decode(encode(plans.build([], [], [seq], [4])))
    assert plan.cached_seqs[0] == CachedSeq(3, 4, [20, 21, 22, 23], seq.block_table[2:])
    batch = mirror.apply(plan)
    assert batch.positions.tolist() == [6, 7, 8, 9] and batch.input_ids.tolist() == [20, 21, 22, 23]
    seq.num_computed_tokens = 10
    # One draft accepted (21), two rejected: 8 tokens stay, and the KV of all 8 is real (position 7 was
    # computed from 21); the bonus token sampled after 21 follows.
    del seq.token_ids[8:]
    assert bm.truncate(seq, 8) == 8 and len(seq.block_table) == 2
    plans.rollback(seq.seq_id, len(seq.token_ids), len(seq.block_table))
    seq.token_ids.append(30)
    bm.append(seq, 9)  # the next step computes position 8, in a fresh block
    plan = decode(encode(plans.build([], [], [seq], [1])))
    assert plan.cached_seqs[0] == CachedSeq(3, 1, [30], seq.block_table[2:], rollback_tokens=2, rollback_blocks=1)
    batch = mirror.apply(plan)
    assert batch.input_ids.tolist() == [30] and batch.positions.tolist() == [8]
    assert batch.slot_mapping.tolist() == [seq.block_table[2] * bs]
    assert mirror.get(3) == MirroredSeq(seq.token_ids, seq.block_table, 9)
    # The next plan has no rollback left, and the mirror follows a plain decode step again.
    seq.num_computed_tokens = 9
    seq.token_ids.append(31)
    plan = decode(encode(plans.build([], [], [seq], [1])))
    assert plan.cached_seqs[0] == CachedSeq(3, 1, [31], [])
    assert mirror.apply(plan).input_ids.tolist() == [31]


def test_a_rollback_past_the_mirror_is_refused():
    mirror = BatchMirror(4)
    mirror.apply(StepPlan(new_seqs=[NewSeq(1, [1, 2, 3], [0], 0, 3)]))
    with pytest.raises(RuntimeError, match="rolling back 4 tokens"):
        mirror.apply(StepPlan(cached_seqs=[CachedSeq(1, 1, [4], [], rollback_tokens=4)]))
