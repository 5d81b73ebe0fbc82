"""Who drafts how many tokens in a step, and what came of it: the speculative decoding policy and counters.

Adaptive draft length. A step drafts nothing while more sequences run than
``disable_by_batch_size``: verifying ``k`` drafts costs ``k + 1`` query tokens
per sequence, which a large batch pays for in throughput without a latency
gain. A sequence whose recent drafts were mostly rejected (an exponential
average of its per-step acceptance rate below ``min_acceptance_rate``) stops
drafting for a while (8 steps, doubling on each relapse up to 256), then tries
again. Drafts never run past ``max_tokens`` or ``max_model_len``: the tokens a
step can add, drafts plus the one after them, always fit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rtp.config.sections import SpeculativeConfig
from rtp.core.sequence import Sequence
from rtp.log import get_logger
from rtp.spec.proposer import NgramProposer, Proposer

if TYPE_CHECKING:
    from rtp.runtime.stage_output import StepOutput

logger = get_logger(__name__)

_EMA = 0.3  # weight of the latest step in a sequence's acceptance average
_BACKOFF_START, _BACKOFF_MAX = 8, 256  # steps a poorly accepted sequence waits before drafting again


@dataclass
class SpecCounters:
    """Cumulative speculative decoding counters (vLLM's spec_decode_* metrics)."""

    num_drafts: int = 0  # sequence-steps that verified at least one draft token
    num_draft_tokens: int = 0  # draft tokens verified
    num_accepted_tokens: int = 0  # draft tokens accepted
    accepted_per_pos: list[int] = field(default_factory=list)  # [k] drafts accepted at position i of a draft
    num_refused_tokens: int = 0  # draft tokens dropped before verification: the request's grammar refuses them

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a drafting sequence got per step: 1 + accepted drafts per draft (vLLM's definition)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_stats(self) -> dict[str, float]:
        """Flat entries for the engine's stats dict (``spec_accepted_pos_<i>`` per position)."""
        out: dict[str, float] = {
            "spec_num_drafts": self.num_drafts,
            "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_num_refused_draft_tokens": self.num_refused_tokens,
        }
        for i, n in enumerate(self.accepted_per_pos):
            out[f"spec_accepted_pos_{i}"] = n
        return out


@dataclass
class _SeqAcceptance:
    rate: float = 1.0  # exponential average of accepted / drafted per step
    skip_until: int = 0  # the step from which it drafts again
    backoff: int = _BACKOFF_START


class SpecController:
    """Rank 0's draft policy for one engine; ``proposer`` makes the drafts (default: n-gram lookup)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, proposer: Proposer | None = None) -> None:
        assert config.num_speculative_tokens is not None
        self.config = config
        self.k = config.num_speculative_tokens
        self.proposer: Proposer = proposer or NgramProposer(*config.lookup_range)
        self.max_model_len = max_model_len
        self.counters = SpecCounters(accepted_per_pos=[0] * self.k)
        self._acceptance: dict[int, _SeqAcceptance] = {}
        self._step = 0
        self._last_log = (0, 0)  # (num_drafts, num_accepted_tokens) at the last log line

    def propose(self, running: list[Sequence], can_draft: Callable[[Sequence], bool],
                valid_prefix: Callable[[Sequence, list[int]], int] | None = None) -> dict[int, list[int]]:
        """Drafts for the decoding sequences of ``running`` that may draft now: seq_id -> tokens (non-empty).

        ``valid_prefix(seq, drafts)``: how many leading drafts the sequence's grammar accepts; the rest are
        dropped (counted in ``num_refused_tokens``) rather than verified only to be rejected.
        """
        self._step += 1
        self.proposer.sync(running)
        if not running or not self.drafts_at(len(running)):
            return {}
        if len(self._acceptance) > 2 * len(running) + 64:  # forget sequences that left
            live = {s.seq_id for s in running}
            self._acceptance = {i: a for i, a in self._acceptance.items() if i in live}
        seqs: list[Sequence] = []
        rooms: list[int] = []
        for seq in running:
            num_tokens = len(seq.token_ids)
            if (seq.num_computed_tokens != num_tokens - 1 or num_tokens == seq.num_prompt_tokens
                    or seq.needs_prompt_logits):
                # Not decoding: a prefill chunk (a prompt's one-token last chunk included: it samples the first
                # token, from which the other choices of n > 1 fork), a fork's tail.
                continue
            # A step adds the accepted drafts and one more token: keep within the length limits.
            room = min(self.k, self.max_model_len - num_tokens - 1)
            max_tokens = seq.params.max_tokens
            if max_tokens is not None:
                room = min(room, max_tokens - seq.num_completion_tokens - 1)
            if room <= 0:
                continue
            acc = self._acceptance.get(seq.seq_id)
            if acc is not None and acc.skip_until > self._step:
                continue
            if not can_draft(seq):
                continue
            seqs.append(seq)
            rooms.append(room)
        if not seqs:
            return {}
        drafts = self.proposer.propose(seqs, rooms)
        out: dict[int, list[int]] = {}
        for seq, d, room in zip(seqs, drafts, rooms):
            d = d[:room]
            if d and valid_prefix is not None:
                n = valid_prefix(seq, d)
                self.counters.num_refused_tokens += len(d) - n
                d = d[:n]
            if d:
                out[seq.seq_id] = d
        return out

    def drafts_at(self, batch: int) -> bool:
        """Whether sequences draft while ``batch`` sequences run (``disable_by_batch_size``)."""
        limit = self.config.disable_by_batch_size
        return limit is None or batch <= limit

    def observe(self, out: StepOutput, batch: int) -> None:
        """Hand rank 0's output of a step that ``batch`` sequences ran in to the proposer (before the step's
        tokens are appended); not while the batch is above ``disable_by_batch_size``: nothing drafts then,
        and an EAGLE-3 head would turn every token's hidden states into features (~4% of a 32-sequence
        step here) and keep them for as long as the batch stays large. When it drafts again, the positions
        computed meanwhile have zero features: worse drafts there, never other output."""
        if self.drafts_at(batch):
            self.proposer.observe(out)

    def record(self, seq_id: int, num_drafted: int, num_accepted: int) -> None:
        """One sequence verified ``num_drafted`` drafts this step and accepted the first ``num_accepted``."""
        if num_drafted == 0:
            return
        c = self.counters
        c.num_drafts += 1
        c.num_draft_tokens += num_drafted
        c.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            c.accepted_per_pos[i] += 1
        acc = self._acceptance.setdefault(seq_id, _SeqAcceptance())
        acc.rate = (1 - _EMA) * acc.rate + _EMA * (num_accepted / num_drafted)
        threshold = self.config.min_acceptance_rate
        if threshold > 0 and acc.rate < threshold:
            acc.skip_until = self._step + acc.backoff
            acc.backoff = min(2 * acc.backoff, _BACKOFF_MAX)
            acc.rate = threshold  # the next try starts at the threshold: one poor step stops it again
        elif acc.rate >= 2 * threshold:
            acc.backoff = _BACKOFF_START

    def log_line(self) -> str | None:
        """A summary since the last call (None if nothing was drafted since): drafts, acceptance, mean length."""
        c = self.counters
        drafts, accepted = c.num_drafts - self._last_log[0], c.num_accepted_tokens - self._last_log[1]
        if drafts == 0:
            return None
        self._last_log = (c.num_drafts, c.num_accepted_tokens)
        return (f"speculative decoding: {drafts} drafts, {accepted} draft tokens accepted, mean acceptance length "
                f"{1 + accepted / drafts:.2f} (since start: {c.mean_acceptance_length:.2f}, "
                f"{c.num_accepted_tokens}/{c.num_draft_tokens} draft tokens accepted)")
