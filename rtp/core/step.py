"""StepPlan: what rank 0 tells every rank to compute in one step.

Batch order of one step is ``new_seqs`` followed by ``cached_seqs``; each
contributes ``num_new_tokens`` consecutive query tokens to the flattened batch.

Workers keep a mirror of every running sequence (token ids, block table,
number of computed tokens), so a sequence is sent in full only when it is
(re)scheduled for the first time, and as a small delta afterwards.

Mirror invariant used by the delta encoding: after a step in which a sequence's
chunk reached the end of its known tokens, rank 0 sampled exactly one token for
it; unless the sequence was freed, the next delta carries that token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum


class StepKind(IntEnum):
    """What a message asks the ranks to do."""

    STEP = 0  # run the forward pass of the plan
    SHUTDOWN = 1  # leave the worker loop and exit cleanly
    HEALTH = 2  # no-op round trip (liveness probe)
    PROFILE = 3  # reserved: toggle the profiler


@dataclass
class NewSeq:
    """A sequence scheduled for the first time (or again after preemption)."""

    seq_id: int
    token_ids: list[int]  # every known token: prompt + tokens generated so far
    block_table: list[int]  # KV block ids, in order
    num_computed_tokens: int  # tokens whose KV is already in the cache (prefix-cache hit)
    num_new_tokens: int  # query length of this step (a prefill chunk)


@dataclass
class CachedSeq:
    """A sequence the workers already mirror: only what changed."""

    seq_id: int
    num_new_tokens: int  # query length of this step (1 for decode)
    new_token_ids: list[int]  # tokens appended since the last step (the sampled one)
    new_block_ids: list[int]  # blocks appended to the block table since the last step


@dataclass
class StepPlan:
    """One step's metadata, identical on every rank."""

    kind: StepKind = StepKind.STEP
    new_seqs: list[NewSeq] = field(default_factory=list)
    cached_seqs: list[CachedSeq] = field(default_factory=list)
    freed_seq_ids: list[int] = field(default_factory=list)  # finished, aborted or preempted

    @property
    def num_tokens(self) -> int:
        """Total number of query tokens in this step."""
        return sum(s.num_new_tokens for s in self.new_seqs) + sum(
            s.num_new_tokens for s in self.cached_seqs
        )
