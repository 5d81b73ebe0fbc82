"""PlanBuilder: new sequences in full, deltas against what was sent, freed ids, rollbacks."""

from __future__ import annotations

from rtp.core.plan_builder import PlanBuilder
from rtp.core.sequence import Sequence
from rtp.core.step import CachedSeq, NewSeq
from rtp.sampling import SamplingParams


def make_seq(seq_id: int, tokens: list[int], blocks: list[int], prompt_logprobs: int | None = None) -> Sequence:
    seq = Sequence(seq_id, tokens, SamplingParams(prompt_logprobs=prompt_logprobs))
    seq.block_table = list(blocks)
    return seq


def test_new_in_full_then_deltas_of_what_changed() -> None:
    plans = PlanBuilder()
    a, b = make_seq(1, [5, 6, 7], [0]), make_seq(2, [8, 9], [1], prompt_logprobs=1)
    plan = plans.build([a, b], [3, 2], [], [])
    assert plan.new_seqs == [NewSeq(1, [5, 6, 7], [0], 0, 3), NewSeq(2, [8, 9], [1], 0, 2)]
    assert plan.prompt_logprob_seq_ids == [2] and plan.cached_seqs == [] and plan.freed_seq_ids == []
    a.token_ids.append(10)
    a.block_table.append(4)
    b.token_ids.append(11)
    b.needs_prompt_logits = False
    plan = plans.build([], [], [b, a], [1, 1])
    assert plan.new_seqs == [] and plan.prompt_logprob_seq_ids == []
    assert list(plan.cached_seqs) == [CachedSeq(2, 1, [11], []), CachedSeq(1, 1, [10], [4])]
    # Nothing new since: an empty delta.
    assert list(plans.build([], [], [a], [1]).cached_seqs) == [CachedSeq(1, 1, [], [])]


def test_released_ids_ride_on_the_next_non_empty_plan() -> None:
    plans = PlanBuilder()
    a, b = make_seq(1, [5], [0]), make_seq(2, [6], [1])
    plans.build([a, b], [1, 1], [], [])
    plans.release(1)
    plans.release(1)  # a second release of the same sequence frees it once
    plans.release(7)  # never sent: nothing to free
    assert not plans.is_mirrored(1) and plans.is_mirrored(2)
    assert plans.build([], [], [], []).freed_seq_ids == []  # an empty plan, which an engine may skip
    assert plans.build([], [], [b], [1]).freed_seq_ids == [1]
    assert plans.build([], [], [b], [1]).freed_seq_ids == []
    # A released sequence scheduled again is sent in full.
    plan = plans.build([a], [1], [], [])
    assert plan.new_seqs == [NewSeq(1, [5], [0], 0, 1)]


def test_rollbacks_add_up_until_the_next_delta() -> None:
    plans = PlanBuilder()
    a = make_seq(1, list(range(10)), [0, 1, 2])
    plans.build([a], [10], [], [])
    plans.rollback(1, 8, 3)
    plans.rollback(1, 6, 2)  # a second cut before any plan: both reach the mirror as one
    plans.rollback(1, 9, 3)  # keeping more than the mirror holds changes nothing
    del a.token_ids[6:]
    del a.block_table[2:]
    a.token_ids += [40, 41]
    a.block_table += [7]
    (delta,) = plans.build([], [], [a], [2]).cached_seqs
    assert delta == CachedSeq(1, 2, [40, 41], [7], rollback_tokens=4, rollback_blocks=1)
    (delta,) = plans.build([], [], [a], [1]).cached_seqs
    assert delta.rollback_tokens == delta.rollback_blocks == 0
    plans.rollback(1, 2, 1)
    plans.release(1)  # a released sequence's rollback goes with it
    plan = plans.build([make_seq(1, [1], [3])], [1], [], [])
    assert plan.freed_seq_ids == [1] and plan.new_seqs[0].token_ids == [1]
    plans.rollback(5, 1, 1)  # an unknown sequence: nothing to roll back
