"""Continuous batching on rank 0: admission, chunked prefill, preemption -> StepPlan.

Policy of one step, under a budget of ``max_num_batched_tokens`` query tokens:

1. Running sequences, oldest admission first: each gets its next chunk (one
   token for a decode, the rest of the prompt for a prefill, cut to the
   budget). When the KV blocks run out, the most recently admitted running
   sequence is preempted (blocks freed, progress dropped, put back at the front
   of the waiting queue) until the chunk fits; a prefill chunk is first
   shortened to what fits.
2. If nothing was preempted, waiting sequences are admitted in FCFS order while
   the budget, ``max_num_seqs`` and the free blocks allow, each starting after
   its prefix-cache hit. The head of the queue is never skipped, so no request
   starves: the oldest running sequence always progresses, and everything it
   holds is freed when it finishes.

n > 1 (see :meth:`Scheduler.postprocess`): the prompt is prefilled once, by
the first sample. The step that samples its first token also samples the
other samples' first tokens from the same logits (the engine does it), and
each other sample becomes a *fork*: it shares the prompt's full KV blocks
(reference counts) and recomputes only the tokens of the last, partial prompt
block into a block of its own (fewer than ``block_size`` tokens, counted in
``num_fork_tail_tokens``, not as prefill). Forks wait in their own queue,
admitted before the waiting queue.

Prompt logprobs: a sequence that wants them skips the prefix cache (every
prompt position must be computed) and its chunks are listed in
``plan.prompt_logprob_seq_ids``, so that the runner returns their logits.

A sequence whose known tokens exceed the KV capacity (``num_blocks * block_size``)
finishes with "length", like one that reaches ``max_model_len``: such a
sequence could never run again, even alone.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from rtp.core.block_manager import BlockManager
from rtp.core.sequence import Sequence, SequenceStatus
from rtp.core.step import NewSeq, StepPlan
from rtp.errors import ConfigError, RequestError
from rtp.log import get_logger

logger = get_logger(__name__)


@dataclass
class SchedulerConfig:
    """Limits of the scheduler and the shape of the KV cache."""

    max_num_seqs: int
    """Most sequences running (holding KV blocks) at once."""
    max_num_batched_tokens: int
    """Most query tokens in one step (prefill chunks plus decodes)."""
    max_model_len: int
    """Longest sequence (prompt + completion) the model serves."""
    block_size: int
    """Token slots per KV block."""
    num_blocks: int
    """KV blocks in the cache (the minimum over all ranks)."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of prompt prefixes seen before."""
    max_prompt_logit_rows: int = 512
    """Most prompt positions per step of the sequences that want prompt logprobs (each is a float32
    row of the whole vocabulary on rank 0: 512 rows of Qwen3's 151,936 ids are 311 MB)."""

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "num_blocks",
                     "max_prompt_logit_rows"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"SchedulerConfig.{name}={value!r} is invalid: expected a positive integer")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ConfigError(
                f"SchedulerConfig.enable_prefix_caching={self.enable_prefix_caching!r} is invalid: "
                "expected true or false"
            )


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of a step."""

    seq: Sequence
    num_new_tokens: int  # query length: positions [num_computed_tokens, num_computed_tokens + num_new_tokens)
    needs_sample: bool  # the chunk reaches the last known token, so a token is sampled for it


@dataclass
class ScheduleResult:
    """A step's plan plus the scheduler's side of it.

    Columns in batch order (``plan.new_seqs``, then ``plan.cached_seqs``), one
    entry per scheduled sequence; ``scheduled`` gives the same as records.
    """

    plan: StepPlan
    seqs: list[Sequence] = field(default_factory=list)  # [B]
    num_new_tokens: list[int] = field(default_factory=list)  # [B] query length, as in ScheduledSeq
    needs_sample: list[bool] = field(default_factory=list)  # [B] a token is sampled for the sequence

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        """Append one sequence's share of the step (before its KV progress moves)."""
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)
        self.needs_sample.append(seq.num_computed_tokens + num_new_tokens == len(seq.token_ids))

    @property
    def scheduled(self) -> list[ScheduledSeq]:
        """The same as one record per sequence (built on every call)."""
        return list(map(ScheduledSeq, self.seqs, self.num_new_tokens, self.needs_sample))


@dataclass
class SchedulerStats:
    """A snapshot of the scheduler's gauges and cumulative counters."""

    num_waiting: int
    num_running: int
    num_blocks: int
    num_free_blocks: int
    kv_usage: float  # blocks held by running sequences / num_blocks
    prefix_query_tokens: int  # tokens looked up in the prefix cache at admissions
    prefix_hit_tokens: int  # of which served from the cache
    num_preemptions: int
    num_prefill_tokens_computed: int  # query tokens that were not single-token decodes
    num_decode_tokens: int  # single-token decode steps
    num_prefills: int  # sequences whose prompt (re)computation completed (forks not counted)
    num_fork_tail_tokens: int  # tokens forks (n > 1) computed before their first decode


class Scheduler:
    """Decides, step after step, which tokens of which sequences the ranks compute."""

    def __init__(self, config: SchedulerConfig, eos_token_ids: list[int]) -> None:
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.capacity = config.num_blocks * config.block_size  # KV slots in the whole cache
        if self.capacity < config.max_model_len:
            logger.warning(
                "KV cache holds %d tokens, fewer than max_model_len=%d: longer sequences end with 'length'",
                self.capacity,
                config.max_model_len,
            )
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: oldest first
        self._seqs: dict[int, Sequence] = {}  # every unfinished sequence by id
        # What the workers mirror: seq_id -> (tokens sent, blocks sent).
        self._sent: dict[int, tuple[int, int]] = {}
        self._pending_freed: list[int] = []  # mirrored ids to free in the next non-empty plan
        self._awaiting_postprocess = False
        self._num_preemptions = 0
        self._prefix_query_tokens = 0
        self._prefix_hit_tokens = 0
        self._num_prefill_tokens = 0
        self._num_decode_tokens = 0
        self._num_prefills = 0
        self._num_fork_tail_tokens = 0
        self._forked: deque[Sequence] = deque()  # forks holding shared blocks, not yet running

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
        max_tokens = seq.params.max_tokens
        if n + (max_tokens or 1) > cfg.max_model_len:
            raise RequestError(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + (max_tokens or 1)} exceeds "
                f"max_model_len={cfg.max_model_len}; lower max_tokens or shorten the prompt"
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

    def schedule(self) -> ScheduleResult:
        """Plan the next step. The plan is empty (no tokens) when nothing can run.

        Every non-empty result must be passed to ``postprocess`` before the next
        call. Ids to free are only carried by non-empty plans, so an engine may
        skip executing empty ones.
        """
        if self._awaiting_postprocess:
            raise RuntimeError("schedule() called again before postprocess() of the previous step")
        cfg, bm = self.config, self.block_manager
        budget = cfg.max_num_batched_tokens
        plan = StepPlan()
        running = ScheduleResult(plan)  # shares of the running sequences (they follow the admitted ones)
        preempted = False

        bs, sent, deltas = cfg.block_size, self._sent, plan.cached_seqs
        logit_rows = cfg.max_prompt_logit_rows  # prompt positions left this step for prompt logprobs
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            computed = seq.num_computed_tokens
            n = len(seq.token_ids) - computed
            assert n >= 1, f"running {seq} has nothing to compute"
            if not seq.prompt_logprobs_done:
                n = min(n, logit_rows)
                if n == 0:
                    continue  # its next chunk waits for the next step
            if n > budget:
                n = budget
            if computed + n > len(seq.block_table) * bs:
                # The chunk spills past the last block (a decode: once every block_size steps): find room.
                while (fit := bm.appendable_tokens(seq)) < 1:
                    victim = self.running[-1]
                    # Alone, a sequence always fits: it would have finished with "length" otherwise.
                    assert victim is not seq or len(self.running) > 1, f"{seq} cannot fit alone"
                    self._preempt(victim)
                    preempted = True
                    if victim is seq:
                        break
                if seq.status is not SequenceStatus.RUNNING:
                    break  # it preempted itself: every newer sequence is gone too
                n = min(n, fit)
                bm.append(seq, computed + n)
            budget -= n
            if not seq.prompt_logprobs_done:
                logit_rows -= n
            running.add(seq, n)
            num_sent_tokens, num_sent_blocks = sent[seq.seq_id]
            deltas.add(seq.seq_id, n, seq.token_ids[num_sent_tokens:], seq.block_table[num_sent_blocks:])
            sent[seq.seq_id] = (len(seq.token_ids), len(seq.block_table))

        admitted = ScheduleResult(plan)
        while not preempted and self._forked and len(self.running) < cfg.max_num_seqs and budget > 0:
            seq = self._forked[0]
            computed = seq.num_computed_tokens
            n = min(seq.num_tokens - computed, budget)
            if bm.num_blocks_for(computed + n) - len(seq.block_table) > bm.num_free_blocks:
                break
            self._forked.popleft()
            bm.append(seq, computed + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            budget -= n
            admitted.add(seq, n)
            plan.new_seqs.append(NewSeq(seq.seq_id, list(seq.token_ids), list(seq.block_table), computed, n))
            self._sent[seq.seq_id] = (seq.num_tokens, len(seq.block_table))
        # After a preemption the cache is short: admitting now would only thrash.
        while not preempted and self.waiting and len(self.running) < cfg.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            # Prompt logprobs need the logits of every prompt position: no prefix-cache hit.
            cached = bm.find_cached_prefix(seq) if seq.prompt_logprobs_done else []
            num_cached = len(cached) * cfg.block_size
            n = min(seq.num_tokens - num_cached, budget)
            if not seq.prompt_logprobs_done:
                n = min(n, logit_rows)
                if n == 0:
                    break  # FCFS: it goes first next step
                logit_rows -= n
            if not bm.can_allocate(cached, num_cached + n):
                break  # FCFS: never skip the head of the queue
            self.waiting.popleft()
            bm.allocate(seq, cached, num_cached + n)
            seq.num_computed_tokens = seq.num_cached_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if cfg.enable_prefix_caching:
                self._prefix_query_tokens += seq.num_tokens
                self._prefix_hit_tokens += num_cached
            budget -= n
            admitted.add(seq, n)
            plan.new_seqs.append(
                NewSeq(
                    seq_id=seq.seq_id,
                    token_ids=list(seq.token_ids),
                    block_table=list(seq.block_table),
                    num_computed_tokens=num_cached,
                    num_new_tokens=n,
                )
            )
            self._sent[seq.seq_id] = (seq.num_tokens, len(seq.block_table))

        for seq in admitted.seqs + running.seqs:
            if not seq.prompt_logprobs_done:
                plan.prompt_logprob_seq_ids.append(seq.seq_id)
        result = ScheduleResult(
            plan,
            admitted.seqs + running.seqs,
            admitted.num_new_tokens + running.num_new_tokens,
            admitted.needs_sample + running.needs_sample,
        )
        if result.seqs:
            plan.freed_seq_ids = self._pending_freed
            self._pending_freed = []
            self._awaiting_postprocess = True
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
        self._awaiting_postprocess = False
        bm = self.block_manager
        bs, caching = bm.block_size, bm.enable_prefix_caching
        tokens = iter(sampled_token_ids)
        finished: list[Sequence] = []
        for seq, n, needs_sample in zip(result.seqs, result.num_new_tokens, result.needs_sample):
            token = next(tokens) if needs_sample else None
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted or finished by the engine after schedule(): drop its result
            if n == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens:
                self._num_decode_tokens += 1
            elif seq.is_fork and seq.num_computed_tokens < seq.num_prompt_tokens:
                self._num_fork_tail_tokens += n
            else:
                self._num_prefill_tokens += n
                if seq.num_computed_tokens < seq.num_prompt_tokens <= seq.num_computed_tokens + n:
                    self._num_prefills += 1
            seq.num_computed_tokens += n
            if not seq.prompt_logprobs_done and seq.num_computed_tokens >= seq.num_prompt_tokens - 1:
                seq.prompt_logprobs_done = True  # the engine consumed this step's prompt logits
            assert seq.num_computed_tokens <= len(seq.block_table) * bs
            if caching and seq.num_computed_tokens // bs > seq.num_hashed_blocks:  # a block filled up
                bm.cache_computed_blocks(seq)  # only now is the KV of these blocks real
            if token is None:
                continue
            if forks and seq.seq_id in forks:
                for child, child_token in forks.pop(seq.seq_id):
                    if self._fork(seq, child, child_token):
                        finished.append(child)
            seq.append_token(token)
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self._finish(seq, reason)
                finished.append(seq)
        return finished

    @property
    def stats(self) -> SchedulerStats:
        """Current gauges and cumulative counters."""
        bm = self.block_manager
        free = bm.num_free_blocks
        return SchedulerStats(
            num_waiting=len(self.waiting) + len(self._forked),
            num_running=len(self.running),
            num_blocks=bm.num_blocks,
            num_free_blocks=free,
            kv_usage=(bm.num_blocks - free) / bm.num_blocks,
            prefix_query_tokens=self._prefix_query_tokens,
            prefix_hit_tokens=self._prefix_hit_tokens,
            num_preemptions=self._num_preemptions,
            num_prefill_tokens_computed=self._num_prefill_tokens,
            num_decode_tokens=self._num_decode_tokens,
            num_prefills=self._num_prefills,
            num_fork_tail_tokens=self._num_fork_tail_tokens,
        )

    # ------------------------------------------------------------------ internals

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        """Why ``seq`` ends after ``token`` was appended, or None."""
        p = seq.params
        num_tokens = len(seq.token_ids)
        num_completion = num_tokens - seq.num_prompt_tokens
        # Like vLLM's stop check: eos/stop tokens count only once min_tokens tokens exist.
        if num_completion >= p.min_tokens:
            if (token in self.eos_token_ids and not p.ignore_eos) or token in (p.stop_token_ids or ()):
                return "stop"
        if p.max_tokens is not None and num_completion >= p.max_tokens:
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
        if self._sent.pop(seq.seq_id, None) is not None:
            self._pending_freed.append(seq.seq_id)

    def _preempt(self, seq: Sequence) -> None:
        """Preempt by recompute: drop the KV and requeue ``seq`` at the front."""
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.is_fork = False  # from now on it recomputes everything, like any preempted sequence
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self._num_preemptions += 1
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
