"""What the workers mirror of the running batch, and the StepPlan that brings their mirror up to date.

The scheduler decides which tokens of which sequences a step computes; this
module records what every rank has been sent of each sequence and turns a
step's decisions into the plan: new sequences in full, the others as deltas
(new tokens and blocks, and what to drop from the tail first), and the ids
whose mirror is to be freed.

Every rank applies each plan to its mirror (``rtp/runtime/batch.py``), so what
is recorded here must change exactly as the mirror does: a sequence is
recorded when it is sent in full, grows with each delta, shrinks with a
rollback, and is forgotten when it is released.
"""

from __future__ import annotations

from rtp.core.sequence import Sequence
from rtp.core.step import NewSeq, StepPlan


class PlanBuilder:
    """Rank 0's record of the workers' mirrors; builds each step's :class:`StepPlan` from it."""

    def __init__(self) -> None:
        # seq_id -> (tokens, blocks) the mirror holds: leading entries of seq.token_ids / seq.block_table.
        self._sent: dict[int, tuple[int, int]] = {}
        # seq_id -> (tokens, blocks) the mirror drops from its tail before the next delta's appends.
        self._rollback: dict[int, tuple[int, int]] = {}
        self._pending_freed: list[int] = []  # mirrored ids to free in the next non-empty plan

    def is_mirrored(self, seq_id: int) -> bool:
        """True while the workers hold a mirror of ``seq_id``."""
        return seq_id in self._sent

    def build(
        self, new: list[Sequence], new_tokens: list[int], running: list[Sequence], running_tokens: list[int]
    ) -> StepPlan:
        """The plan of a step computing ``new_tokens[i]`` tokens of ``new[i]``, then ``running_tokens[i]`` of
        ``running[i]`` (batch order), from each sequence's current KV progress, tokens and block table.

        ``new`` are sent in full (first scheduled, or again after a preemption); ``running`` must be
        mirrored. A plan with any sequence also carries the ids released since the last such plan, so an
        engine may skip executing an empty plan.
        """
        plan = StepPlan()
        sent = self._sent
        logprob_ids = plan.prompt_logprob_seq_ids
        for seq, n in zip(new, new_tokens):
            plan.new_seqs.append(
                NewSeq(seq.seq_id, list(seq.token_ids), list(seq.block_table), seq.num_computed_tokens, n)
            )
            sent[seq.seq_id] = (len(seq.token_ids), len(seq.block_table))
            if seq.needs_prompt_logits:
                logprob_ids.append(seq.seq_id)
        # Deltas as columns (see CachedSeqs), filled with local appends: this loop runs for every
        # running sequence on every step.
        cached = plan.cached_seqs
        ids, token_counts, token_ids = cached.seq_ids, cached.token_counts, cached.token_ids
        block_counts, block_ids = cached.block_counts, cached.block_ids
        for seq in running:
            seq_id, tokens, table = seq.seq_id, seq.token_ids, seq.block_table
            num_sent_tokens, num_sent_blocks = sent[seq_id]
            num_tokens, num_blocks = len(tokens), len(table)
            ids.append(seq_id)
            token_counts.append(num_tokens - num_sent_tokens)
            token_ids += tokens[num_sent_tokens:]
            block_counts.append(num_blocks - num_sent_blocks)
            if num_blocks > num_sent_blocks:  # a decode gets a block once every block_size steps
                block_ids += table[num_sent_blocks:]
            sent[seq_id] = (num_tokens, num_blocks)
            if seq.needs_prompt_logits:
                logprob_ids.append(seq_id)
        cached.num_new_tokens = list(running_tokens)
        cached.rollback_tokens, cached.rollback_blocks = [0] * len(ids), [0] * len(ids)
        cached.draft_counts = [0] * len(ids)  # drafts, if any, are added by add_drafts
        if self._rollback:
            for i, seq_id in enumerate(ids):
                if seq_id in self._rollback:
                    cached.rollback_tokens[i], cached.rollback_blocks[i] = self._rollback.pop(seq_id)
        if new or running:
            plan.freed_seq_ids, self._pending_freed = self._pending_freed, []
        return plan

    def add_drafts(self, plan: StepPlan, drafts: list[list[int]]) -> None:
        """Append each cached sequence's draft tokens (``drafts[i]`` for ``plan.cached_seqs[i]``, [] for
        none) to its delta, after its new tokens; the mirrors then hold them as tokens too.

        Only for steps with drafts: the token column is rebuilt (one pass over the step's new tokens).
        Once the drafts are verified, :meth:`rollback` drops the rejected ones from the mirrors.
        """
        cached = plan.cached_seqs
        assert len(drafts) == len(cached.seq_ids)
        flat: list[int] = []
        start = 0
        for i, (seq_id, count, draft) in enumerate(zip(cached.seq_ids, cached.token_counts, drafts)):
            flat += cached.token_ids[start : start + count]
            start += count
            if draft:
                flat += draft
                cached.token_counts[i] = count + len(draft)
                cached.draft_counts[i] = len(draft)
                tokens, blocks = self._sent[seq_id]
                self._sent[seq_id] = (tokens + len(draft), blocks)
        cached.token_ids = flat

    def rollback(self, seq_id: int, num_tokens: int, num_blocks: int) -> None:
        """Record that only the first ``num_tokens`` tokens and ``num_blocks`` blocks the workers hold of
        ``seq_id`` are still right (rank 0 cut the rest back, e.g. rejected speculative tokens).

        The next delta of the sequence drops the rest from the mirror's tail, then appends what follows.
        """
        sent = self._sent.get(seq_id)
        if sent is None:
            return  # not mirrored: it is sent in full when scheduled
        kept = (min(sent[0], num_tokens), min(sent[1], num_blocks))
        if kept == sent:
            return
        earlier = self._rollback.get(seq_id, (0, 0))
        self._rollback[seq_id] = (earlier[0] + sent[0] - kept[0], earlier[1] + sent[1] - kept[1])
        self._sent[seq_id] = kept

    def release(self, seq_id: int) -> None:
        """Forget ``seq_id`` (finished, aborted or preempted); its mirror is freed by the next non-empty plan."""
        if self._sent.pop(seq_id, None) is not None:
            self._rollback.pop(seq_id, None)
            self._pending_freed.append(seq_id)
