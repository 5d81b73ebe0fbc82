"""Scheduler forks (n > 1) and prompt-logprob chunks, checked by the simulated workers of test_scheduler."""

from __future__ import annotations

import pytest

from rtp.core.scheduler import Scheduler, SchedulerLimits
from rtp.core.sequence import Sequence
from rtp.sampling import SamplingParams
from tests.core.test_scheduler import World, check_invariants

BS = 4


def make(num_blocks: int = 32, budget: int = 64, caching: bool = True) -> tuple[Scheduler, World]:
    sched = Scheduler(SchedulerLimits(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=128,
                                      block_size=BS, num_blocks=num_blocks, enable_prefix_caching=caching), [0])
    return sched, World(sched)


@pytest.mark.parametrize("prompt_len", [10, 12])  # a partial last block, and none
@pytest.mark.parametrize("caching", [True, False])
def test_forks_share_full_prompt_blocks_and_recompute_only_the_tail(prompt_len: int, caching: bool) -> None:
    sched, world = make(caching=caching)
    prompt = list(range(1, prompt_len + 1))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    parent = Sequence(0, prompt, params)
    children = [Sequence(i, prompt, params) for i in (1, 2)]
    sched.add(parent)
    result = sched.schedule()
    world.apply(result)
    sched.postprocess(result, [100], {0: [(children[0], 101), (children[1], 102)]})
    full = prompt_len // BS
    for child in children:
        assert child.block_table == parent.block_table[:full]
        assert child.num_computed_tokens == full * BS and child.is_fork
    for b in parent.block_table[:full]:
        assert sched.block_manager.ref_count(b) == 3
    all_seqs = [parent, *children]
    token = 200
    for _ in range(20):
        if not sched.has_unfinished():
            break
        result = sched.schedule()
        world.apply(result)  # checks the KV each sequence reads and that nothing writes into a shared block
        token += 1
        sched.postprocess(result, [token] * sum(result.needs_sample))
        check_invariants(sched, world, all_seqs)
    assert all(s.is_finished and s.num_completion_tokens == 6 for s in all_seqs)
    assert [c.token_ids[prompt_len] for c in children] == [101, 102]
    stats = sched.stats
    assert stats.num_prefills == 1 and stats.num_prefill_tokens_computed == prompt_len
    assert stats.num_fork_tail_tokens == (2 * (prompt_len % BS + 1) if prompt_len % BS else 0)
    assert stats.num_free_blocks == stats.num_blocks


def test_fork_that_ends_at_once_and_abort_of_a_waiting_fork() -> None:
    sched, world = make()
    prompt = list(range(1, 11))
    parent = Sequence(0, prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    short = Sequence(1, prompt, SamplingParams(max_tokens=1))
    waiting = Sequence(2, prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    sched.add(parent)
    result = sched.schedule()
    world.apply(result)
    finished = sched.postprocess(result, [50], {0: [(short, 51), (waiting, 52)]})
    assert finished == [short] and short.finish_reason == "length" and short.block_table == []
    sched.abort(waiting.seq_id)  # holds shared blocks while queued: they must come back
    assert waiting.block_table == [] and waiting.finish_reason == "abort"
    sched.abort(parent.seq_id)
    assert sched.stats.num_free_blocks == sched.stats.num_blocks and not sched.has_unfinished()


def test_prompt_logprob_chunks_are_listed_and_skip_the_prefix_cache() -> None:
    sched, world = make(budget=6)
    prompt = list(range(1, 15))
    first = Sequence(0, prompt, SamplingParams(max_tokens=1))
    sched.add(first)
    while sched.has_unfinished():
        result = sched.schedule()
        world.apply(result)
        assert result.plan.prompt_logprob_seq_ids == []
        sched.postprocess(result, [7] * sum(result.needs_sample))
    wants = Sequence(1, prompt, SamplingParams(max_tokens=1, prompt_logprobs=1))
    sched.add(wants)
    listed, computed = [], []
    while sched.has_unfinished():
        result = sched.schedule()
        world.apply(result)
        listed.append(result.plan.prompt_logprob_seq_ids == [1])
        computed.append(wants.num_computed_tokens)
        sched.postprocess(result, [7] * sum(result.needs_sample))
    assert wants.num_cached_tokens == 0 and computed[0] == 0  # the cached prefix was not used
    # Every chunk up to the one holding position len - 2 is listed; none after.
    assert listed == [c < len(prompt) - 1 for c in computed]


def _two_requests_with_forks(sched: Scheduler, world: World, parent_max: int, fork_max: int) -> list[Sequence]:
    """Two 8-token prompts (two full blocks each), n = 2: both prefilled in one step, then forked."""
    parents = [Sequence(i, list(range(10 * i + 1, 10 * i + 9)), SamplingParams(max_tokens=parent_max,
                                                                                 ignore_eos=True)) for i in (0, 1)]
    forks = [Sequence(i + 2, p.token_ids[:], SamplingParams(max_tokens=fork_max, ignore_eos=True))
             for i, p in enumerate(parents)]
    for p in parents:
        sched.add(p)
    result = sched.schedule()
    world.apply(result)
    assert result.seqs == parents
    sched.postprocess(result, [100, 101], {0: [(forks[0], 102)], 1: [(forks[1], 103)]})
    return parents + forks


def _run_down(sched: Scheduler, world: World, seqs: list[Sequence]) -> None:
    token = 200
    for _ in range(60):
        if not sched.has_unfinished():
            break
        result = sched.schedule()
        assert result.seqs, "an empty step with work left: nothing can ever run"
        world.apply(result)
        token += 1
        sched.postprocess(result, [token] * sum(result.needs_sample))
        check_invariants(sched, world, seqs)
    assert not sched.has_unfinished()
    assert sched.stats.num_free_blocks == sched.stats.num_blocks


def test_waiting_forks_give_up_their_blocks_before_a_running_sequence_cannot_fit() -> None:
    # 4 blocks of 4 tokens; each request alone needs 3 (12 tokens): the waiting forks hold every prompt block, so
    # preempting the other running parent alone freed nothing (the first parent then "could not fit alone").
    sched, world = make(num_blocks=4)
    seqs = _two_requests_with_forks(sched, world, parent_max=4, fork_max=4)
    _run_down(sched, world, seqs)
    assert all(s.finish_reason == "length" and s.num_completion_tokens == 4 for s in seqs)
    assert sched.stats.num_preemptions >= 3  # both forks, then the newer parent


@pytest.mark.parametrize("caching", [True, False])
def test_forks_holding_every_block_with_nothing_running_still_start(caching: bool) -> None:
    # Both parents end at their first token; their forks hold all 4 blocks and each needs a fifth to decode. The
    # steps were empty for ever (a hang); now the newer fork gives its blocks up and recomputes later.
    sched, world = make(num_blocks=4, caching=caching)
    seqs = _two_requests_with_forks(sched, world, parent_max=1, fork_max=3)
    assert [s.is_finished for s in seqs] == [True, True, False, False] and not sched.running
    _run_down(sched, world, seqs)
    assert [s.num_completion_tokens for s in seqs] == [1, 1, 3, 3]
    assert [s.token_ids[8] for s in seqs] == [100, 101, 102, 103]  # each fork keeps its first token
