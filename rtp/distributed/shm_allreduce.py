"""All-reduce and gather of CPU tensors between the ranks of one node, through shared memory.

Tensor parallelism on CPU runs two all-reduces per layer. Over gloo each one is
a round trip through the loopback TCP stack (tens of microseconds plus copies),
which made TP=2 slower than TP=1. Here every rank copies its tensor into its own
slot of a shared segment, announces it with a counter, waits for the others'
counters and sums the slots itself: one copy in, one pass over N slots out.

Segment layout (u64 counters, each on its own 64-byte cache line, then the slots):

    posted  [world]                      op number rank r last published
    slots   [2][world][slot_bytes]       double-buffered: op k uses buffer k % 2

Protocol for op k (every rank runs the same sequence of ops):
  1. wait until every rank posted >= k - 1: whoever read buffer k % 2 during op
     k - 2 has finished with it (a rank posts k - 1 only after leaving op k - 2);
  2. copy this rank's piece into slots[k % 2][rank], then post k;
  3. all-reduce: wait until every rank posted >= k, then sum the slots in rank
     order (every rank adds the same numbers in the same order, so all ranks hold
     bit-identical results); gather: only the root waits and reads.
Tensors larger than a slot travel as several ops, one slot-sized piece each.

Memory ordering: x86-64 is TSO, so a counter seen by a peer implies the slot
data written before it is visible. Slots are small (1 MiB by default), so the
copies use ordinary stores, not non-temporal ones. A weakly ordered CPU (ARM)
would need fences that Python cannot issue: there, :func:`supported` says no and
gloo is used.

Lifetime: rank 0 creates the segment, every rank maps it, and rank 0 unlinks the
name as soon as all have mapped it (:func:`rtp.distributed.node_segment.share_segment`);
the mappings live on until the processes exit, so a crash can never leave the
segment behind.

Fast path: where rtp's C++ kernels build, one call does a piece's copy, post,
wait and sum (:mod:`rtp.kernels.cpu_allreduce`, the same steps in the same
order), spinning for a bounded time; a longer wait comes back to Python.

Waiting: a wait that outlasts the spin phase checks, every 50 ms, the late
peers' pids (a dead peer), their heartbeats (a stopped or hung peer, within
``liveness_timeout_s``), ``should_abort`` (the runtime failed for another
reason, e.g. a stuck step) and a last-resort timeout, so a lost peer becomes
an error naming it, not a hang. While it waits it marks this rank as waiting
in its heartbeat slot, so a stuck-step report can tell the rank that holds a
step up from the ranks that wait for it.
"""

from __future__ import annotations

import mmap
import os
import platform
import time
from collections.abc import Callable
from types import ModuleType

import numpy as np
import torch

from rtp.distributed.heartbeat import Heartbeat
from rtp.distributed.liveness import died_message, hung_message
from rtp.distributed.node_segment import share_segment
from rtp.distributed.pids import pid_alive
from rtp.errors import RtpError, WorkerDiedError
from rtp.kernels import cpu_allreduce

_LINE = 64
DEFAULT_SLOT_BYTES = 1 << 20
_SPIN_ITERS = 2000  # busy checks before yielding the core (ranks may outnumber cores)
_CHECK_S = 0.05  # peers' pids and the deadline are checked this often while waiting
_KERNEL_SPINS = 20_000  # pauses (~1 ms) the C++ path waits for a peer before Python's checked wait takes over


def supported() -> bool:
    """True on x86-64, whose store ordering the protocol relies on."""
    return platform.machine().lower() in ("x86_64", "amd64")


class ShmAllReduce:
    """Node-local collectives of one rank over a shared segment (see the module docstring)."""

    def __init__(self, mm: mmap.mmap, rank: int, world_size: int, slot_bytes: int, peer_pids: dict[int, int],
                 timeout_s: float, heartbeat: Heartbeat | None = None,
                 should_abort: Callable[[], str | None] | None = None) -> None:
        # Private: use create_and_attach().
        self.rank, self.world_size, self.slot_bytes = rank, world_size, slot_bytes
        self.peer_pids, self.timeout_s = peer_pids, timeout_s
        self.heartbeat = heartbeat
        self.rank_offset = 0  # global rank of this group's rank 0 (a data-parallel replica's coordinator)
        self.should_abort = should_abort  # returns why the run failed, or None while it is healthy
        self._mm = mm
        self.kernel: ModuleType | None = None  # the C++ piece (cpu_allreduce), set by create_and_attach where it builds
        self._segment = torch.frombuffer(mm, dtype=torch.uint8, count=self.segment_bytes(world_size, slot_bytes))
        header = _LINE * world_size
        # posted[r] is u64 number r * 8 of the header: one cache line per rank.
        self._posted = np.frombuffer(mm, dtype=np.int64, count=header // 8)[:: _LINE // 8]
        self._slots = self._segment[header:].view(2, world_size, slot_bytes)  # [buffer, rank, bytes]
        self._typed: dict[torch.dtype, torch.Tensor] = {}
        self._op = int(self._posted[rank])

    @staticmethod
    def segment_bytes(world_size: int, slot_bytes: int) -> int:
        return _LINE * world_size + 2 * world_size * slot_bytes

    # ------------------------------------------------------------ collectives

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the node's ranks, in place; returns ``x``."""
        flat = x.view(-1) if x.is_contiguous() else x.contiguous().view(-1)
        step = self.slot_bytes // x.element_size()  # elements a piece (a slot) holds
        kernel = self.kernel if x.dtype in cpu_allreduce.DTYPES else None
        if kernel is not None:
            for start in range(0, flat.numel(), step):
                self._reduce_piece(kernel, flat, start, min(step, flat.numel() - start))
        else:
            slots = self._typed_slots(x.dtype)  # [2, world, step]
            for start in range(0, flat.numel(), step):
                piece = flat[start : start + step]
                op = self._post(piece, slots)
                self._wait_all(op)
                parts = slots[op % 2, :, : piece.numel()]  # [world, n]
                torch.add(parts[0], parts[1], out=piece)
                for r in range(2, self.world_size):
                    piece.add_(parts[r])
        if flat.data_ptr() != x.data_ptr():
            x.copy_(flat.view_as(x))
        return x

    def gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Concatenate every rank's ``x`` (same shape everywhere) along ``dim`` on rank 0; None elsewhere."""
        x = x.contiguous()
        if x.dim() == 2 and dim in (-1, 1) and x.shape[1] and self.slot_bytes >= x.shape[1] * x.element_size():
            return self._gather_columns(x)
        flat = x.view(-1)
        slots = self._typed_slots(x.dtype)
        step = slots.shape[-1]
        out = [torch.empty_like(flat) for _ in range(self.world_size)] if self.rank == 0 else None
        for start in range(0, flat.numel(), step):
            piece = flat[start : start + step]
            op = self._post(piece, slots)
            if out is not None:
                self._wait_all(op)
                for r in range(self.world_size):
                    out[r][start : start + piece.numel()].copy_(slots[op % 2, r, : piece.numel()])
        if out is None:
            return None
        return torch.cat([o.view_as(x) for o in out], dim=dim)

    def _gather_columns(self, x: torch.Tensor) -> torch.Tensor | None:
        """:meth:`gather` of ``x [rows, cols]`` along its columns (the logits' vocabulary shards), in pieces of
        whole rows: rank 0 copies its own rows straight into the result (it posts no data, only the
        counter) and each peer's piece from the slot into that rank's columns; one copy per element."""
        rows, cols = x.shape
        per_piece = self.slot_bytes // (cols * x.element_size())  # rows a slot holds (every rank agrees)
        slots = self._typed_slots(x.dtype)
        out = None
        if self.rank == 0:
            out = torch.empty(rows, self.world_size * cols, dtype=x.dtype)
            out[:, :cols].copy_(x)
        for first in range(0, rows, per_piece):
            block = x[first : first + per_piece]  # [r, cols], contiguous
            if out is None:
                self._post(block.view(-1), slots)
                continue
            op = self._post(None, slots)
            self._wait_all(op)
            n, last = block.numel(), first + block.shape[0]
            for r in range(1, self.world_size):
                out[first:last, r * cols : (r + 1) * cols].copy_(slots[op % 2, r, :n].view(-1, cols))
        return out

    # ------------------------------------------------------------ internals

    def _typed_slots(self, dtype: torch.dtype) -> torch.Tensor:
        view = self._typed.get(dtype)
        if view is None:
            elem = dtype.itemsize
            view = self._slots[..., : self.slot_bytes // elem * elem].view(dtype)
            self._typed[dtype] = view
        return view

    def _reduce_piece(self, kernel: ModuleType, flat: torch.Tensor, start: int, n: int) -> None:
        """The same steps as the torch path, in C++; a peer later than the kernel's spin is waited for here."""
        op = self._op = self._op + 1
        stage = cpu_allreduce.WAIT_FREE
        while (stage := kernel.all_reduce_piece(flat, start, n, self._segment, self.rank, self.world_size,
                                                self.slot_bytes, op, stage, _KERNEL_SPINS)) != cpu_allreduce.DONE:
            self._wait_all(op - 1 if stage == cpu_allreduce.WAIT_FREE else op)

    def _post(self, piece: torch.Tensor | None, slots: torch.Tensor) -> int:
        """Copy ``piece`` (None: no data, the counter alone) into this rank's slot of the next op and publish
        it; returns the op number."""
        op = self._op = self._op + 1
        self._wait_all(op - 1)  # buffer op % 2 is free once everyone left op - 2
        if piece is not None:
            slots[op % 2, self.rank, : piece.numel()].copy_(piece)
        self._posted[self.rank] = op  # after the copy (see the module docstring)
        return op

    def _wait_all(self, op: int) -> None:
        posted = self._posted
        if int(posted.min()) >= op:
            return
        for _ in range(_SPIN_ITERS):
            if int(posted.min()) >= op:
                return
        deadline = time.monotonic() + self.timeout_s
        next_check = 0.0
        hb = self.heartbeat
        if hb is not None:
            hb.set_waiting(True)
        try:
            while int(posted.min()) < op:
                os.sched_yield()
                now = time.monotonic()
                if now >= next_check:
                    next_check = now + _CHECK_S
                    self._check_peers(op, now >= deadline)
        finally:
            if hb is not None:
                hb.set_waiting(False)

    def _check_peers(self, op: int, timed_out: bool) -> None:
        late = [r for r in range(self.world_size) if int(self._posted[r]) < op]
        for r in late:
            pid = self.peer_pids.get(r)
            if pid is not None and not pid_alive(pid):
                raise WorkerDiedError(died_message(r + self.rank_offset, pid) + " during a collective")
        if self.heartbeat is not None:  # its slots are indexed by global rank
            silent = self.heartbeat.silent_peer([r + self.rank_offset for r in late])
            if silent is not None:
                r, age = silent
                raise WorkerDiedError(hung_message(r, self.peer_pids.get(r - self.rank_offset, -1), age))
        reason = self.should_abort() if self.should_abort is not None else None
        if reason:
            raise RtpError(f"collective {op} aborted: {reason}")
        if timed_out:
            raise RtpError(f"ranks {late} did not reach collective {op} within {self.timeout_s:.0f} s")

    def close(self) -> None:
        """Unmap the segment (the name was unlinked at setup)."""
        self._typed.clear()
        self._slots = self._posted = self._segment = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with the process


def create_and_attach(ps, pids: list[int], timeout_s: float,  # noqa: ANN001 - a ParallelState
                      slot_bytes: int = DEFAULT_SLOT_BYTES, heartbeat: Heartbeat | None = None,
                      should_abort: Callable[[], str | None] | None = None) -> ShmAllReduce:
    """Collective over ``ps.cpu_group``: set up the node's segment on every rank and return this rank's end.

    ``pids[r]`` is rank r's pid (all ranks on this node). The name is unlinked
    before this returns on any rank, so nothing can leak. ``heartbeat`` and
    ``should_abort`` make waits fail fast on a hung peer or a failed run.
    """
    size = ShmAllReduce.segment_bytes(ps.world_size, slot_bytes)
    mm = share_segment(ps, size, "CPU all-reduce")
    peers = {r: pid for r, pid in enumerate(pids) if r != ps.rank}
    reduce = ShmAllReduce(mm, ps.rank, ps.world_size, slot_bytes, peers, timeout_s, heartbeat, should_abort)
    reduce.kernel = cpu_allreduce.load()
    if ps.global_rank is not None:  # a data-parallel replica: its rank r is global rank r + offset
        reduce.rank_offset = ps.global_rank - ps.rank
    return reduce
