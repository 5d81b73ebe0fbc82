"""Vocab-parallel embedding and LM head.

The vocabulary is padded up to a multiple of the TP size; rank r holds rows
``[r * V_local, (r + 1) * V_local)``. Padded rows are zero and their logits are
cut off after the gather.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rtp.distributed.parallel import ParallelState
from rtp.model.linear import LinearBase, _copy, frozen_param


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose rows are split over the TP ranks."""

    def __init__(self, vocab_size: int, dim: int, ps: ParallelState) -> None:
        super().__init__()
        self.ps = ps
        self.vocab_size = vocab_size
        padded = -(-vocab_size // ps.tp_size) * ps.tp_size
        self.vocab_local = padded // ps.tp_size
        self.vocab_start = ps.tp_rank * self.vocab_local
        self.weight = frozen_param(torch.zeros(self.vocab_local, dim), self.weight_loader)

    def weight_loader(self, param: nn.Parameter, source, shard_id=None) -> None:  # noqa: ANN001
        # The last rank may own fewer real rows than vocab_local; the rest stay zero.
        stop = min(self.vocab_start + self.vocab_local, self.vocab_size)
        n = max(0, stop - self.vocab_start)
        param.data.zero_()
        if n:
            _copy(param.data[:n], source[self.vocab_start : stop])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [T] -> [T, dim]
        if self.ps.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        mask = (local >= 0) & (local < self.vocab_local)
        out = F.embedding(torch.where(mask, local, 0), self.weight)
        out = out * mask.unsqueeze(-1).to(out.dtype)
        return self.ps.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding, LinearBase):
    """Output projection: each rank computes its vocab slice, rank 0 gathers the logits.

    Its weight has the embedding's layout and loader (plain); a tied head reads the embedding's weight
    and has no checkpoint tensor of its own.
    """

    def __init__(self, vocab_size: int, dim: int, ps: ParallelState, tied: bool = False) -> None:
        super().__init__(vocab_size, dim, ps)
        self.full_shapes = {} if tied else {None: (vocab_size, dim)}

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        # hidden: [N, dim] -> logits [N, vocab_size] on rank 0, None elsewhere
        local = self.matmul(hidden)  # [N, V_local]
        full = self.ps.gather_to_driver(local, dim=-1)
        return full[:, : self.vocab_size] if full is not None else None

    def shard_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the logits, without the padded rows: [N, n] for token ids ``vocab_start`` to
        ``vocab_start + n`` (n may be 0 on the last rank of a tiny vocabulary)."""
        real = max(0, min(self.vocab_local, self.vocab_size - self.vocab_start))
        return self.matmul(hidden)[:, :real]
