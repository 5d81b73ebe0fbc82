"""Applying a step whose sequences verified draft tokens (speculative decoding), on rank 0.

A decoding sequence with known tokens ``t[0..L)`` (``L - 1`` computed) and
drafts ``d[0..n)`` ran the query ``t[L-1], d[0], ..., d[n-1]`` at positions
``L-1 .. L+n-1`` and got back a *run*: ``d[0..j)`` (the accepted drafts) and
one more token. Applying it:

* KV progress: positions ``L-1 .. L+j-1`` hold real tokens, so
  ``num_computed_tokens = L + j``; the block table is cut back to the blocks
  those positions need (``BlockManager.truncate``), and the workers' mirrors
  drop the ``n - j`` rejected drafts and the released blocks with the next
  delta (``PlanBuilder.rollback``).
* Tokens are appended one at a time with the usual stop checks (EOS or stop
  token once ``min_tokens`` exist, ``max_tokens``, ``max_model_len``, the KV
  capacity); a stop inside the run cuts the run there, in place, so what the
  engine then emits is what decoding without drafts would have emitted.
* Prefix cache: only full blocks of accepted, computed tokens are hashed
  (rejected positions are never counted as computed).

Sequences of the same step without drafts go through ``Scheduler.postprocess``
unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rtp.core.schedule_types import ScheduleResult
from rtp.core.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from rtp.core.scheduler import Scheduler


def apply_verified_step(
    sched: Scheduler, result: ScheduleResult, runs: list[list[int]],
    forks: dict[int, list[tuple[Sequence, int]]] | None = None,
) -> list[Sequence]:
    """Apply a computed step of ``result`` (which has drafts): ``runs`` holds one list per scheduled
    sequence with ``needs_sample``, in batch order: its one sampled token, or for a sequence with drafts
    its run (accepted drafts, then the next token). Runs cut by a stop are shortened in place.

    ``forks`` as for ``Scheduler.postprocess``. Returns the sequences that finished.
    """
    assert result.drafts is not None and len(result.drafts) == len(result.seqs)
    expected = sum(result.needs_sample)
    if len(runs) != expected:
        raise ValueError(f"postprocess_speculative got {len(runs)} runs, expected {expected}")
    plain = ScheduleResult(result.plan)
    plain_tokens: list[int] = []
    verified: list[tuple[Sequence, int, int, list[int]]] = []  # (seq, query length, drafts, run)
    it = iter(runs)
    for seq, n, needs_sample, draft in zip(result.seqs, result.num_new_tokens, result.needs_sample, result.drafts):
        run = next(it) if needs_sample else None
        if draft:
            assert run is not None and 1 <= len(run) <= len(draft) + 1, (seq, draft, run)
            assert not forks or seq.seq_id not in forks, f"{seq} forks at a verified step"  # postprocess forks
            verified.append((seq, n, len(draft), run))
            continue
        plain.seqs.append(seq)
        plain.num_new_tokens.append(n)
        plain.needs_sample.append(needs_sample)
        if run is not None:
            if len(run) != 1:
                raise ValueError(f"{seq} verified no drafts but got {len(run)} tokens")
            plain_tokens.append(run[0])
    finished = sched.postprocess(plain, plain_tokens, forks)
    for seq, n, num_drafts, run in verified:
        if _apply_run(sched, seq, n, num_drafts, run):
            finished.append(seq)
    return finished


def _apply_run(sched: Scheduler, seq: Sequence, n: int, num_drafts: int, run: list[int]) -> bool:
    """Apply one verified sequence's run (see the module docstring); True if the sequence finished."""
    if seq.status is not SequenceStatus.RUNNING:
        run.clear()  # aborted or finished by the engine after schedule(): nothing is emitted
        return False
    bm = sched.block_manager
    num_known = len(seq.token_ids)
    assert seq.num_computed_tokens + n == num_known + num_drafts, (seq, n, num_drafts)
    accepted = len(run) - 1
    # The query's first token and the accepted drafts have their KV; the rejected drafts' slots are garbage.
    seq.num_computed_tokens = num_known + accepted
    bm.truncate(seq, seq.num_computed_tokens)
    sched.plans.rollback(seq.seq_id, num_known + accepted, len(seq.block_table))
    reason = None
    for i, token in enumerate(run):
        seq.append_token(token)
        reason = sched._stop_reason(seq, token)  # noqa: SLF001 - the scheduler's own stop rule
        if reason is not None:
            del run[i + 1 :]
            break
    sched.counters.num_decode_tokens += len(run)  # tokens this decode produced (1 + accepted drafts)
    if seq.num_computed_tokens > len(seq.token_ids):  # stopped before its accepted drafts: they are not its tokens
        seq.num_computed_tokens = len(seq.token_ids)
    if bm.enable_prefix_caching and seq.num_computed_tokens // bm.block_size > seq.num_hashed_blocks:
        bm.cache_computed_blocks(seq)
    if reason is not None:
        sched._finish(seq, reason)  # noqa: SLF001
        return True
    return False
