"""What a step's forward pass hands rank 0 (:class:`StepOutput`), and how the last pipeline stage gets it there.

With pipeline stages rank 0 samples, so the sampler's state (penalties, grammars, seeds, forks
for n > 1) stays where it is without stages; and rank 0 holds the LM head (a full, unsharded
copy), so the last stage sends it only the final hidden states of the rows the step samples or
reports as prompt logprobs: ``[R, hidden]`` rather than ``[R, vocab]`` of logits (vocab / hidden is
37 for Qwen3-235B). Both ends know R from the same plan (:class:`RowPlan`), so one tensor per step
crosses, with no header. Sends are asynchronous: the last stage goes on with its next step while
rank 0 has not collected this one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from rtp.distributed.parallel import ParallelState
from rtp.distributed.pipeline import PendingSends

_TAG = 1  # the hidden states travel with tag 0


@dataclass
class PromptLogits:
    """The logits of every position of one sequence's chunk, for its prompt logprobs."""

    seq_id: int
    first_pos: int
    """Position of the chunk's first token: row ``j`` holds the logits after position ``first_pos + j``."""
    logits: torch.Tensor
    """[chunk length, vocab] float32."""


@dataclass
class AuxHidden:
    """Auxiliary hidden states of a step's tokens, for an EAGLE-3 proposer (rank 0, when it asks for them).

    Every chunk of the step: its tokens' rows, consecutive, in batch order.
    """

    seq_ids: list[int]
    first_positions: list[int]
    """Position of each chunk's first token."""
    row_starts: list[int]
    """First row of each chunk in :attr:`hidden`; chunk ``i`` ends where chunk ``i + 1`` starts."""
    hidden: torch.Tensor
    """[T, len(layers) * hidden]: the residual stream entering each requested layer, concatenated."""

    def chunks(self) -> list[tuple[int, int, torch.Tensor]]:
        """(seq id, first position, rows [n, len(layers) * hidden]) of every chunk."""
        ends = self.row_starts[1:] + [self.hidden.shape[0]]
        return [(s, p, self.hidden[a:b]) for s, p, a, b in zip(self.seq_ids, self.first_positions,
                                                               self.row_starts, ends)]


@dataclass
class StepOutput:
    """What one step's forward pass hands rank 0's engine (other ranks get an empty one)."""

    sample_logits: torch.Tensor | None = None
    """[S, vocab] float32: one row per sequence sampled this step, in batch order (1 + its draft count
    rows, consecutive, for a sequence verifying drafts); None when none is."""
    sample_tokens: torch.Tensor | None = None
    """[S] int64: instead of ``sample_logits`` when the plan asked for the argmax (``StepPlan.sample_argmax``),
    the token of each sampled row's largest logit; the ranks chose them from their vocabulary shards."""
    prompt_logits: list[PromptLogits] = field(default_factory=list)
    """One entry per sequence of ``plan.prompt_logprob_seq_ids`` in the batch, in batch order."""
    aux_hidden: AuxHidden | None = None
    """The step's auxiliary hidden states, when rank 0's runner was asked for them
    (:meth:`rtp.runtime.model_runner.ModelRunner.request_aux_hidden`); else None."""


@dataclass
class RowPlan:
    """Which flat positions of a step go through the LM head, and which logits rows are what."""

    positions: np.ndarray
    """[R] int64 flat token positions whose logits are computed, ascending."""
    sample_rows: np.ndarray | None = None
    """Rows that are sampled, in batch order; None: every row is (the common case)."""
    prompts: list[tuple[int, int, int, int]] = field(default_factory=list)
    """(seq id, first position, first row, end row) of each prompt-logprob chunk, in batch order."""

    def output(self, logits: torch.Tensor) -> StepOutput:
        """The StepOutput of ``logits`` [R, vocab] float32, the rows of :attr:`positions`."""
        if self.sample_rows is None:
            return StepOutput(sample_logits=logits)
        out = StepOutput()
        if len(self.sample_rows):
            out.sample_logits = logits[torch.from_numpy(self.sample_rows).to(logits.device)]
        out.prompt_logits = [PromptLogits(seq_id, first, logits[start:end])
                             for seq_id, first, start, end in self.prompts]
        return out


class StageOutputs:
    """The last stage's TP rank 0 sends each step's final hidden rows to rank 0; rank 0 receives them in order."""

    def __init__(self, ps: ParallelState) -> None:
        self.ps = ps
        self.last_leader = ps.stage_rank(ps.pp_size - 1)
        self._sends = PendingSends()
        self._expected: deque[RowPlan | None] = deque()  # rank 0: the rows of each step submitted

    def expect(self, rows: RowPlan | None) -> None:
        """Rank 0: a step was submitted; ``rows`` None for a step whose last stage sends nothing."""
        self._expected.append(rows)

    def send(self, hidden: torch.Tensor) -> None:
        """Send one step's final hidden rows [R, hidden] to rank 0 (the last stage's TP rank 0)."""
        self._sends.wait()
        self._sends.isend(hidden.contiguous(), 0, tag=_TAG)

    def recv(self, hidden_size: int, dtype: torch.dtype) -> tuple[RowPlan | None, torch.Tensor | None]:
        """Rank 0: the row plan and the final hidden rows [R, hidden] of the oldest step not received yet."""
        assert self._expected, "collect() without a submitted step"
        rows = self._expected.popleft()
        if rows is None:
            return None, None
        t = torch.empty(len(rows.positions), hidden_size, dtype=dtype, device=self.ps.device)
        dist.recv(t, self.last_leader, tag=_TAG)
        return rows, t
