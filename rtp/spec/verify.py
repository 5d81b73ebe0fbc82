"""Verification of draft tokens: the accepted run is what decoding without drafts would have produced.

A sequence with drafts ``d[0..n)`` gets ``n + 1`` logits rows from its step:
row ``j`` is the target's distribution after the known tokens and ``d[0..j)``.
Each row is sampled exactly as a step without speculation samples it, with the
state the sequence would have after ``d[0..j)``: penalties count them,
``min_tokens`` and bad words see them, a grammar has accepted them, and a
seeded request draws the uniform of generation step ``g + j``. The drafts are
accepted while the token drawn from row ``j`` equals ``d[j]``; the first token
that differs (or the one after the last draft) ends the run.

This is rejection sampling for a deterministic (point-mass) proposal: ``d[j]``
is accepted with probability ``p(d[j])``, and on rejection the token drawn is
distributed as ``p`` with ``d[j]`` removed and renormalised, so every token of
the output has exactly the target's distribution. It also couples the draws:
a seeded request produces the very tokens it produces without speculation, and
greedy decoding the very argmax run.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from rtp.runtime.sampler import PenaltyState, SampleRow
from rtp.sampling import TokenConstraint


def accepted_run(drafts: list[int], drawn: list[int]) -> list[int]:
    """The tokens a sequence gets: ``drawn`` (one per verification row, ``len(drafts) + 1``) up to and
    including the first one that differs from its draft."""
    assert len(drawn) == len(drafts) + 1, (len(drafts), len(drawn))
    j = 0
    while j < len(drafts) and drawn[j] == drafts[j]:
        j += 1
    return drawn[: j + 1]


class FixedMask:
    """A constraint frozen at one position: the allowed tokens computed when the row was built."""

    def __init__(self, allowed: torch.Tensor | None) -> None:
        self._allowed = allowed

    def allowed_tokens(self, vocab_size: int) -> torch.Tensor | None:
        return self._allowed

    def accept(self, token_id: int) -> None:  # never advanced: it only answers one row
        raise AssertionError("a verification row's mask is never advanced")

    def is_terminated(self) -> bool:
        return False


def supports_drafts(constraint: TokenConstraint | None) -> bool:
    """Whether drafts can be verified under ``constraint``: none, or one that can roll tokens back."""
    return constraint is None or callable(getattr(constraint, "rollback", None))


def _allows(mask: torch.Tensor | None, token: int) -> bool:
    """Whether a mask as ``TokenConstraint.allowed_tokens`` returns it (bool or packed int32) allows ``token``."""
    if mask is None:
        return True
    if mask.dtype == torch.bool:
        return token < mask.numel() and bool(mask[token])
    word = token // 32
    return word < mask.numel() and bool((int(mask[word]) >> (token % 32)) & 1)


def _position_masks(constraint: TokenConstraint, drafts: list[int], vocab: int) -> list[FixedMask]:
    """The grammar's mask at each verification position (after ``drafts[:j]``); the grammar is left as it was.

    Past a draft the grammar refuses, the rows repeat the last mask: that draft is rejected (its probability
    is 0), so the rows after it are never used.
    """
    masks: list[FixedMask] = []
    accepted = 0
    live = True
    for j in range(len(drafts) + 1):
        if not live:
            masks.append(masks[-1])
            continue
        allowed = constraint.allowed_tokens(vocab)
        allowed = None if allowed is None else allowed.clone()  # the constraint reuses its buffer
        masks.append(FixedMask(allowed))
        if j == len(drafts):
            break
        if constraint.is_terminated() or not _allows(allowed, drafts[j]):
            live = False
            continue
        constraint.accept(drafts[j])
        accepted += 1
    if accepted:
        constraint.rollback(accepted)  # type: ignore[attr-defined]  # checked by supports_drafts
    return masks


def grammar_prefix(constraint: TokenConstraint, drafts: list[int], vocab: int) -> int:
    """How many leading ``drafts`` the grammar accepts in turn (its state is left as it was).

    Drafts past that would be computed by the verification step only to be rejected (their probability
    under the grammar's mask is 0), so the engine drops them before the step is scheduled.
    """
    n = 0
    for token in drafts:
        if constraint.is_terminated() or not _allows(constraint.allowed_tokens(vocab), token):
            break
        constraint.accept(token)
        n += 1
    if n:
        constraint.rollback(n)  # type: ignore[attr-defined]  # checked by supports_drafts
    return n


def verification_rows(row: SampleRow, drafts: list[int], vocab: int) -> list[SampleRow]:
    """The ``len(drafts) + 1`` sampler rows of a sequence verifying ``drafts``; ``row`` is its row now.

    Row ``j`` is the sequence as it would be after accepting ``drafts[:j]``.
    """
    if not drafts:
        return [row]
    p = row.params
    needs_tokens = p.has_penalties or bool(row.bad_words_token_ids)
    base = list(row.token_ids) if needs_tokens else row.token_ids
    masks = _position_masks(row.constraint, drafts, vocab) if row.constraint is not None else None
    rows: list[SampleRow] = []
    for j in range(len(drafts) + 1):
        tokens = base if j == 0 or not needs_tokens else [*base, *drafts[:j]]
        # Row 0 advances the sequence's own penalty state; later rows count their drafts from scratch
        # (a fresh state counts every output token of ``tokens``) and are dropped after the step.
        penalty = row.penalty_state if j == 0 else (PenaltyState() if p.has_penalties else None)
        rows.append(replace(row, num_generated=row.num_generated + j, token_ids=tokens, penalty_state=penalty,
                            constraint=masks[j] if masks is not None else None))
    return rows
