"""The proposers behind :class:`rtp.spec.controller.SpecController`: one interface, one class per method.

The controller picks the sequences that draft in a step and how many tokens each may draft (its
*room*); a proposer turns them into draft tokens, all at once (a draft model batches them into one
forward pass per draft position). ``sync`` sees every engine step's running sequences before the
controller decides anything, so a proposer with per-sequence state (the draft model's KV progress)
can drop what a finished or preempted sequence left; ``observe`` sees every step's output (an EAGLE-3
head takes the target's auxiliary hidden states from it).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from rtp.core.sequence import Sequence
from rtp.spec.ngram import ngram_propose

if TYPE_CHECKING:
    from rtp.config import RtpConfig
    from rtp.runtime.model_runner import ModelRunner
    from rtp.runtime.stage_output import StepOutput


class Proposer(Protocol):
    """Drafts tokens for decoding sequences on rank 0."""

    def sync(self, running: list[Sequence]) -> None:
        """Called once per engine step with the running sequences, before :meth:`propose`."""

    def observe(self, out: StepOutput) -> None:
        """Called with rank 0's output of every step, before the step's tokens are appended."""

    def propose(self, seqs: list[Sequence], rooms: list[int]) -> list[list[int]]:
        """Per sequence, at most ``rooms[i]`` (>= 1) draft tokens continuing ``seqs[i].token_ids`` (may be [])."""


class NgramProposer:
    """Prompt lookup (:func:`rtp.spec.ngram.ngram_propose`), sequence by sequence; no state."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def sync(self, running: list[Sequence]) -> None:
        pass

    def observe(self, out: StepOutput) -> None:
        pass

    def propose(self, seqs: list[Sequence], rooms: list[int]) -> list[list[int]]:
        return [ngram_propose(s.token_ids, self.min_n, self.max_n, room) for s, room in zip(seqs, rooms)]


def build_proposer(config: RtpConfig, runner: ModelRunner, model_dir: Path) -> Proposer:
    """The proposer of ``config.speculative_config`` for the target in ``model_dir``, run by rank 0's ``runner``."""
    spec = config.speculative_config
    if spec.method == "ngram":
        return NgramProposer(*spec.lookup_range)
    if spec.method == "draft_model":
        from rtp.spec.draft_model import DraftModelProposer  # torch and the model code: only when used

        return DraftModelProposer.for_target(config, runner, model_dir)
    if spec.method == "eagle3":
        from rtp.spec.eagle3 import Eagle3Proposer

        return Eagle3Proposer.for_target(config, runner, model_dir)
    raise ValueError(f"speculative_config.method={spec.method!r} has no proposer")
