"""Steps with drafts in the scheduler: budget, KV slots, rollback of rejected drafts (rank 0's block table
and the workers' mirror), prefix-cache hashes of accepted tokens only, stops inside a run."""

from __future__ import annotations

from rtp.core.block_manager import hash_block
from rtp.core.scheduler import Scheduler, SchedulerLimits
from rtp.core.sequence import Sequence
from rtp.runtime.batch import BatchMirror
from rtp.sampling import SamplingParams

BS = 4


def setup(max_tokens: int = 50) -> tuple[Scheduler, BatchMirror, Sequence]:
    sched = Scheduler(SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                                      block_size=BS, num_blocks=16), eos_token_ids=[0])
    mirror = BatchMirror(BS)
    seq = Sequence(1, [1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=max_tokens))
    sched.add(seq)
    result = sched.schedule()  # the prefill
    mirror.apply(result.plan)
    sched.postprocess(result, [6])
    return sched, mirror, seq


def test_drafts_get_kv_slots_and_verification_rows_then_rejected_ones_roll_back():
    sched, mirror, seq = setup()
    result = sched.schedule({1: [7, 8, 9, 10]})
    assert result.drafts == [[7, 8, 9, 10]] and result.num_new_tokens == [5] and result.needs_sample == [True]
    cached = result.plan.cached_seqs
    assert cached.token_ids == [6, 7, 8, 9, 10] and cached.draft_counts == [4]
    assert len(seq.block_table) == 3  # positions 5..9 of the query need a third block
    batch = mirror.apply(result.plan)
    assert batch.sample_indices.tolist() == [0, 1, 2, 3, 4]  # one row per draft plus the bonus row
    third = seq.block_table[2]

    runs = [[7, 8, 99]]  # two drafts accepted, the third rejected (the target drew 99 there)
    assert sched.postprocess_speculative(result, runs) == []
    assert seq.token_ids == [1, 2, 3, 4, 5, 6, 7, 8, 99]
    assert seq.num_computed_tokens == 8 and len(seq.block_table) == 2
    assert sched.block_manager.ref_count(third) == 0  # the block of rejected positions went back
    # Hashed: blocks [1..4] and [5..8], both computed from accepted tokens; nothing holds 9 or 10.
    h0 = hash_block(None, [1, 2, 3, 4])
    assert set(sched.block_manager.cached_blocks()) == {h0, hash_block(h0, [5, 6, 7, 8])}

    result = sched.schedule()  # a plain decode: the delta drops the rejected drafts and the third block first
    cached = result.plan.cached_seqs
    assert (cached.rollback_tokens, cached.rollback_blocks, cached.token_ids) == ([2], [1], [99])
    mirror.apply(result.plan)
    m = mirror.get(1)
    assert m is not None and m.token_ids == seq.token_ids and m.block_table == seq.block_table
    assert m.num_computed == 9


def test_drafts_count_against_the_budget_and_are_cut_to_it():
    sched, mirror, seq = setup()
    sched.config.max_num_batched_tokens = 3
    result = sched.schedule({1: [7, 8, 9, 10]})
    assert result.num_new_tokens == [3] and result.drafts == [[7, 8]]
    assert result.plan.cached_seqs.token_ids == [6, 7, 8] and result.plan.num_tokens == 3
    sched.postprocess_speculative(result, [[7, 8, 9]])  # every draft accepted: nothing to roll back
    assert seq.token_ids[-3:] == [7, 8, 9] and seq.num_computed_tokens == 8
    assert sched.schedule().plan.cached_seqs.rollback_tokens == [0]


def test_a_stop_inside_the_run_cuts_it_and_frees_the_sequence():
    sched, mirror, seq = setup(max_tokens=3)  # one token so far: two more end it
    result = sched.schedule({1: [7, 8, 9]})
    runs = [[7, 8, 9, 10]]
    assert sched.postprocess_speculative(result, runs) == [seq]
    assert runs == [[7, 8]] and seq.completion_token_ids == [6, 7, 8] and seq.finish_reason == "length"
    assert sched.block_manager.num_free_blocks == 16
    eos_sched, _, eos_seq = setup()
    result = eos_sched.schedule({1: [7, 0, 9]})
    runs = [[7, 0, 9, 4]]
    eos_sched.postprocess_speculative(result, runs)
    assert runs == [[7, 0]] and eos_seq.finish_reason == "stop"
