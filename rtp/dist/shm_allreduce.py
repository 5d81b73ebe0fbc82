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
name as soon as all have mapped it; the mappings live on until the processes
exit, so a crash can never leave the segment behind. Waits check the peers'
pids and a timeout, so a dead or stuck peer becomes an error, not a hang.
"""

from __future__ import annotations

import mmap
import os
import platform
import time

import _posixshmem
import numpy as np
import torch

from rtp.dist.liveness import pid_alive
from rtp.dist.shm_channel import make_channel_name
from rtp.errors import RtpError, WorkerDiedError

_LINE = 64
DEFAULT_SLOT_BYTES = 1 << 20
_SPIN_ITERS = 2000  # busy checks before yielding the core (ranks may outnumber cores)
_CHECK_S = 0.05  # peers' pids and the deadline are checked this often while waiting


def supported() -> bool:
    """True on x86-64, whose store ordering the protocol relies on."""
    return platform.machine().lower() in ("x86_64", "amd64")


class ShmAllReduce:
    """Node-local collectives of one rank over a shared segment (see the module docstring)."""

    def __init__(self, mm: mmap.mmap, rank: int, world_size: int, slot_bytes: int, peer_pids: dict[int, int],
                 timeout_s: float) -> None:
        # Private: use create_and_attach().
        self.rank, self.world_size, self.slot_bytes = rank, world_size, slot_bytes
        self.peer_pids, self.timeout_s = peer_pids, timeout_s
        self._mm = mm
        header = _LINE * world_size
        # posted[r] is u64 number r * 8 of the header: one cache line per rank.
        self._posted = np.frombuffer(mm, dtype=np.int64, count=header // 8)[:: _LINE // 8]
        raw = torch.frombuffer(mm, dtype=torch.uint8, offset=header, count=2 * world_size * slot_bytes)
        self._slots = raw.view(2, world_size, slot_bytes)  # [buffer, rank, bytes]
        self._typed: dict[torch.dtype, torch.Tensor] = {}
        self._op = int(self._posted[rank])

    @staticmethod
    def segment_bytes(world_size: int, slot_bytes: int) -> int:
        return _LINE * world_size + 2 * world_size * slot_bytes

    # ------------------------------------------------------------ collectives

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the node's ranks, in place; returns ``x``."""
        flat = x.view(-1) if x.is_contiguous() else x.contiguous().view(-1)
        slots = self._typed_slots(x.dtype)  # [2, world, slot_elems]
        step = slots.shape[-1]
        for start in range(0, flat.numel(), step):
            piece = flat[start : start + step]
            n = piece.numel()
            op = self._post(piece, slots)
            self._wait_all(op)
            parts = slots[op % 2, :, :n]  # [world, n]
            torch.add(parts[0], parts[1], out=piece)
            for r in range(2, self.world_size):
                piece.add_(parts[r])
        if flat.data_ptr() != x.data_ptr():
            x.copy_(flat.view_as(x))
        return x

    def gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Concatenate every rank's ``x`` (same shape everywhere) along ``dim`` on rank 0; None elsewhere."""
        flat = x.contiguous().view(-1)
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

    # ------------------------------------------------------------ internals

    def _typed_slots(self, dtype: torch.dtype) -> torch.Tensor:
        view = self._typed.get(dtype)
        if view is None:
            elem = torch.empty(0, dtype=dtype).element_size()
            view = self._slots[..., : self.slot_bytes // elem * elem].view(dtype)
            self._typed[dtype] = view
        return view

    def _post(self, piece: torch.Tensor, slots: torch.Tensor) -> int:
        """Copy ``piece`` into this rank's slot of the next op and publish it; returns the op number."""
        op = self._op = self._op + 1
        self._wait_all(op - 1)  # buffer op % 2 is free once everyone left op - 2
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
        while int(posted.min()) < op:
            os.sched_yield()
            now = time.monotonic()
            if now >= next_check:
                next_check = now + _CHECK_S
                self._check_peers(op, now >= deadline)

    def _check_peers(self, op: int, timed_out: bool) -> None:
        late = [r for r in range(self.world_size) if int(self._posted[r]) < op]
        for r in late:
            pid = self.peer_pids.get(r)
            if pid is not None and not pid_alive(pid):
                raise WorkerDiedError(f"rank {r} (pid {pid}) died during a collective")
        if timed_out:
            raise RtpError(f"ranks {late} did not reach collective {op} within {self.timeout_s:.0f} s")

    def close(self) -> None:
        """Unmap the segment (the name was unlinked at setup)."""
        self._typed.clear()
        self._slots = self._posted = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with the process


def _map(name: str, size: int, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = _posixshmem.shm_open("/" + name, flags, mode=0o600)
    try:
        if create:
            os.ftruncate(fd, size)
            try:  # reserve the pages now: a full /dev/shm must fail here, not SIGBUS later
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                raise RtpError(f"cannot reserve {size} bytes of shared memory for the CPU all-reduce "
                               f"({e.strerror}); enlarge /dev/shm") from None
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def create_and_attach(ps, pids: list[int], timeout_s: float,  # noqa: ANN001 - a ParallelState
                      slot_bytes: int = DEFAULT_SLOT_BYTES) -> ShmAllReduce:
    """Collective over ``ps.cpu_group``: set up the node's segment on every rank and return this rank's end.

    ``pids[r]`` is rank r's pid (all ranks on this node). The name is unlinked
    before this returns on any rank, so nothing can leak.
    """
    size = ShmAllReduce.segment_bytes(ps.world_size, slot_bytes)
    name = None
    if ps.rank == 0:
        name = make_channel_name()
        try:
            mm = _map(name, size, create=True)
        except BaseException:
            ps.broadcast_object("")
            raise
    name = ps.broadcast_object(name)
    if not name:
        raise RtpError("rank 0 could not create the CPU all-reduce segment")
    if ps.rank != 0:
        mm = _map(name, size, create=False)
    try:
        ps.barrier()  # every rank has mapped it
    finally:
        if ps.rank == 0:
            try:
                _posixshmem.shm_unlink("/" + name)
            except FileNotFoundError:
                pass
    peers = {r: pid for r, pid in enumerate(pids) if r != ps.rank}
    return ShmAllReduce(mm, ps.rank, ps.world_size, slot_bytes, peers, timeout_s)
