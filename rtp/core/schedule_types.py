"""What the scheduler is given and hands out: its limits, a step's shares of the sequences, counters.

:class:`ScheduleResult` carries one step's plan for the workers and, in the
same batch order, what rank 0 needs to apply the computed step (which
sequences, how many tokens each, which of them are sampled).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rtp.core.sequence import Sequence
from rtp.core.step import StepPlan
from rtp.errors import ConfigError


@dataclass
class SchedulerLimits:
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
    recompute_last_hit: bool = False
    """The last block of a prefix-cache hit, and of the prompt blocks an n > 1 sample shares where the prompt ends
    on a block boundary, is computed again in a block of the sequence's own (EAGLE-3: the head's KV at a block's
    last position reads the token after the block, see rtp.spec.eagle3)."""

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "num_blocks",
                     "max_prompt_logit_rows"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"SchedulerLimits.{name}={value!r} is invalid: expected a positive integer")
        for name in ("enable_prefix_caching", "recompute_last_hit"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"SchedulerLimits.{name}={getattr(self, name)!r} is invalid: expected true or false")


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

    plan: StepPlan = field(default_factory=StepPlan)
    seqs: list[Sequence] = field(default_factory=list)  # [B]
    num_new_tokens: list[int] = field(default_factory=list)  # [B] query length, as in ScheduledSeq
    needs_sample: list[bool] = field(default_factory=list)  # [B] a token is sampled for the sequence
    drafts: list[list[int]] | None = None  # [B] draft tokens each sequence verifies ([] for none); None: no drafts

    def add(self, seq: Sequence, num_new_tokens: int, ahead: int = 0) -> None:
        """Append one sequence's share of the step (before its KV progress moves), which starts ``ahead``
        tokens after its computed ones (the chunks of it in steps still in flight)."""
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)
        # >=: a chunk with drafts reaches past the known tokens
        self.needs_sample.append(seq.num_computed_tokens + ahead + num_new_tokens >= len(seq.token_ids))

    @property
    def scheduled(self) -> list[ScheduledSeq]:
        """The same as one record per sequence (built on every call)."""
        return list(map(ScheduledSeq, self.seqs, self.num_new_tokens, self.needs_sample))


@dataclass
class SchedulerCounters:
    """Cumulative counters of a scheduler."""

    prefix_query_tokens: int = 0  # tokens looked up in the prefix cache at admissions
    prefix_hit_tokens: int = 0  # of which served from the cache
    num_preemptions: int = 0
    num_prefill_tokens_computed: int = 0  # query tokens that were not single-token decodes
    num_decode_tokens: int = 0  # single-token decode steps
    num_prefills: int = 0  # sequences whose prompt (re)computation completed (forks not counted)
    num_fork_tail_tokens: int = 0  # tokens forks (n > 1) computed before their first decode


@dataclass(kw_only=True)
class SchedulerStats(SchedulerCounters):
    """A snapshot of the scheduler's gauges and cumulative counters."""

    num_waiting: int
    num_running: int
    num_blocks: int
    num_free_blocks: int
    kv_usage: float  # blocks held by running sequences / num_blocks
