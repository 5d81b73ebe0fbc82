"""One request's token bookkeeping on rank 0: tokens, KV progress, block table, status."""

from __future__ import annotations

import enum
import sys

from rtp.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life: queued, holding KV blocks, or done."""

    WAITING = enum.auto()  # queued (new, or preempted and holding no blocks)
    RUNNING = enum.auto()  # admitted: holds KV blocks and is scheduled in steps
    FINISHED = enum.auto()  # stopped, hit a length limit, or aborted; holds nothing


class Sequence:
    """The prompt and completion of one request, plus what the KV cache holds for it.

    ``token_ids`` is prompt followed by every sampled token. ``num_computed_tokens``
    of them have their KV written into the blocks of ``block_table`` (block ``i``
    holds positions ``[i * block_size, (i + 1) * block_size)``). The last token of a
    running sequence is never computed yet: its KV is written by the next step,
    which also samples the token after it.
    """

    def __init__(
        self,
        seq_id: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        self.seq_id = seq_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.params = params
        self.arrival_time = arrival_time
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None  # "stop" | "length" | "abort"
        # KV progress. Reset to 0 / [] when the sequence is preempted.
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt+generated tokens served by the prefix cache at the last admission
        self.block_table: list[int] = []
        # Prefix-cache bookkeeping, owned by the BlockManager:
        # chained hashes of the full blocks of token_ids (computed lazily; token ids never
        # change once known, so the list stays valid across preemption) ...
        self.block_hashes: list[int] = []
        # ... and how many leading blocks of block_table were already offered to the cache.
        self.num_hashed_blocks = 0
        # Prompt logprobs: True while the logits of this sequence's prompt positions are still wanted
        # (a plain attribute, not a property: the scheduler reads it for every sequence on every step).
        self.needs_prompt_logits = params.prompt_logprobs is not None and self.num_prompt_tokens >= 2
        # n > 1: True for samples 1..n-1, which start as a fork of sample 0 after its prefill.
        self.is_fork = False
        # Where it ends (read from params once; the scheduler checks them for every token): its stop
        # token ids, and prompt + max_tokens, the length at which it ends with "length".
        self.stop_token_set = frozenset(params.stop_token_ids or ())
        max_tokens = params.max_tokens
        self.max_num_tokens = sys.maxsize if max_tokens is None else self.num_prompt_tokens + max_tokens

    @property
    def num_tokens(self) -> int:
        """Number of known tokens (prompt + generated)."""
        return len(self.token_ids)

    @property
    def completion_token_ids(self) -> list[int]:
        """The generated tokens (a copy)."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_completion_tokens(self) -> int:
        """Number of generated tokens."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def last_token_id(self) -> int:
        """The most recent token (the last prompt token before anything is generated)."""
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        """True once the sequence stopped, hit a length limit or was aborted."""
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        """Append one sampled token (its KV is computed by the next step)."""
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, status={self.status.name}, tokens={self.num_tokens}, "
            f"prompt={self.num_prompt_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={len(self.block_table)}, finish={self.finish_reason})"
        )
