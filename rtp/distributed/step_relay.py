"""Step plans from rank 0 to the leaders of the other nodes, over the leaders' gloo group.

With several nodes, rank 0 still writes each encoded StepPlan to its own
node's shared-memory channel, and also sends it once to every other node's
leader, which republishes it on its node's channel (see the worker loop).
One step is one ``broadcast`` of a pre-sized uint8 buffer: an 8-byte length
header followed by the first ``inline_bytes - 8`` bytes of the plan. A longer
plan (a big prefill) sends its remainder in a second broadcast, into a spill
buffer that grows when needed. Nothing is pickled per step.

A broadcast blocked on a lost peer does not hang the run: gloo fails it when
the connection breaks, and the watchdog ends the process when the peer's
relayed heartbeat times out (whichever comes first). A leader waits in
``recv`` for as long as rank 0 has nothing to run (an idle server), so the
leaders' group gets no collective timeout of its own (:func:`new_relay_group`).
"""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

DEFAULT_INLINE_BYTES = 4096
_HEADER = 8
# The leaders' wait for the next plan is unbounded by design: liveness comes from the heartbeats.
IDLE_WAIT = timedelta(days=365)


def new_relay_group(ranks: list[int]) -> dist.ProcessGroup:
    """The gloo group of the node leaders (collective: every rank of the world calls it)."""
    group = dist.new_group(ranks, backend="gloo", timeout=IDLE_WAIT)
    assert group is not None  # new_group returns a group object on every rank (a placeholder off the group)
    return group


class StepRelay:
    """One end of the relay: rank 0 (``send``) or another node's leader (``recv``)."""

    def __init__(self, group: dist.ProcessGroup, src: int = 0, inline_bytes: int = DEFAULT_INLINE_BYTES) -> None:
        if inline_bytes <= _HEADER:
            raise ValueError(f"inline_bytes must exceed the {_HEADER}-byte header, got {inline_bytes}")
        self.group, self.src = group, src
        self._inline = torch.zeros(inline_bytes, dtype=torch.uint8)
        self._inline_np = self._inline.numpy()
        self._spill = torch.zeros(0, dtype=torch.uint8)

    @property
    def inline_cap(self) -> int:
        """Plan bytes that fit the first broadcast."""
        return self._inline.numel() - _HEADER

    def _spill_of(self, n: int) -> torch.Tensor:
        if self._spill.numel() < n:
            self._spill = torch.empty(max(n, 2 * self._spill.numel()), dtype=torch.uint8)  # grown, never shrunk
        return self._spill[:n]

    def send(self, data: bytes) -> None:
        """Rank 0: send one encoded plan to every other leader."""
        n = len(data)
        view = np.frombuffer(data, dtype=np.uint8)
        head = min(n, self.inline_cap)
        self._inline_np[:_HEADER] = np.frombuffer(n.to_bytes(_HEADER, "little"), dtype=np.uint8)
        self._inline_np[_HEADER:_HEADER + head] = view[:head]
        dist.broadcast(self._inline, src=self.src, group=self.group)
        if n > head:
            spill = self._spill_of(n - head)
            spill.numpy()[:] = view[head:]
            dist.broadcast(spill, src=self.src, group=self.group)

    def recv(self) -> bytes:
        """A leader: the next encoded plan from rank 0."""
        dist.broadcast(self._inline, src=self.src, group=self.group)
        n = int.from_bytes(self._inline_np[:_HEADER].tobytes(), "little")
        head = min(n, self.inline_cap)
        data = self._inline_np[_HEADER:_HEADER + head].tobytes()
        if n > head:
            spill = self._spill_of(n - head)
            dist.broadcast(spill, src=self.src, group=self.group)
            data += spill.numpy().tobytes()
        return data
