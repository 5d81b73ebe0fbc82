"""What a step's forward pass hands rank 0 (:class:`StepOutput`), and how the last pipeline stage sends it there.

With pipeline stages the last stage computes the logits (gathered on its TP rank 0) and rank 0
samples: the sampler's state (penalties, grammars, seeds, forks for n > 1) stays on rank 0, and
the last stage sends rank 0 only the logits rows the step samples or reports as prompt logprobs.
One message per step, in step order: a header ``[S, P]`` (int64), then ``[3P]`` (seq id, first
position, rows of each prompt-logits chunk), then the ``[S, vocab]`` sample rows, then the
prompt-logits rows concatenated. Sends are asynchronous, so the last stage can go on with its
next step while rank 0 has not collected this one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from rtp.distributed.parallel import ParallelState

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
class StepOutput:
    """What one step's forward pass hands rank 0's engine (other ranks get an empty one).

    Room for what later steps produce besides logits (hidden states for an EAGLE proposer).
    """

    sample_logits: torch.Tensor | None = None
    """[S, vocab] float32: one row per sequence sampled this step, in batch order (1 + its draft count
    rows, consecutive, for a sequence verifying drafts); None when none is."""
    prompt_logits: list[PromptLogits] = field(default_factory=list)
    """One entry per sequence of ``plan.prompt_logprob_seq_ids`` in the batch, in batch order."""


class StageOutputs:
    """The last stage's TP rank 0 sends each step's StepOutput to rank 0; rank 0 receives them in order."""

    def __init__(self, ps: ParallelState, vocab_size: int) -> None:
        self.ps, self.vocab = ps, vocab_size
        self.last_leader = ps.stage_rank(ps.pp_size - 1)
        self.bytes_sent = 0
        self._pending: list[tuple[dist.Work | None, torch.Tensor]] = []
        self._expected: deque[bool] = deque()  # rank 0: per step submitted, whether the last stage sends outputs

    def expect(self, has_output: bool) -> None:
        """Rank 0: a step was submitted; ``has_output`` False for a step without tokens (nothing is sent)."""
        self._expected.append(has_output)

    def _isend(self, t: torch.Tensor) -> None:
        t = t.contiguous()
        self._pending.append((dist.isend(t, 0, tag=_TAG), t))
        self.bytes_sent += t.numel() * t.element_size()

    def send(self, out: StepOutput) -> None:
        """Send one step's outputs to rank 0 (the last stage's TP rank 0)."""
        for work, _ in self._pending:
            if work is not None:
                work.wait()
        self._pending.clear()
        dev = self.ps.device
        s = 0 if out.sample_logits is None else out.sample_logits.shape[0]
        p = len(out.prompt_logits)
        self._isend(torch.tensor([s, p], dtype=torch.int64, device=dev))
        if p:
            meta = [v for c in out.prompt_logits for v in (c.seq_id, c.first_pos, c.logits.shape[0])]
            self._isend(torch.tensor(meta, dtype=torch.int64, device=dev))
        if out.sample_logits is not None:
            self._isend(out.sample_logits.float())
        if p:
            self._isend(torch.cat([c.logits for c in out.prompt_logits]).float())

    def _recv(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=self.ps.device)
        dist.recv(t, self.last_leader, tag=_TAG)
        return t

    def recv(self) -> StepOutput:
        """Rank 0: the outputs of the oldest submitted step not received yet."""
        assert self._expected, "collect() without a submitted step"
        if not self._expected.popleft():
            return StepOutput()
        s, p = (int(v) for v in self._recv((2,), torch.int64).tolist())
        meta = self._recv((3 * p,), torch.int64).tolist() if p else []
        out = StepOutput()
        if s:
            out.sample_logits = self._recv((s, self.vocab), torch.float32)
        if p:
            rows = self._recv((sum(meta[2::3]), self.vocab), torch.float32)
            start = 0
            for seq_id, first, n in zip(meta[0::3], meta[1::3], meta[2::3]):
                out.prompt_logits.append(PromptLogits(seq_id, first, rows[start : start + n]))
                start += n
        return out
