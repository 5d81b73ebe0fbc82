"""Continuous batching on rank 0: which tokens of which sequences each step computes.

Under a budget of ``max_num_batched_tokens`` query tokens, the running
sequences progress first (the newest are preempted when the KV blocks run
out), then waiting sequences are admitted first come, first served; what the
workers are sent of these decisions is built by :mod:`rtp.core.plan_builder`.

Policy of one step:

1. Running sequences, oldest admission first: each gets its next chunk (one
   token for a decode, the rest of the prompt for a prefill, cut to the
   budget). When the KV blocks run out, the most recently admitted running
   sequence is preempted (blocks freed, progress dropped, put back at the front
   of the waiting queue) until the chunk fits; a prefill chunk is first
   shortened to what fits.
2. If nothing was preempted, forks and then waiting sequences are admitted in
   FCFS order while the budget, ``max_num_seqs`` and the free blocks allow,
   each starting after its prefix-cache hit (which may be blocks that an
   earlier admission of the same step computes). The head of a queue is never
   skipped, so no request starves: the oldest running sequence always
   progresses, and everything it holds is freed when it finishes.

n > 1 (see :meth:`Scheduler.postprocess`): the prompt is prefilled once, by
the first sample. The step that samples its first token also samples the
other samples' first tokens from the same logits (the engine does it), and
each other sample becomes a *fork*: it shares the prompt's full KV blocks
(reference counts) and recomputes only the tokens of the last, partial prompt
block into a block of its own (fewer than ``block_size`` tokens, counted in
``num_fork_tail_tokens``, not as prefill; with ``recompute_last_hit``, a prompt
that ends on a block boundary: its last block). Forks wait in their own queue.
A waiting fork holds its shared blocks: when the KV blocks run out, the newest
waiting forks give theirs up before any running sequence is preempted, and
when nothing runs and the first fork cannot start, the newest forks give
theirs up until it can; each such fork becomes a preempted sequence (it
recomputes its prompt, or finds it in the prefix cache).

Prompt logprobs: a sequence that wants them skips the prefix cache (every
prompt position must be computed), at most ``max_prompt_logit_rows`` of its
positions run per step, and the plan lists it in ``prompt_logprob_seq_ids``.

A sequence whose known tokens exceed the KV capacity (``num_blocks * block_size``)
finishes with "length", like one that reaches ``max_model_len``: such a
sequence could never run again, even alone.
"""

from __future__ import annotations

from collections import deque

from rtp.core.block_manager import BlockManager
from rtp.core.plan_builder import PlanBuilder
from rtp.core.schedule_types import (
    ScheduledSeq,
    SchedulerCounters,
    ScheduleResult,
    SchedulerLimits,
    SchedulerStats,
)
from rtp.core.sequence import Sequence, SequenceStatus
from rtp.core.verified_step import apply_verified_step
from rtp.errors import RequestError
from rtp.log import get_logger

logger = get_logger(__name__)

_RUNNING = SequenceStatus.RUNNING

__all__ = ["ScheduleResult", "ScheduledSeq", "Scheduler", "SchedulerLimits", "SchedulerCounters", "SchedulerStats"]


class Scheduler:
    """Decides, step after step, which tokens of which sequences the ranks compute."""

    def __init__(self, config: SchedulerLimits, eos_token_ids: list[int]) -> None:
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching,
                                          config.recompute_last_hit)
        self.capacity = config.num_blocks * config.block_size  # KV slots in the whole cache
        if self.capacity < config.max_model_len:
            logger.warning(
                "KV cache holds %d tokens, fewer than max_model_len=%d: longer sequences end with 'length'",
                self.capacity,
                config.max_model_len,
            )
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: oldest first
        self._forked: deque[Sequence] = deque()  # forks holding shared blocks, not yet running
        self._seqs: dict[int, Sequence] = {}  # every unfinished sequence by id
        self.plans = PlanBuilder()  # what the workers mirror
        self.counters = SchedulerCounters()
        self._awaiting_postprocess = 0  # steps scheduled and not postprocessed yet (several: pipeline stages)

    # ------------------------------------------------------------------ requests

    def validate(self, seq: Sequence) -> None:
        """Raise RequestError if ``seq`` could never be served; changes nothing (safe from any thread)."""
        cfg = self.config
        n = seq.num_prompt_tokens
        if n == 0 or seq.num_tokens != n:
            raise RequestError("the prompt is empty: at least one prompt token is required")
        if n >= cfg.max_model_len:
            raise RequestError(
                f"the prompt has {n} tokens but max_model_len is {cfg.max_model_len}: "
                f"at most {cfg.max_model_len - 1} prompt tokens are allowed"
            )
        need = self.block_manager.num_blocks_for(n)
        if need > cfg.num_blocks:
            raise RequestError(
                f"the prompt has {n} tokens and needs {need} KV blocks of {cfg.block_size} tokens, "
                f"but the cache has only {cfg.num_blocks} blocks ({self.capacity} tokens)"
            )

    def add(self, seq: Sequence) -> None:
        """Queue a new request; raise RequestError if it could never be served."""
        if seq.seq_id in self._seqs:
            raise RequestError(f"request id {seq.seq_id} is already in use by an unfinished request")
        self.validate(seq)
        seq.status = SequenceStatus.WAITING
        self._seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def abort(self, seq_id: int) -> bool:
        """Drop a waiting or running request; False if it is unknown or already finished."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return False
        self._finish(seq, "abort")
        return True

    def finish(self, seq_id: int, reason: str) -> None:
        """End a request early (the engine saw a stop string); a no-op if it already finished."""
        if reason not in ("stop", "length", "abort"):
            raise ValueError(f"finish reason {reason!r} is invalid: expected 'stop', 'length' or 'abort'")
        seq = self._seqs.get(seq_id)
        if seq is not None:
            self._finish(seq, reason)

    def get(self, seq_id: int) -> Sequence | None:
        """The unfinished sequence with this id, or None."""
        return self._seqs.get(seq_id)

    def has_unfinished(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self._seqs)

    # ------------------------------------------------------------------ steps

    def schedule(self, drafts: dict[int, list[int]] | None = None, busy: dict[int, int] | None = None,
                 max_seqs: int | None = None) -> ScheduleResult:
        """Plan the next step. The plan is empty (no tokens) when nothing can run.

        ``drafts`` (speculative decoding) maps ids of decoding running sequences to draft tokens to
        verify in this step; they count against the token budget and get KV slots, and may be cut to
        what fits. A result with drafts must be passed to ``postprocess_speculative``, any other
        non-empty result to ``postprocess``, before the next call. Ids to free are only carried by
        non-empty plans, so an engine may skip executing empty ones.

        ``busy`` (pipeline stages, several steps in flight): the running sequences of the steps not
        postprocessed yet, id -> tokens those steps compute of it. They are never preempted, and only
        scheduled again to go on with a prefill whose chunks in flight sample nothing (so one long
        prompt pipelines across the stages, chunk after chunk); results are postprocessed in the order
        they were scheduled. ``max_seqs`` caps the sequences of this step (a share of the requests per
        step in flight).
        """
        if self._awaiting_postprocess and busy is None:
            raise RuntimeError("schedule() called again before postprocess() of the previous step")
        cfg = self.config
        seats = cfg.max_num_seqs if max_seqs is None else max_seqs
        running, budget, logit_rows, preempted = self._schedule_running(drafts, busy, seats)
        admitted = ScheduleResult()
        if not preempted:  # after a preemption the cache is short: admitting now would only thrash
            seats -= len(running.seqs)
            budget, logit_rows = self._admit(self._forked, admitted, budget, logit_rows, seats)
            self._admit(self.waiting, admitted, budget, logit_rows, seats)
        plan = self.plans.build(admitted.seqs, admitted.num_new_tokens, running.seqs, running.num_new_tokens)
        result = ScheduleResult(
            plan,
            admitted.seqs + running.seqs,
            admitted.num_new_tokens + running.num_new_tokens,
            admitted.needs_sample + running.needs_sample,
        )
        if running.drafts is not None:
            self.plans.add_drafts(plan, running.drafts)
            result.drafts = [[] for _ in admitted.seqs] + running.drafts
        self._awaiting_postprocess += bool(result.seqs)
        assert plan.num_tokens <= cfg.max_num_batched_tokens
        assert len(self.running) <= cfg.max_num_seqs
        return result

    def postprocess(
        self, result: ScheduleResult, sampled_token_ids: list[int],
        forks: dict[int, list[tuple[Sequence, int]]] | None = None,
    ) -> list[Sequence]:
        """Apply a computed step: advance KV progress, cache full blocks, append tokens, finish.

        ``sampled_token_ids`` holds one token per scheduled sequence with
        ``needs_sample``, in batch order. ``forks`` maps the id of a sequence
        whose prompt was just computed to new sequences (holding nothing, same
        prompt) and their first sampled token: each becomes a fork of it (see
        the module docstring). Returns the sequences that finished (forks included).
        """
        expected = sum(result.needs_sample)
        if len(sampled_token_ids) != expected:
            raise ValueError(f"postprocess got {len(sampled_token_ids)} sampled tokens, expected {expected}")
        self._awaiting_postprocess = max(0, self._awaiting_postprocess - 1)
        bm = self.block_manager
        bs, caching = bm.block_size, bm.enable_prefix_caching
        tokens = iter(sampled_token_ids)
        counters = self.counters
        num_decodes = 0  # counted here, added once (this loop runs for every sequence on every step)
        eos, max_len = self.eos_token_ids, min(self.config.max_model_len, self.capacity + 1)
        finished: list[Sequence] = []
        for seq, n, needs_sample in zip(result.seqs, result.num_new_tokens, result.needs_sample):
            token = next(tokens) if needs_sample else None
            if seq.status is not _RUNNING:
                continue  # aborted or finished by the engine after schedule(): drop its result
            computed = seq.num_computed_tokens
            if n == 1 and computed >= seq.num_prompt_tokens:
                num_decodes += 1
            elif seq.is_fork and computed < seq.num_prompt_tokens:
                counters.num_fork_tail_tokens += n
            else:
                counters.num_prefill_tokens_computed += n
                if computed < seq.num_prompt_tokens <= computed + n:
                    counters.num_prefills += 1
            seq.num_computed_tokens = computed = computed + n
            if seq.needs_prompt_logits and computed >= seq.num_prompt_tokens - 1:
                seq.needs_prompt_logits = False  # the engine consumed this step's prompt logits
            if caching and computed // bs > seq.num_hashed_blocks:  # a block filled up
                bm.cache_computed_blocks(seq)  # (no-op where the step registered them when scheduled)
            if token is None:
                continue
            if forks and seq.seq_id in forks:
                for child, child_token in forks.pop(seq.seq_id):
                    if self._fork(seq, child, child_token):
                        finished.append(child)
            known = seq.token_ids
            known.append(token)
            # Most tokens end nothing: _stop_reason decides only where one of its conditions may hold.
            if token in eos or token in seq.stop_token_set or len(known) >= max_len or len(known) >= seq.max_num_tokens:
                reason = self._stop_reason(seq, token)
                if reason is not None:
                    self._finish(seq, reason)
                    finished.append(seq)
        counters.num_decode_tokens += num_decodes
        return finished

    def postprocess_speculative(
        self, result: ScheduleResult, runs: list[list[int]],
        forks: dict[int, list[tuple[Sequence, int]]] | None = None,
    ) -> list[Sequence]:
        """Apply a computed step with drafts (see :func:`rtp.core.verified_step.apply_verified_step`)."""
        return apply_verified_step(self, result, runs, forks)

    @property
    def num_waiting(self) -> int:
        """Sequences waiting to be admitted (forks included)."""
        return len(self.waiting) + len(self._forked)

    @property
    def stats(self) -> SchedulerStats:
        """Current gauges and cumulative counters."""
        bm = self.block_manager
        free = bm.num_free_blocks
        return SchedulerStats(
            num_waiting=self.num_waiting,
            num_running=len(self.running),
            num_blocks=bm.num_blocks,
            num_free_blocks=free,
            kv_usage=(bm.num_blocks - free) / bm.num_blocks,
            **vars(self.counters),
        )

    # ------------------------------------------------------------------ internals

    def _schedule_running(self, drafts: dict[int, list[int]] | None = None, busy: dict[int, int] | None = None,
                          seats: int | None = None) -> tuple[ScheduleResult, int, int, bool]:
        """Step 1 of the policy: the running sequences' chunks (a decode with drafts: 1 + its drafts).

        Returns their shares, the token budget and prompt-logit rows left, and whether anything was preempted.
        """
        cfg, bm = self.config, self.block_manager
        budget = cfg.max_num_batched_tokens
        logit_rows = cfg.max_prompt_logit_rows  # prompt positions left this step for prompt logprobs
        bs, caching = cfg.block_size, bm.enable_prefix_caching
        seats = cfg.max_num_seqs if seats is None else seats
        running = ScheduleResult()
        # The columns of ScheduleResult.add, filled in place: this loop runs for every running sequence
        # on every step.
        seqs, counts, sampled = running.seqs, running.num_new_tokens, running.needs_sample
        if drafts:
            running.drafts = []
        preempted = False
        for seq in list(self.running):
            if budget == 0 or len(seqs) >= seats:
                break
            if seq.status is not _RUNNING:
                continue  # preempted earlier in this loop
            ahead = busy.get(seq.seq_id, 0) if busy else 0  # tokens of it in steps still in flight
            computed = seq.num_computed_tokens + ahead
            known = len(seq.token_ids)
            wants_logits = seq.needs_prompt_logits
            if ahead and (computed >= known or wants_logits):
                continue  # its step in flight samples it (or returns prompt logits): wait for it
            n = known - computed
            assert n >= 1, f"running {seq} has nothing to compute"
            if wants_logits:
                n = min(n, logit_rows)
                if n == 0:
                    continue  # its next chunk waits for the next step
            draft = drafts.get(seq.seq_id) if drafts else None
            if draft:
                assert n == 1, f"drafts for {seq}, which is not decoding"
                n += len(draft)
            if n > budget:
                n = budget
            if computed + n > len(seq.block_table) * bs:  # the chunk spills past the last block
                if ahead:
                    # Its earlier chunks are in flight: free blocks only, no preemption for a head start.
                    n = min(n, bm.appendable_tokens(seq) - ahead)
                    if n < 1:
                        continue
                else:
                    # (a decode: once every block_size steps) find room.
                    while (fit := bm.appendable_tokens(seq)) < 1:
                        if self._forked:  # a waiting fork has done nothing of its own yet
                            self._preempt(self._forked[-1])
                            preempted = True
                            continue
                        victim = self.running[-1] if not busy else next(s for s in reversed(self.running)
                                                                        if s.seq_id not in busy)
                        # Alone, a sequence always fits: it would have finished with "length" otherwise.
                        assert victim is not seq or len(self.running) > 1, f"{seq} cannot fit alone"
                        self._preempt(victim)  # always a sequence after this one: none of running's shares
                        preempted = True
                        if victim is seq:
                            break
                    if seq.status is not _RUNNING:
                        break  # it preempted itself: every newer sequence is gone too
                    n = min(n, fit)
                bm.append(seq, computed + n)
            if caching and not draft and (computed + n) // bs > seq.num_hashed_blocks:
                # As an admission's: the blocks this chunk fills are findable at once, so that a later admission
                # of this step may share them (a long prompt's later chunks, a system prompt another request has
                # started). Draft positions are registered once verified.
                bm.cache_computed_blocks(seq, computed + n)
            budget -= n
            if wants_logits:
                logit_rows -= n
            seqs.append(seq)
            counts.append(n)
            sampled.append(computed + n >= known)  # >=: a chunk with drafts reaches past the known tokens
            if running.drafts is not None:
                running.drafts.append(draft[: n - 1] if draft else [])
        return running, budget, logit_rows, preempted

    def _admit(
        self, queue: deque[Sequence], admitted: ScheduleResult, budget: int, logit_rows: int, seats: int | None = None
    ) -> tuple[int, int]:
        """Step 2 of the policy for one queue (forks or waiting); returns the budget and logit rows left.

        A fork holds the prompt's full blocks already and resumes after them; any other sequence
        starts after its prefix-cache hit.
        """
        cfg, bm = self.config, self.block_manager
        while (queue and len(self.running) < cfg.max_num_seqs and budget > 0
               and (seats is None or len(admitted.seqs) < seats)):
            seq = queue[0]
            if seq.is_fork:
                cached, start = None, seq.num_computed_tokens
            else:
                # Prompt logprobs need the logits of every prompt position: no prefix-cache hit.
                cached = [] if seq.needs_prompt_logits else bm.find_cached_prefix(seq)
                start = len(cached) * cfg.block_size
            n = min(seq.num_tokens - start, budget)
            if seq.needs_prompt_logits:
                n = min(n, logit_rows)
                if n == 0:
                    break  # FCFS: it goes first next step
            if not (bm.can_append(seq, start + n) if cached is None else bm.can_allocate(cached, start + n)):
                if queue is self._forked and not self.running:
                    # Nothing runs to free blocks: the waiting forks hold them (their requests' other samples
                    # ended). The newest gives its blocks up (the head last, then admitted as any sequence).
                    self._preempt(queue[-1])
                    continue
                break  # FCFS: never skip the head of the queue
            queue.popleft()
            if cached is None:
                bm.append(seq, start + n)
            else:
                bm.allocate(seq, cached, start + n)
                seq.num_computed_tokens = seq.num_cached_tokens = start
                if cfg.enable_prefix_caching:
                    self.counters.prefix_query_tokens += seq.num_tokens
                    self.counters.prefix_hit_tokens += start
            # The blocks this step fills are findable at once: a later admission of this step may share them.
            bm.cache_computed_blocks(seq, start + n)
            if seq.needs_prompt_logits:
                logit_rows -= n
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            budget -= n
            admitted.add(seq, n)
        return budget, logit_rows

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        """Why ``seq`` ends after ``token`` was appended, or None."""
        p = seq.params
        num_tokens = len(seq.token_ids)
        num_completion = num_tokens - seq.num_prompt_tokens
        # Like vLLM's stop check: eos/stop tokens count only once min_tokens tokens exist.
        if num_completion >= p.min_tokens:
            if (token in self.eos_token_ids and not p.ignore_eos) or token in seq.stop_token_set:
                return "stop"
        if num_tokens >= seq.max_num_tokens:  # max_tokens generated
            return "length"
        if num_tokens >= self.config.max_model_len:
            return "length"
        if num_tokens > self.capacity:  # the next step would need more KV slots than exist
            return "length"
        return None

    def _fork(self, parent: Sequence, child: Sequence, token: int) -> bool:
        """Make ``child`` a fork of ``parent``, whose prompt was just computed; True if it finished at once."""
        assert not child.block_table and child.token_ids == parent.token_ids[: parent.num_prompt_tokens]
        assert parent.num_computed_tokens >= parent.num_prompt_tokens, f"{parent} has not computed its prompt"
        if child.seq_id in self._seqs:
            raise RequestError(f"request id {child.seq_id} is already in use by an unfinished request")
        full = parent.num_prompt_tokens // self.config.block_size
        if self.config.recompute_last_hit and full * self.config.block_size == parent.num_prompt_tokens:
            full -= 1  # as for a hit: the token after the last whole block is the sample's own (EAGLE-3 reads it)
        self.block_manager.share(parent, child, full)
        child.num_computed_tokens = full * self.config.block_size
        child.is_fork = True
        child.status = SequenceStatus.WAITING
        self._seqs[child.seq_id] = child
        self._forked.append(child)
        child.append_token(token)
        reason = self._stop_reason(child, token)
        if reason is not None:
            self._finish(child, reason)
            return True
        return False

    def _release(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and tell the workers to drop their mirror of it."""
        self.block_manager.free(seq)
        self.plans.release(seq.seq_id)

    def _preempt(self, seq: Sequence) -> None:
        """Preempt by recompute: drop the KV and requeue ``seq`` at the front (a running sequence, or a fork not
        yet running, whose shared blocks the workers have not seen)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._release(seq)
        else:
            self._forked.remove(seq)
            self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.is_fork = False  # from now on it recomputes everything, like any preempted sequence
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.counters.num_preemptions += 1
        logger.debug("preempted %s (%d running, %d waiting)", seq, len(self.running), len(self.waiting))

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._release(seq)
        elif seq.status is SequenceStatus.WAITING:
            if seq.is_fork and seq in self._forked:  # a fork not yet running holds shared blocks
                self._forked.remove(seq)
                self.block_manager.free(seq)
            else:
                self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._seqs[seq.seq_id]
