"""Scheduler: continuous batching, chunked prefill, preemption, prefix cache, StepPlan deltas.

``World`` plays the workers: it applies every StepPlan to a mirror (freed, then
new, then cached deltas) and to a simulated KV cache in which the slot of
position ``p`` of a sequence holds the tuple of tokens ``[0, p]`` (what real KV
depends on). Reading a cache hit therefore checks that the block really holds
that prefix, so stale hashes, hashes registered before compute, and blocks
shared while being written all show up as wrong KV.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from rtp.core.block_manager import hash_block
from rtp.core.scheduler import Scheduler, ScheduleResult, SchedulerLimits
from rtp.core.sequence import Sequence, SequenceStatus
from rtp.errors import ConfigError, RequestError
from rtp.sampling import SamplingParams

EOS = 0


class World:
    """Workers' view: a mirror of the running batch plus simulated KV content."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        bs = sched.config.block_size
        self.bs = bs
        self.mirror: dict[int, dict] = {}  # seq_id -> {"tokens", "blocks", "computed"}
        self.kv: list[list[tuple | None]] = [[None] * bs for _ in range(sched.config.num_blocks)]

    def apply(self, result: ScheduleResult, busy: dict[int, int] | None = None) -> None:
        """Apply a plan like a worker and check it against the scheduler's view (``busy``: the tokens of
        each sequence in steps applied here but not postprocessed yet, as the scheduler was given)."""
        plan, cfg, bm = result.plan, self.sched.config, self.sched.block_manager
        busy = busy or {}
        assert plan.num_tokens <= cfg.max_num_batched_tokens
        assert len(self.sched.running) <= cfg.max_num_seqs
        for seq_id in plan.freed_seq_ids:
            assert seq_id in self.mirror, f"freeing unknown seq {seq_id}"
            del self.mirror[seq_id]
        for ns in plan.new_seqs:
            assert ns.seq_id not in self.mirror, f"seq {ns.seq_id} sent as new while mirrored"
            self.mirror[ns.seq_id] = {
                "tokens": list(ns.token_ids),
                "blocks": list(ns.block_table),
                "computed": ns.num_computed_tokens,
            }
        for cs in plan.cached_seqs:
            m = self.mirror[cs.seq_id]
            m["tokens"] += cs.new_token_ids
            m["blocks"] += cs.new_block_ids
        batch = [(s.seq_id, s.num_new_tokens) for s in [*plan.new_seqs, *plan.cached_seqs]]
        assert batch == [(s.seq.seq_id, s.num_new_tokens) for s in result.scheduled]
        # The mirror of every scheduled sequence equals the scheduler's view of it.
        for item in result.scheduled:
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens + busy.get(seq.seq_id, 0)
            m = self.mirror[seq.seq_id]
            assert m["tokens"] == seq.token_ids
            assert m["blocks"] == seq.block_table
            assert m["computed"] == start
            assert n >= 1
            assert start + n <= seq.num_tokens
            assert len(seq.block_table) * self.bs >= start + n
            assert item.needs_sample == (start + n == seq.num_tokens)
        # Running but not scheduled: the mirror is a prefix of what is known.
        for seq in self.sched.running:
            m = self.mirror[seq.seq_id]
            assert seq.token_ids[: len(m["tokens"])] == m["tokens"]
            assert seq.block_table[: len(m["blocks"])] == m["blocks"]
        # "Run" the step as a layer does: first write the KV of the query positions, never into a shared block
        # other than one this step fills for the first time (a later admission of the step may share it: an
        # admission's blocks past its hit, a running sequence's from the one its chunk starts in)...
        fresh = {b: ns.seq_id for ns in plan.new_seqs for b in ns.block_table[ns.num_computed_tokens // self.bs:]}
        running_ids = {cs.seq_id for cs in plan.cached_seqs}
        fresh.update((b, item.seq.seq_id) for item in result.scheduled if item.seq.seq_id in running_ids
                     for b in item.seq.block_table[(item.seq.num_computed_tokens + busy.get(item.seq.seq_id, 0))
                                                   // self.bs:])  # block -> who fills it
        for item in result.scheduled:
            seq = item.seq
            start = seq.num_computed_tokens + busy.get(seq.seq_id, 0)
            for p in range(start, start + item.num_new_tokens):
                block = seq.block_table[p // self.bs]
                assert bm.ref_count(block) == 1 or fresh.get(block) == seq.seq_id, f"writing into shared block {block}"
                self.kv[block][p % self.bs] = tuple(seq.token_ids[: p + 1])
        # ... then attend: computed positions (cache hits and chunks in flight included) hold this sequence's KV.
        for item in result.scheduled:
            seq = item.seq
            for p in range(seq.num_computed_tokens + busy.get(seq.seq_id, 0)):
                assert self.kv[seq.block_table[p // self.bs]][p % self.bs] == tuple(seq.token_ids[: p + 1])
            self.mirror[seq.seq_id]["computed"] += item.num_new_tokens


def check_invariants(sched: Scheduler, world: World, all_seqs: list[Sequence]) -> None:
    """Block accounting, ref counts, hash map content, queue states."""
    bm, cfg = sched.block_manager, sched.config
    plain, cached = bm.free_block_ids()
    free = plain + cached
    assert len(free) == len(set(free)), "a block is free twice"
    holders: dict[int, int] = {}
    for seq in sched.running:
        assert seq.status is SequenceStatus.RUNNING
        assert len(seq.block_table) == len(set(seq.block_table))
        assert len(seq.block_table) == bm.num_blocks_for(seq.num_computed_tokens)
        assert seq.num_computed_tokens < seq.num_tokens
        for b in seq.block_table:
            holders[b] = holders.get(b, 0) + 1
    for b in range(cfg.num_blocks):
        assert bm.ref_count(b) == holders.get(b, 0), f"block {b} ref count"
        assert (b in free) == (b not in holders)
    assert len(free) + len(holders) == cfg.num_blocks, "leaked block"
    for seq in sched.waiting:
        assert seq.status is SequenceStatus.WAITING and seq.block_table == [] and seq.num_computed_tokens == 0
    for seq in all_seqs:
        if seq.is_finished:
            assert seq.block_table == [] and sched.get(seq.seq_id) is not seq
            assert seq.finish_reason in ("stop", "length", "abort")
    assert len(sched.running) <= cfg.max_num_seqs
    assert len(sched.waiting) + len(sched.running) == sum(1 for s in all_seqs if not s.is_finished)
    # Every cached hash points at a full block whose KV is exactly the prefix it names.
    cached_map = bm.cached_blocks()
    for b in range(cfg.num_blocks):
        h = bm.block_hash(b)
        assert (h is not None) == (b in cached_map.values())
        assert b not in cached or h is not None
        assert b not in plain or h is None
    for h, b in cached_map.items():
        assert bm.block_hash(b) == h
        slots = world.kv[b]
        assert all(s is not None for s in slots), "cached block not fully computed"
        prefix = list(slots[-1])
        chain = None
        for i in range(len(prefix) // cfg.block_size):
            chain = hash_block(chain, prefix[i * cfg.block_size : (i + 1) * cfg.block_size])
        assert chain == h, "hash map entry does not match the block's content"
    stats = sched.stats
    assert stats.num_free_blocks == len(free)
    assert stats.kv_usage == pytest.approx(len(holders) / cfg.num_blocks)
    assert 0 <= stats.prefix_hit_tokens <= stats.prefix_query_tokens


def step(sched: Scheduler, world: World, tokens: list[int] | None = None, token: int = 7) -> tuple:
    """One schedule + simulated execute + postprocess. Returns (result, finished)."""
    result = sched.schedule()
    world.apply(result)
    n = sum(1 for s in result.scheduled if s.needs_sample)
    sampled = tokens if tokens is not None else [token] * n
    return result, sched.postprocess(result, sampled)


def make(
    block_size: int = 4,
    num_blocks: int = 16,
    max_num_seqs: int = 4,
    budget: int = 64,
    max_model_len: int = 64,
    caching: bool = True,
) -> tuple[Scheduler, World]:
    cfg = SchedulerLimits(max_num_seqs, budget, max_model_len, block_size, num_blocks, caching)
    sched = Scheduler(cfg, [EOS])
    return sched, World(sched)


def seq(seq_id: int, prompt: list[int], **kw) -> Sequence:
    return Sequence(seq_id, prompt, SamplingParams(**kw))


def run_to_end(sched: Scheduler, world: World, all_seqs: list[Sequence], max_steps: int, token: int = 7) -> int:
    steps = 0
    while sched.has_unfinished():
        assert steps < max_steps, "scheduler made no progress"
        step(sched, world, token=token)
        check_invariants(sched, world, all_seqs)
        steps += 1
    return steps


# ---------------------------------------------------------------------- unit tests


def test_config_validation() -> None:
    with pytest.raises(ConfigError, match="block_size"):
        SchedulerLimits(4, 64, 64, 0, 16)
    with pytest.raises(ConfigError, match="num_blocks"):
        SchedulerLimits(4, 64, 64, 4, True)  # type: ignore[arg-type]


def test_rejects_never_fitting_requests() -> None:
    sched, _ = make(block_size=4, num_blocks=4, max_model_len=32)
    with pytest.raises(RequestError, match="32"):
        sched.add(seq(0, [1] * 32))  # prompt >= max_model_len
    with pytest.raises(RequestError, match="4 blocks"):
        sched.add(seq(2, [1] * 17, max_tokens=1))  # 5 blocks needed, 4 exist
    with pytest.raises(RequestError, match="empty"):
        sched.add(seq(3, []))
    with pytest.raises(RequestError, match="empty"):
        sched.validate(seq(5, []))  # validate alone queues nothing
    sched.validate(seq(1, [1] * 12, max_tokens=21))  # 12 + 21 > 32 is served: it ends with "length"
    assert not sched.has_unfinished()
    sched.add(seq(4, [1] * 16, max_tokens=16))  # fits exactly
    with pytest.raises(RequestError, match="already in use"):
        sched.add(seq(4, [1]))
    assert not sched.waiting[0].is_finished and len(sched.waiting) == 1


def test_chunked_prefill() -> None:
    sched, world = make(budget=8)
    s = seq(0, list(range(1, 21)), max_tokens=2, ignore_eos=True)
    sched.add(s)
    chunks = []
    while sched.has_unfinished():
        result, _ = step(sched, world)
        chunks.append([(x.num_new_tokens, x.needs_sample) for x in result.scheduled])
    assert chunks == [[(8, False)], [(8, False)], [(4, True)], [(1, True)]]
    assert s.num_completion_tokens == 2 and s.finish_reason == "length"
    assert sched.stats.num_prefill_tokens_computed == 20 and sched.stats.num_decode_tokens == 1


def test_mixed_prefill_and_decode_in_one_step() -> None:
    sched, world = make(budget=10)
    a = seq(0, [1, 2, 3], max_tokens=5, ignore_eos=True)
    sched.add(a)
    step(sched, world)  # a prefilled, now decoding
    b = seq(1, list(range(1, 31)), max_tokens=1)
    sched.add(b)
    result, _ = step(sched, world)
    # Decode first, the prefill chunk gets the rest of the budget.
    assert [s.seq_id for s in result.plan.cached_seqs] == [0]
    assert [(s.seq_id, s.num_new_tokens) for s in result.plan.new_seqs] == [(1, 9)]
    assert result.plan.cached_seqs[0].num_new_tokens == 1
    assert result.plan.num_tokens == 10


def test_max_num_seqs_limits_running() -> None:
    sched, world = make(max_num_seqs=2)
    seqs = [seq(i, [i + 1] * 3, max_tokens=3, ignore_eos=True) for i in range(5)]
    for s in seqs:
        sched.add(s)
    result, _ = step(sched, world)
    assert len(result.scheduled) == 2 and len(sched.running) == 2
    run_to_end(sched, world, seqs, max_steps=50)
    assert all(s.finish_reason == "length" for s in seqs)


def test_finish_conditions() -> None:
    sched, world = make()
    eos = seq(0, [1, 2], max_tokens=10)
    ign = seq(1, [1, 2], max_tokens=3, ignore_eos=True)
    stop = seq(2, [1, 2], max_tokens=10, ignore_eos=True, stop_token_ids=[5])
    minimum = seq(3, [1, 2], max_tokens=10, min_tokens=3)
    for s in (eos, ign, stop, minimum):
        sched.add(s)
    step(sched, world, tokens=[EOS, EOS, 5, EOS])  # eos and stop end; ignored eos and min_tokens don't
    assert eos.finish_reason == "stop" and stop.finish_reason == "stop"
    assert not ign.is_finished and not minimum.is_finished
    step(sched, world, tokens=[EOS, 5])  # ign: eos ignored; minimum: 2 < min_tokens, stop token suppressed
    assert not ign.is_finished and not minimum.is_finished
    _, done = step(sched, world, tokens=[EOS, EOS])  # ign: max_tokens; minimum: 3rd token may stop
    assert ign.finish_reason == "length" and ign.completion_token_ids == [EOS, EOS, EOS]
    assert minimum.finish_reason == "stop" and minimum.completion_token_ids == [EOS, 5, EOS]
    assert set(done) == {ign, minimum} and not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == 16


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.sampled_from([EOS, 5, 7, 9]), min_size=40, max_size=40),
    min_tokens=st.integers(0, 6),
    max_tokens=st.one_of(st.none(), st.integers(6, 20)),
    stop_token_ids=st.lists(st.sampled_from([5, 9]), max_size=2),
    ignore_eos=st.booleans(),
    prompt_len=st.integers(1, 12),
)
def test_finish_matches_the_stop_rule(tokens: list[int], min_tokens: int, max_tokens: int | None,
                                      stop_token_ids: list[int], ignore_eos: bool, prompt_len: int) -> None:
    """Each sampled token ends the sequence exactly where vLLM's stop rule says (written out here)."""
    max_model_len = 32
    sched, world = make(max_model_len=max_model_len)
    s = seq(0, [1] * prompt_len, min_tokens=min_tokens, max_tokens=max_tokens, stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos)
    sched.add(s)
    expected: tuple[int, str] | None = None  # (completion length, reason) where it must end
    for i, token in enumerate(tokens, start=1):
        if i >= min_tokens and ((token == EOS and not ignore_eos) or token in stop_token_ids):
            expected = (i, "stop")
        elif i == max_tokens or prompt_len + i >= max_model_len:
            expected = (i, "length")
        if expected:
            break
    assert expected is not None  # 40 tokens always reach max_model_len
    for token in tokens:
        step(sched, world, tokens=[token])
        if s.is_finished:
            break
    assert (s.num_completion_tokens, s.finish_reason) == expected
    assert s.completion_token_ids == tokens[: expected[0]]


def test_max_model_len_finishes_with_length() -> None:
    sched, world = make(max_model_len=10)
    s = seq(0, [1] * 6, max_tokens=None)
    sched.add(s)
    run_to_end(sched, world, [s], max_steps=20)
    assert s.finish_reason == "length" and s.num_tokens == 10


def test_kv_capacity_finishes_with_length() -> None:
    # The cache holds 8 tokens: a sequence can never know more than 8 + 1 tokens.
    sched, world = make(block_size=4, num_blocks=2, max_model_len=64)
    s = seq(0, [1] * 5, max_tokens=40, ignore_eos=True)
    sched.add(s)
    run_to_end(sched, world, [s], max_steps=20)
    assert s.finish_reason == "length" and s.num_tokens == 9


def test_abort_frees_blocks() -> None:
    sched, world = make(num_blocks=8)
    a = seq(0, [1] * 9, max_tokens=8)
    b = seq(1, [2] * 9, max_tokens=8)
    c = seq(2, [3] * 9, max_tokens=8)
    for s in (a, b, c):
        sched.add(s)
    step(sched, world)  # a, b admitted (3 blocks each); c waits for blocks
    assert c.status is SequenceStatus.WAITING
    held = sched.block_manager.num_blocks - sched.block_manager.num_free_blocks
    assert held == 6
    assert sched.abort(0)
    assert a.finish_reason == "abort" and a.block_table == []
    assert sched.block_manager.num_free_blocks == 8 - 3
    assert sched.abort(2) and c.finish_reason == "abort"  # waiting: removed, nothing to free
    assert not sched.abort(2) and not sched.abort(99)
    result, _ = step(sched, world)
    assert result.plan.freed_seq_ids == [0]  # c was never sent to the workers
    check_invariants(sched, world, [a, b, c])


def test_abort_between_schedule_and_postprocess() -> None:
    sched, world = make()
    a, b = seq(0, [1, 2, 3], max_tokens=4), seq(1, [4, 5, 6], max_tokens=4)
    sched.add(a)
    sched.add(b)
    result = sched.schedule()
    world.apply(result)
    sched.abort(0)
    done = sched.postprocess(result, [7, 8])
    assert done == [] and a.num_completion_tokens == 0 and b.completion_token_ids == [8]
    check_invariants(sched, world, [a, b])


def test_engine_finish_frees_and_is_idempotent() -> None:
    sched, world = make()
    a = seq(0, [1, 2, 3], max_tokens=4)
    sched.add(a)
    step(sched, world)
    sched.finish(0, "stop")
    sched.finish(0, "stop")
    assert a.finish_reason == "stop" and sched.block_manager.num_free_blocks == 16
    result, _ = step(sched, world)
    assert result.plan.num_tokens == 0 and not sched.has_unfinished()


def test_prefix_hit_across_requests_and_stats() -> None:
    sched, world = make(block_size=4)
    prompt = list(range(1, 11))
    a = seq(0, prompt, max_tokens=1)
    sched.add(a)
    step(sched, world)
    b = seq(1, prompt[:8] + [50, 51, 52], max_tokens=1)
    sched.add(b)
    result, _ = step(sched, world)
    assert result.plan.new_seqs[0].num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert result.plan.new_seqs[0].num_new_tokens == 3
    st_ = sched.stats
    assert (st_.prefix_query_tokens, st_.prefix_hit_tokens) == (21, 8)


def test_full_prompt_hit_still_computes() -> None:
    """Bug (c): a prompt entirely in the cache still gets a non-empty query."""
    for prompt_len in (8, 9):
        sched, world = make(block_size=4)
        prompt = list(range(1, prompt_len + 1))
        a = seq(0, prompt, max_tokens=1)
        sched.add(a)
        step(sched, world)
        b = seq(1, prompt, max_tokens=2, ignore_eos=True)
        sched.add(b)
        result, _ = step(sched, world)
        (item,) = result.scheduled
        assert item.num_new_tokens >= 1 and item.needs_sample
        assert b.num_cached_tokens == 4 * ((prompt_len - 1) // 4)
        assert b.num_completion_tokens == 1
        run_to_end(sched, world, [a, b], max_steps=5)
        # The recomputed last block did not replace or duplicate the cached one: one entry per
        # distinct full block (b computed prompt + its first token, the same token a got).
        assert len(sched.block_manager.cached_blocks()) == (prompt_len + 1) // 4


def test_same_prefix_in_one_step() -> None:
    """Two sequences with one prefix admitted in the same step: the second shares the blocks the first computes
    (the World writes the step's KV before it checks what each sequence attends to)."""
    sched, world = make(block_size=2, num_blocks=12)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    a, b = seq(0, prompt, max_tokens=2, ignore_eos=True), seq(1, prompt, max_tokens=2, ignore_eos=True)
    sched.add(a)
    sched.add(b)
    result, _ = step(sched, world)
    assert [s.num_new_tokens for s in result.scheduled] == [7, 1]  # b computes only its last token
    assert b.num_cached_tokens == 6 and a.block_table[:3] == b.block_table[:3]
    assert a.block_table[3] != b.block_table[3]  # the partial last block is each one's own
    check_invariants(sched, world, [a, b])
    assert len(sched.block_manager.cached_blocks()) == 3  # one entry per distinct prefix block
    run_to_end(sched, world, [a, b], max_steps=5)
    assert sched.block_manager.num_free_blocks == 12
    # A third request gets a hit on the surviving entries.
    c = seq(2, prompt, max_tokens=1)
    sched.add(c)
    step(sched, world)
    assert c.num_cached_tokens == 6


def test_a_step_registers_only_the_blocks_it_computes() -> None:
    """A chunked prefill's blocks become findable chunk by chunk, when the step that computes them is scheduled;
    a prompt whose prefix is only partly computed so far shares just that part."""
    sched, world = make(block_size=2, budget=4)
    a = seq(0, list(range(1, 10)), max_tokens=1)
    sched.add(a)
    result = sched.schedule()
    assert len(sched.block_manager.cached_blocks()) == 2  # the chunk's 4 positions: 2 full blocks
    world.apply(result)
    sched.postprocess(result, [])
    assert len(sched.block_manager.cached_blocks()) == 2
    b = seq(1, list(range(1, 10)), max_tokens=1)
    sched.add(b)
    result, _ = step(sched, world)  # a's next chunk (4 positions: blocks 3 and 4), then nothing left for b
    assert [s.seq.seq_id for s in result.scheduled] == [0]
    assert len(sched.block_manager.cached_blocks()) == 4
    result, _ = step(sched, world)  # a's last position, then b: a hit on a's 4 blocks, 1 position to compute
    assert [s.num_new_tokens for s in result.scheduled] == [1, 1] and b.num_cached_tokens == 8


def test_an_admission_shares_the_blocks_a_running_chunk_fills_in_its_step() -> None:
    """A long prompt's last chunk fills a block in the step that admits a second request with the same prompt: the
    second one shares it at once (it computed those positions again before)."""
    sched, world = make(block_size=2, budget=8)
    prompt = list(range(1, 12))  # 11 positions: 8 in the first chunk, the last 3 (filling block 4) in the second
    a, b = seq(0, prompt, max_tokens=2, ignore_eos=True), seq(1, prompt, max_tokens=2, ignore_eos=True)
    sched.add(a)
    step(sched, world)
    sched.add(b)
    result, _ = step(sched, world)
    assert {s.seq.seq_id: s.num_new_tokens for s in result.scheduled} == {0: 3, 1: 1}
    assert b.num_cached_tokens == 10 and b.block_table[:5] == a.block_table[:5]
    check_invariants(sched, world, [a, b])
    run_to_end(sched, world, [a, b], max_steps=5)


def test_stale_hash_not_hit_after_reuse() -> None:
    """Bug (a): after a cached block is reused for other content, its old prefix misses."""
    sched, world = make(block_size=2, num_blocks=3, max_model_len=16)
    a = seq(0, [1, 2, 3, 4], max_tokens=1)
    sched.add(a)
    step(sched, world)
    b = seq(1, [9, 9, 9, 9, 9], max_tokens=1)  # needs all 3 blocks: evicts a's cached ones
    sched.add(b)
    step(sched, world)
    c = seq(2, [1, 2, 3, 4, 5], max_tokens=1)
    sched.add(c)
    result, _ = step(sched, world)  # World checks that any hit holds [1, 2, ...] KV
    assert c.num_cached_tokens == 0
    assert result.plan.new_seqs[0].num_computed_tokens == 0


def test_preemption_and_readmission_with_cache_hit() -> None:
    """Bug (d): the newest running sequence is preempted, requeued first, and hits the cache on return."""
    sched, world = make(block_size=2, num_blocks=8, budget=32, max_model_len=32)
    a = seq(0, [1, 2, 3, 4, 5], max_tokens=8, ignore_eos=True)
    b = seq(1, [6, 7, 8, 9, 10], max_tokens=8, ignore_eos=True)
    c = seq(2, [11, 12, 13, 14, 15], max_tokens=1)
    for s in (a, b, c):
        sched.add(s)
    step(sched, world)  # a, b: 3 blocks each; c (3 blocks) waits
    assert c.status is SequenceStatus.WAITING
    preempted_at = None
    for i in range(20):
        result, _ = step(sched, world)
        check_invariants(sched, world, [a, b, c])
        if b.status is SequenceStatus.WAITING and preempted_at is None:
            preempted_at = i
            assert list(sched.waiting)[:2] == [b, c]  # front of the queue, before c
            assert a.status is SequenceStatus.RUNNING  # the oldest keeps running
            assert sched.stats.num_preemptions == 1
            assert result.plan.freed_seq_ids == [1]  # the workers drop it in the same step
            known = b.num_tokens
        elif preempted_at is not None and b.status is SequenceStatus.RUNNING:
            # Readmitted as new with every known token, starting after its cached blocks.
            (ns,) = [n for n in result.plan.new_seqs if n.seq_id == 1]
            assert ns.token_ids == b.token_ids[: len(ns.token_ids)] and len(ns.token_ids) == known
            assert ns.num_computed_tokens >= 4 and b.num_cached_tokens == ns.num_computed_tokens
            break
    else:
        pytest.fail("b was not preempted and readmitted")
    run_to_end(sched, world, [a, b, c], max_steps=60)
    assert a.num_completion_tokens == 8 and b.num_completion_tokens == 8 and c.is_finished


def test_preempted_id_freed_in_plan() -> None:
    sched, world = make(block_size=2, num_blocks=4, budget=32, max_model_len=32)
    a = seq(0, [1, 2, 3], max_tokens=6, ignore_eos=True)
    b = seq(1, [4, 5, 6], max_tokens=6, ignore_eos=True)
    sched.add(a)
    sched.add(b)
    freed_seen = False
    for _ in range(40):
        if not sched.has_unfinished():
            break
        before = b.status
        result, _ = step(sched, world)
        if before is SequenceStatus.RUNNING and b.status is SequenceStatus.WAITING:
            assert result.plan.freed_seq_ids == [1]  # World also checked it was mirrored
            freed_seen = True
    assert freed_seen and not sched.has_unfinished()


def test_big_request_not_starved() -> None:
    # A request needing the whole cache waits behind small ones, which keep coming.
    sched, world = make(block_size=2, num_blocks=8, max_num_seqs=4, budget=8, max_model_len=32)
    seqs = [seq(i, [i + 1] * 3, max_tokens=4, ignore_eos=True) for i in range(3)]
    big = seq(100, [9] * 15, max_tokens=1)
    for s in seqs:
        sched.add(s)
    sched.add(big)
    next_id = 3
    for _ in range(200):
        if big.is_finished:
            break
        s = seq(next_id, [next_id % 5 + 1] * 3, max_tokens=4, ignore_eos=True)
        sched.add(s)
        seqs.append(s)
        next_id += 1
        step(sched, world)
        check_invariants(sched, world, seqs + [big])
    assert big.finish_reason == "length"


def test_deterministic() -> None:
    def trace() -> list:
        sched, world = make(block_size=2, num_blocks=6, budget=6)
        out = []
        for i in range(6):
            sched.add(seq(i, [1, 2, 3, i], max_tokens=5, ignore_eos=True))
        while sched.has_unfinished():
            result, _ = step(sched, world)
            out.append(result.plan)
        return out

    assert trace() == trace()


def test_postprocess_checks_token_count() -> None:
    sched, world = make()
    sched.add(seq(0, [1, 2]))
    result = sched.schedule()
    with pytest.raises(ValueError, match="expected 1"):
        sched.postprocess(result, [])
    with pytest.raises(RuntimeError):
        sched.schedule()


def test_delta_mirror_replay() -> None:
    """Replay a busy workload's plans through World's mirror; it must match the scheduler."""
    sched, world = make(block_size=2, num_blocks=10, max_num_seqs=3, budget=7, max_model_len=24)
    seqs: list[Sequence] = []
    prefixes = [[1, 2, 3, 4], [1, 2, 5, 6], [8, 8]]
    for i in range(12):
        s = seq(i, prefixes[i % 3] + [i % 4 + 1] * (i % 5), max_tokens=3 + i % 6, ignore_eos=i % 2 == 0)
        sched.add(s)
        seqs.append(s)
    steps = 0
    while sched.has_unfinished():
        # Tokens cycle 1..4 and EOS now and then.
        result = sched.schedule()
        world.apply(result)
        n = sum(1 for x in result.scheduled if x.needs_sample)
        sched.postprocess(result, [(steps + k) % 5 for k in range(n)])
        check_invariants(sched, world, seqs)
        if steps == 5:
            sched.abort(4)
        steps += 1
        assert steps < 500
    assert sched.stats.num_preemptions > 0  # the workload is tight enough to exercise preemption
    assert world.mirror.keys() <= {s.seq_id for s in seqs}


# ---------------------------------------------------------------------- property tests


class SchedulerMachine(RuleBasedStateMachine):
    """Random add / step / abort / finish on a tiny cache, checking invariants after each."""

    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        num_blocks=st.integers(2, 12),
        max_num_seqs=st.integers(1, 4),
        budget=st.integers(1, 12),
        max_model_len=st.integers(4, 24),
        caching=st.sampled_from([True, True, True, False]),
    )
    def setup(self, block_size, num_blocks, max_num_seqs, budget, max_model_len, caching) -> None:
        self.sched, self.world = make(block_size, num_blocks, max_num_seqs, budget, max_model_len, caching)
        self.seqs: list[Sequence] = []
        self.next_id = 0

    @rule(
        prefix=st.sampled_from([[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [2, 2]]),
        suffix=st.lists(st.integers(1, 3), max_size=6),
        max_tokens=st.one_of(st.none(), st.integers(1, 10)),
        min_tokens=st.integers(0, 2),
        ignore_eos=st.booleans(),
        stop=st.sampled_from([[], [3]]),
    )
    def add(self, prefix, suffix, max_tokens, min_tokens, ignore_eos, stop) -> None:
        self._add(prefix + suffix, max_tokens, min_tokens, ignore_eos, stop)

    @rule(
        prompt=st.sampled_from([[1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [2, 2], [1, 2, 3, 4, 1, 2]]),
        copies=st.integers(2, 3),
        max_tokens=st.integers(1, 4),
    )
    def add_twins(self, prompt, copies, max_tokens) -> None:
        """Identical prompts arriving together (admitted in one step when they fit)."""
        for _ in range(copies):
            self._add(list(prompt), max_tokens, 0, True, [])

    def _add(self, prompt, max_tokens, min_tokens, ignore_eos, stop) -> None:
        if max_tokens is not None:
            min_tokens = min(min_tokens, max_tokens)
        s = seq(self.next_id, prompt, max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos,
                stop_token_ids=stop)
        self.next_id += 1
        cfg = self.sched.config
        fits = (
            0 < len(prompt) < cfg.max_model_len
            and -(-len(prompt) // cfg.block_size) <= cfg.num_blocks
        )
        if fits:
            self.sched.add(s)
            self.seqs.append(s)
        else:
            with pytest.raises(RequestError):
                self.sched.add(s)
            assert self.sched.get(s.seq_id) is None

    @rule(data=st.data())
    def step(self, data) -> None:
        self.in_step = True  # an assertion inside a step leaves no state worth tearing down
        result = self.sched.schedule()
        self.world.apply(result)
        n = sum(1 for s in result.scheduled if s.needs_sample)
        tokens = data.draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
        finished = self.sched.postprocess(result, tokens)
        assert all(s.is_finished for s in finished)
        # Finish reasons against the rules written out independently.
        cfg = self.sched.config
        sampled = iter(tokens)
        for item in result.scheduled:
            if not item.needs_sample:
                assert not item.seq.is_finished
                continue
            s, tok, p = item.seq, next(sampled), item.seq.params
            assert s.last_token_id == tok
            n_out = s.num_completion_tokens
            if n_out >= p.min_tokens and ((tok == EOS and not p.ignore_eos) or tok in p.stop_token_ids):
                expected = "stop"
            elif (p.max_tokens is not None and n_out >= p.max_tokens) or s.num_tokens >= cfg.max_model_len:
                expected = "length"
            elif s.num_tokens > cfg.num_blocks * cfg.block_size:
                expected = "length"
            else:
                expected = None
            assert (s.finish_reason if s in finished else None) == expected
        self.in_step = False
        if self.sched.has_unfinished():
            assert result.plan.num_tokens > 0 or not self.sched.running and not self.sched.waiting

    @rule(data=st.data())
    def abort(self, data) -> None:
        if self.seqs:
            s = data.draw(st.sampled_from(self.seqs))
            was_unfinished = not s.is_finished
            assert self.sched.abort(s.seq_id) == was_unfinished
            assert s.is_finished

    @rule(data=st.data())
    def finish(self, data) -> None:
        live = [s for s in self.seqs if not s.is_finished]
        if live:
            s = data.draw(st.sampled_from(live))
            self.sched.finish(s.seq_id, "stop")
            assert s.finish_reason == "stop"

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "sched"):
            check_invariants(self.sched, self.world, self.seqs)

    def teardown(self) -> None:
        if not hasattr(self, "sched") or getattr(self, "in_step", False):
            return
        # Progress: with only decode tokens that never stop, everything still ends
        # within (max_model_len + 1) steps per request (the oldest running one always advances).
        live = [s for s in self.seqs if not s.is_finished]
        bound = (len(live) + 1) * (self.sched.config.max_model_len + 1)
        run_to_end(self.sched, self.world, self.seqs, max_steps=bound, token=4)
        assert all(s.finish_reason in ("stop", "length") for s in live)


SchedulerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSchedulerMachine = SchedulerMachine.TestCase


def test_prompt_logprob_positions_per_step_are_capped() -> None:
    cfg = SchedulerLimits(4, 64, 64, 4, 32, True, max_prompt_logit_rows=8)
    sched = Scheduler(cfg, [EOS])
    world = World(sched)
    wants = [seq(1, list(range(1, 21)), max_tokens=2, prompt_logprobs=1),
             seq(2, list(range(30, 49)), max_tokens=2, prompt_logprobs=1)]
    plain = seq(3, list(range(50, 80)), max_tokens=2)
    for s in [*wants, plain]:
        sched.add(s)
    computed = {s.seq_id: 0 for s in wants}
    for _ in range(40):
        if not sched.has_unfinished():
            break
        result, _ = step(sched, world)
        check_invariants(sched, world, [*wants, plain])
        rows = {s.seq.seq_id: s.num_new_tokens for s in result.scheduled if s.seq.seq_id in computed}
        prompt_rows = {i: n for i, n in rows.items() if computed[i] < 20 - (i == 2)}
        assert sum(prompt_rows.values()) <= 8, rows  # the cap, over every such sequence of the step
        assert set(prompt_rows) <= set(result.plan.prompt_logprob_seq_ids)
        for i, n in rows.items():
            computed[i] += n
    assert not sched.has_unfinished()
    assert all(s.finish_reason == "length" for s in [*wants, plain])
    assert (plain.status, plain.num_cached_tokens) == (SequenceStatus.FINISHED, 0)


def test_prompt_logit_rows_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="max_prompt_logit_rows"):
        SchedulerLimits(4, 64, 64, 4, 32, True, max_prompt_logit_rows=0)


def run_two_in_flight(sched: Scheduler, world: World, seqs: list[Sequence], max_steps: int) -> int:
    """Drive ``sched`` as the pipelined engine does: two steps outstanding, outputs back in the order sent,
    ``busy`` holding each sequence's tokens in flight. Checks at every step that a busy sequence is never
    preempted and is scheduled again only to go on with a prefill whose chunks in flight sample nothing
    (and the mirror, KV content included). Returns how many times a busy sequence was scheduled again."""
    in_flight: list[ScheduleResult] = []
    busy: dict[int, int] = {}
    steps = pipelined = 0
    while sched.has_unfinished():
        assert steps < max_steps, "no progress"
        steps += 1
        result = sched.schedule(busy=busy, max_seqs=2)
        assert len(result.seqs) <= 2
        for s in result.seqs:
            if s.seq_id in busy:
                pipelined += 1
                assert not any(r.needs_sample[r.seqs.index(s)] for r in in_flight if s in r.seqs), s
                assert s.num_computed_tokens + busy[s.seq_id] < s.num_tokens
        for s in seqs:
            if s.seq_id in busy:
                assert s.status is SequenceStatus.RUNNING, "a sequence in flight was preempted"
        if result.seqs:
            world.apply(result, busy)
            in_flight.append(result)
            for s, n in zip(result.seqs, result.num_new_tokens):
                busy[s.seq_id] = busy.get(s.seq_id, 0) + n
        if in_flight and (len(in_flight) == 2 or not result.seqs):
            done = in_flight.pop(0)
            for s, n in zip(done.seqs, done.num_new_tokens):
                if (left := busy.pop(s.seq_id) - n) > 0:
                    busy[s.seq_id] = left
            sched.postprocess(done, [7] * sum(done.needs_sample))
    return pipelined


def test_steps_in_flight_pipeline_only_prefill_chunks_that_sample_nothing() -> None:
    """Prompts of 3-23 tokens, 8 tokens per step: a long prompt's next chunk follows the one in flight."""
    sched, world = make(block_size=2, num_blocks=24, budget=8, max_model_len=64)
    seqs = [seq(i, list(range(1 + i, 4 + i + 10 * i)), max_tokens=10, ignore_eos=True) for i in range(3)]
    for s in seqs:
        sched.add(s)
    assert run_two_in_flight(sched, world, seqs, 300) > 0, "no prefill chunk followed another one in flight"
    assert all(s.num_completion_tokens == 10 for s in seqs)


def test_steps_in_flight_preempt_only_idle_sequences() -> None:
    """Short prompts (one chunk each) over a cache too small for every sequence: preemptions happen, never of
    a sequence in flight, and a decoding sequence in flight is never scheduled again."""
    sched, world = make(block_size=2, num_blocks=8, budget=32, max_model_len=32)
    seqs = [seq(i, [1 + i, 2, 3], max_tokens=10, ignore_eos=True) for i in range(3)]
    for s in seqs:
        sched.add(s)
    assert run_two_in_flight(sched, world, seqs, 200) == 0
    assert all(s.num_completion_tokens == 10 for s in seqs)
    assert sched.stats.num_preemptions > 0  # 8 blocks of 2 for 3 x 13 tokens: the cache ran out
