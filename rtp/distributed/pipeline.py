"""Pipeline stages: which layers each stage holds, and the point-to-point links between stages.

A stage boundary carries one tensor per step, the hidden states ``[T, hidden]``
(Qwen3's decoder layers keep the residual stream in that tensor: there is no
separate residual to send). Every TP rank of a stage holds the same hidden
states after its last all-reduce, so each sends only its 1/TP slice to the TP
rank of the same index in the next stage, and the next stage all-gathers the
slices over its own TP group: the link between two stages carries one copy.

Sends are asynchronous (``isend``), so a stage can start on its next step
while the previous step's hidden states are still on the wire; a send is waited
for before its buffer would be reused, and at the latest when the next send
starts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rtp.distributed.parallel import ParallelState
from rtp.errors import ConfigError


def stage_layers(num_layers: int, pp_size: int, partition: tuple[int, ...] | None = None) -> list[range]:
    """The contiguous layer range of each of ``pp_size`` stages.

    Without ``partition`` the split is even; the remainder goes one layer each to the middle
    stages (last middle stage first), then to the last stage, and to the first stage only when
    nothing else is left: the first stage also embeds, and its rank 0 schedules, samples and runs
    the LM head.
    """
    if partition is not None:
        if len(partition) != pp_size:
            raise ConfigError(f"pipeline_layer_partition={list(partition)} has {len(partition)} entries, "
                              f"expected one per stage (pipeline_parallel_size={pp_size})")
        if sum(partition) != num_layers or min(partition) < 1:
            raise ConfigError(f"pipeline_layer_partition={list(partition)} is invalid: expected entries >= 1 "
                              f"summing to the model's {num_layers} layers")
        sizes = list(partition)
    else:
        if pp_size > num_layers:
            raise ConfigError(f"pipeline_parallel_size={pp_size} is larger than the model's {num_layers} layers: "
                              "every stage needs at least one layer")
        sizes = [num_layers // pp_size] * pp_size
        order = list(range(pp_size - 2, 0, -1)) + [pp_size - 1, 0]  # middle stages, then last, then first
        for stage in order[: num_layers % pp_size]:
            sizes[stage] += 1
    ranges, start = [], 0
    for n in sizes:
        ranges.append(range(start, start + n))
        start += n
    return ranges


class PendingSends:
    """Asynchronous sends in flight, with the buffers they read (kept alive until the send completes)."""

    def __init__(self) -> None:
        self._sends: list[tuple[dist.Work | None, torch.Tensor]] = []
        self.bytes_sent = 0
        """Bytes of every send started, for benchmarks."""

    def isend(self, t: torch.Tensor, dst: int, tag: int) -> None:
        """Start sending ``t`` (contiguous) to global rank ``dst``."""
        self._sends.append((dist.isend(t, dst, tag=tag), t))
        self.bytes_sent += t.numel() * t.element_size()

    def wait(self) -> None:
        """Wait until every send started has completed (its buffers may then go)."""
        for work, _ in self._sends:
            if work is not None:
                work.wait()
        self._sends.clear()


class StageLink:
    """This rank's ends of the links to the previous and the next pipeline stage."""

    def __init__(self, ps: ParallelState) -> None:
        self.ps = ps
        self._sends = PendingSends()

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank has sent to the next stage (hidden-state slices), for benchmarks."""
        return self._sends.bytes_sent

    def _slices(self, numel: int) -> int:
        """Elements of one TP rank's slice of a flattened tensor of ``numel`` (padded to a multiple of TP)."""
        tp = self.ps.tp_size
        return -(-numel // tp)

    def send_hidden(self, hidden: torch.Tensor) -> None:
        """Send this TP rank's slice of ``hidden`` [T, H] to the same TP rank of the next stage."""
        ps = self.ps
        self.wait_sends()
        flat = hidden.reshape(-1)
        n = self._slices(flat.numel())
        part = flat[ps.tp_rank * n : (ps.tp_rank + 1) * n]  # a view: the send keeps it (and hidden) alive
        if len(part) < n:  # the last ranks' slices run past the end: zero padding
            part = torch.cat([part, part.new_zeros(n - len(part))])
        self._sends.isend(part.contiguous(), ps.stage_rank(ps.pp_rank + 1, ps.tp_rank), tag=0)

    def recv_hidden(self, num_tokens: int, hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
        """The previous stage's hidden states [num_tokens, hidden_size], all-gathered over this stage's TP group."""
        ps = self.ps
        numel = num_tokens * hidden_size
        n = self._slices(numel)
        part = torch.empty(n, dtype=dtype, device=ps.device)
        dist.recv(part, ps.stage_rank(ps.pp_rank - 1, ps.tp_rank), tag=0)
        if ps.tp_size == 1:
            return part[:numel].view(num_tokens, hidden_size)
        parts = [torch.empty_like(part) for _ in range(ps.tp_size)]
        dist.all_gather(parts, part, group=ps.tp_group)
        return torch.cat(parts)[:numel].view(num_tokens, hidden_size)

    def wait_sends(self) -> None:
        """Wait until every send this rank started has completed (its buffers may then go)."""
        self._sends.wait()
