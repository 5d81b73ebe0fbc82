"""One-writer / N-reader broadcast channel over POSIX shared memory.

Rank 0 writes each step's encoded StepPlan once; every other rank on the
machine reads it. The segment is a ring of ``num_chunks`` chunks of
``chunk_bytes`` bytes; a message larger than a chunk travels as consecutive
pieces, so any size works (0 bytes up to many times the ring).

Segment layout (counters are aligned little-endian u64; every array starts on
its own 64-byte cache line, so no two readers write to the same line):

    header      magic | version | num_readers | chunk_bytes | num_chunks |
                creator_pid | ready | reserved                            (64 B)
    reader_pid  [num_readers]                pid of each attached reader
    write_seq   [num_chunks]                 piece number last published in chunk c
    read_seq    [num_readers][num_chunks]    piece number reader r last consumed in chunk c
    chunks      [num_chunks][chunk_bytes]    piece header (msg_len, offset, piece number,
                                             crc32) + payload

Pieces are numbered k = 1, 2, ...; piece k lives in chunk c = (k - 1) % num_chunks.
Writer: wait until every read_seq[r][c] >= k - num_chunks (the chunk's previous
piece was consumed), write header and payload, then publish write_seq[c] = k.
Reader: wait until write_seq[c] == k, copy the piece out and check it, then
release it with read_seq[r][c] = k.

Memory ordering relied on: x86-64 is TSO (stores become visible in program
order; loads are not reordered with older loads nor with later stores), so a
reader that sees write_seq[c] == k sees the payload, and a writer that sees
read_seq[r][c] == k knows the copy is done. A counter is one aligned 8-byte
store/load (a fixed-size memcpy in CPython's memoryview item access), hence never
torn, and CPython performs these steps in program order. Python has no fences,
so for weakly ordered CPUs (ARM) the piece header repeats k and carries a crc32
of header and payload: a reader that sees the counter before the data copies
again. Its release store depends on a branch on the copied bytes, and CPUs do
not expose a store before the branch it depends on resolves. On x86 the check
never fails and costs one crc32 per piece.

Lifetime: neither end registers the segment with multiprocessing's
resource_tracker. (In Python 3.11 a process that merely attaches registers it,
and its tracker unlinks it with a "leaked" warning when that process exits.)
The writer owns the segment: the runtime calls :meth:`ShmChannel.unlink` in
``finally`` and from signal handlers, and
:func:`rtp.distributed.shm_segment.cleanup_stale_segments` removes what a
killed run left (the creator pid is part of the name).
"""

from __future__ import annotations

import _posixshmem  # the primitive multiprocessing.shared_memory itself is built on
import mmap
import os
import struct
import time
import zlib
from collections.abc import Callable
from functools import partial
from types import TracebackType

from rtp.distributed.pids import pid_alive
from rtp.distributed.shm_segment import check_segment_name, map_segment
from rtp.errors import RtpError
from rtp.log import get_logger

logger = get_logger(__name__)

_MAGIC = 0x52_54_50_43_48_41_4E_31  # "RTPCHAN1"
_VERSION = 1
_LINE = 64  # cache line; every counter array starts on its own line
_HEADER = struct.Struct("<8Q")  # magic, version, num_readers, chunk_bytes, num_chunks, creator_pid, ready, reserved
_CREATOR_PID_SLOT = 5  # u64 index of the writer's pid
_READY_SLOT = 6  # u64 index of the "ready" flag, written last by create()
# Per-chunk header: total message length, offset of this piece in it, piece number k, then a crc32 of
# those three fields and the payload.
_PIECE_ID = struct.Struct("<QQQ")
_PIECE_CRC = struct.Struct("<I")
_PIECE = struct.Struct("<QQQI4x")
PIECE_HEADER_BYTES = _PIECE.size  # chunk_bytes must exceed this; the rest of a chunk is payload
_STALE_PIECE_LIMIT_S = 5.0  # a published piece that never checks out is corruption, not a slow CPU

# Waiting policy: spin (yielding the CPU) for a short while so a step that
# arrives soon is picked up within microseconds, then sleep with growing
# intervals so an idle rank costs ~1% of a core, not 100%.
_DEFAULT_SPIN_S = 0.002
_DEFAULT_MAX_SLEEP_S = 0.001
_MIN_SLEEP_S = 2e-5
_ABORT_CHECK_S = 0.02  # should_abort() is polled at least this often while waiting


class ChannelTimeout(RtpError, TimeoutError):
    """A channel read or write did not complete within its timeout."""


class ChannelAborted(RtpError):
    """A channel wait was interrupted because ``should_abort()`` returned True."""


def _round_up(n: int) -> int:
    return (n + _LINE - 1) // _LINE * _LINE


class _Layout:
    """Byte offsets of every region, derived from the three size parameters."""

    def __init__(self, num_readers: int, chunk_bytes: int, num_chunks: int) -> None:
        self.num_readers, self.chunk_bytes, self.num_chunks = num_readers, chunk_bytes, num_chunks
        self.reader_pid_off = _HEADER.size
        self.write_seq_off = self.reader_pid_off + _round_up(8 * num_readers)
        self.read_seq_stride = _round_up(8 * num_chunks)
        self.read_seq_off = self.write_seq_off + self.read_seq_stride
        self.data_off = self.read_seq_off + num_readers * self.read_seq_stride  # a multiple of 64
        self.total = self.data_off + num_chunks * chunk_bytes
        self.payload_cap = chunk_bytes - _PIECE.size

    def read_seq_slot(self, reader: int) -> int:
        """u64 index of read_seq[reader][0]."""
        return (self.read_seq_off + reader * self.read_seq_stride) // 8


def _check_int(what: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return value


class ShmChannel:
    """One end of a shared-memory broadcast channel: the writer (rank 0) or one reader."""

    def __init__(self, name: str, mm: mmap.mmap, layout: _Layout, reader_index: int | None) -> None:
        # Private: use create() or attach().
        self.name = name
        self.reader_index = reader_index  # None for the writer
        self._mmap = mm
        self._layout = layout
        self._buf = memoryview(mm)
        self._q = self._buf[: layout.data_off].cast("Q")  # every counter, as u64 slots
        self.spin_s = _DEFAULT_SPIN_S  # waiting: spin this long, then sleep up to max_sleep_s at a time
        self.max_sleep_s = _DEFAULT_MAX_SLEEP_S
        self._pid = os.getpid()
        self._closed = False
        self._unlinked = False
        self._broken = False  # a write was interrupted mid-message: readers hold a partial message
        self._ws = layout.write_seq_off // 8
        if reader_index is None:
            self._next_piece = 1
            self._rs = [layout.read_seq_slot(r) for r in range(layout.num_readers)]
        else:
            # Resume after the last piece this reader slot consumed (1 for a fresh channel).
            self._rs = [layout.read_seq_slot(reader_index)]
            base = self._rs[0]
            self._next_piece = max(self._q[base : base + layout.num_chunks]) + 1
        self._partial: bytearray | None = None  # message being reassembled from pieces
        self._received = 0

    # ------------------------------------------------------------------ setup

    @classmethod
    def create(cls, name: str, num_readers: int, chunk_bytes: int, num_chunks: int) -> ShmChannel:
        """Create the segment and return its writer end (rank 0). Fails if ``name`` exists."""
        check_segment_name(name)
        _check_int("num_readers", num_readers, 1)
        _check_int("num_chunks", num_chunks, 1)
        _check_int(f"chunk_bytes (the {_PIECE.size}-byte piece header plus at least 1 payload byte)",
                   chunk_bytes, _PIECE.size + 1)
        layout = _Layout(num_readers, chunk_bytes, num_chunks)
        # Zero-filled: every counter starts at 0.
        mm = map_segment(name, layout.total, create=True, what=f"channel {name!r}",
                         remedy="lower shm_chunk_bytes / shm_num_chunks or enlarge /dev/shm")
        _HEADER.pack_into(mm, 0, _MAGIC, _VERSION, num_readers, chunk_bytes, num_chunks, os.getpid(), 0, 0)
        chan = cls(name, mm, layout, None)
        chan._q[_READY_SLOT] = 1  # last: attach() only trusts the header once this is set
        logger.debug("created channel %s: %d readers, %d x %d B", name, num_readers, num_chunks, chunk_bytes)
        return chan

    @classmethod
    def attach(cls, name: str, reader_index: int, timeout: float = 30.0) -> ShmChannel:
        """Attach reader ``reader_index`` (rank - 1), waiting up to ``timeout`` s for the writer to create it."""
        check_segment_name(name)
        _check_int("reader_index", reader_index, 0)
        deadline = time.monotonic() + timeout
        while True:
            mm = _try_map(name)
            if mm is not None:
                break
            if time.monotonic() >= deadline:
                raise ChannelTimeout(f"channel {name!r} did not appear within {timeout} s")
            time.sleep(0.005)
        magic, version, num_readers, chunk_bytes, num_chunks, *_ = _HEADER.unpack_from(mm)
        if magic != _MAGIC or version != _VERSION:
            mm.close()
            raise RtpError(f"shared-memory segment {name!r} is not an rtp channel of version {_VERSION}")
        layout = _Layout(num_readers, chunk_bytes, num_chunks)
        if len(mm) < layout.total:
            mm.close()
            raise RtpError(f"shared-memory segment {name!r} is {len(mm)} bytes, its header needs {layout.total}")
        if reader_index >= num_readers:
            mm.close()
            raise ValueError(f"reader_index must be in [0, {num_readers}) for channel {name!r}, got {reader_index}")
        chan = cls(name, mm, layout, reader_index)
        chan._q[layout.reader_pid_off // 8 + reader_index] = os.getpid()
        return chan

    # ------------------------------------------------------------- messaging

    def write(self, data: bytes | bytearray | memoryview, timeout: float | None = None,
              should_abort: Callable[[], bool] | None = None) -> None:
        """Broadcast one message to every reader; blocks while the ring is full."""
        if self.reader_index is not None:
            raise RtpError("write() is only allowed on the writer end (ShmChannel.create)")
        self._check_open()
        if self._broken:
            raise RtpError(f"channel {self.name!r} is broken: an earlier write was interrupted mid-message")
        view = memoryview(data).cast("B") if isinstance(data, memoryview) else memoryview(data)
        lay, q, buf, total = self._layout, self._q, self._buf, len(view)
        deadline = None if timeout is None else time.monotonic() + timeout
        offset = 0
        while True:
            k = self._next_piece
            c = (k - 1) % lay.num_chunks
            prev = k - lay.num_chunks  # the piece this chunk held before; every reader must be past it
            if prev > 0 and not self._all_consumed(c, prev):
                try:
                    self._wait(partial(self._all_consumed, c, prev), deadline, should_abort, "write")
                except BaseException:  # timeout, abort, KeyboardInterrupt
                    self._broken = offset > 0  # readers already hold part of this message
                    raise
            base = lay.data_off + c * lay.chunk_bytes
            n = min(lay.payload_cap, total - offset)
            payload = view[offset : offset + n]
            crc = zlib.crc32(payload, zlib.crc32(_PIECE_ID.pack(total, offset, k)))
            _PIECE.pack_into(buf, base, total, offset, k, crc)
            buf[base + _PIECE.size : base + _PIECE.size + n] = payload
            q[self._ws + c] = k  # publish: written after the payload (see module docstring)
            self._next_piece = k + 1
            offset += n
            if offset >= total:
                return

    def read(self, timeout: float | None = None, should_abort: Callable[[], bool] | None = None) -> bytes:
        """Return the next message. A timeout or abort mid-message keeps the part received; the next read resumes."""
        if self.reader_index is None:
            raise RtpError("read() is only allowed on a reader end (ShmChannel.attach)")
        self._check_open()
        lay, q = self._layout, self._q
        rs = self._rs[0]
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            k = self._next_piece
            c = (k - 1) % lay.num_chunks
            if q[self._ws + c] != k:
                self._wait(partial(self._published, c, k), deadline, should_abort, "read")
            done = self._take_piece(k, lay.data_off + c * lay.chunk_bytes)
            q[rs + c] = k  # release: after the copy and its check (see module docstring)
            self._next_piece = k + 1
            if done is not None:
                return done

    def _take_piece(self, k: int, base: int) -> bytes | None:
        """Copy published piece ``k`` out of the chunk at ``base``; the message if it is now complete."""
        buf, cap = self._buf, self._layout.payload_cap
        first_try = time.monotonic()
        while True:
            ident = bytes(buf[base : base + _PIECE_ID.size])
            total, offset, piece = _PIECE_ID.unpack(ident)
            (crc,) = _PIECE_CRC.unpack_from(buf, base + _PIECE_ID.size)
            n = max(0, min(cap, total - offset))
            data = bytes(buf[base + _PIECE.size : base + _PIECE.size + n])
            if piece == k and zlib.crc32(data, zlib.crc32(ident)) == crc:
                break
            # The counter became visible before the data (weakly ordered CPU): copy again.
            if time.monotonic() - first_try > _STALE_PIECE_LIMIT_S:
                raise RtpError(f"channel {self.name!r}: piece {k} failed its checks (corrupted segment)")
            os.sched_yield()
        if self._partial is None:
            if offset != 0:
                raise RtpError(f"channel {self.name!r} out of sync: piece {k} starts mid-message")
            if n == total:  # common case: the whole message in one chunk
                return data
            self._partial, self._received = bytearray(total), 0
        if total != len(self._partial) or offset != self._received:
            raise RtpError(f"channel {self.name!r} out of sync: piece {k} is {offset}/{total}, "
                           f"expected {self._received}/{len(self._partial)}")
        self._partial[offset : offset + n] = data
        self._received += n
        if self._received < total:
            return None
        out, self._partial = bytes(self._partial), None
        return out

    def _published(self, chunk: int, piece: int) -> bool:
        return self._q[self._ws + chunk] == piece

    def _all_consumed(self, chunk: int, piece: int) -> bool:
        q = self._q
        return all(q[r + chunk] >= piece for r in self._rs)

    def _wait(self, ready: Callable[[], bool], deadline: float | None,
              should_abort: Callable[[], bool] | None, what: str) -> None:
        """Spin briefly, then sleep with growing intervals, until ``ready()``, the deadline or an abort."""
        start = time.monotonic()
        spin_until = start + self.spin_s
        next_abort_check = start + _ABORT_CHECK_S
        sleep = _MIN_SLEEP_S
        while not ready():
            now = time.monotonic()
            if should_abort is not None and now >= next_abort_check:
                if should_abort():
                    raise ChannelAborted(f"{what} on channel {self.name!r} aborted while waiting")
                next_abort_check = now + _ABORT_CHECK_S
            if deadline is not None and now >= deadline:
                raise ChannelTimeout(f"{what} on channel {self.name!r} timed out")
            if now < spin_until:
                os.sched_yield()
            else:
                time.sleep(sleep)
                sleep = min(sleep * 2, self.max_sleep_s)

    # ------------------------------------------------------------- liveness

    @property
    def creator_pid(self) -> int:
        """pid of the process that created the segment (the writer)."""
        self._check_open()
        return int(self._q[_CREATOR_PID_SLOT])

    def peers_alive(self) -> bool:
        """Writer end: every attached reader process exists. Reader end: the writer process exists.

        A cheap building block for ``should_abort``; meaningful only when all
        ranks share one pid namespace (one machine, which shared memory needs).
        """
        self._check_open()
        if self.reader_index is not None:
            return pid_alive(self.creator_pid)
        off = self._layout.reader_pid_off // 8
        pids = self._q[off : off + self._layout.num_readers].tolist()
        return all(pid == 0 or pid_alive(pid) for pid in pids)

    def wait_for_readers(self, timeout: float) -> None:
        """Writer end: return once every reader has attached (ChannelTimeout after ``timeout`` s). Before
        :meth:`unlink`: a reader that has not attached yet could not find the segment, nor the SHUTDOWN in it."""
        off = self._layout.reader_pid_off // 8
        self._wait(lambda: all(self._q[off : off + self._layout.num_readers].tolist()), time.monotonic() + timeout,
                   None, "waiting for the readers to attach")

    # ------------------------------------------------------------- teardown

    def _check_open(self) -> None:
        if self._closed:
            raise RtpError(f"channel {self.name!r} is closed")

    def close(self) -> None:
        """Unmap the segment. Idempotent and lock-free, so it is safe on a signal-handler path."""
        if self._closed:
            return
        self._closed = True
        try:
            self._q.release()
            self._buf.release()
            self._mmap.close()
        except BufferError:
            # A view is still in use (e.g. we interrupted a copy); the mapping goes away with the process.
            pass

    def unlink(self) -> None:
        """Writer only: remove the segment name. Idempotent; ignores a segment that is already gone.

        Readers keep their mapping until they close. Only the creating process
        unlinks: a forked child that inherited this object (and perhaps the
        runtime's exit handlers) leaves the segment alone. Lock-free and
        log-free, so it is safe on a signal-handler path.
        """
        if self.reader_index is not None:
            raise RtpError("unlink() is only allowed on the writer end; readers call close()")
        if self._unlinked or os.getpid() != self._pid:
            return
        self._unlinked = True
        try:
            _posixshmem.shm_unlink("/" + self.name)
        except FileNotFoundError:
            pass

    def __enter__(self) -> ShmChannel:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
        if self.reader_index is None:
            self.unlink()

    def __repr__(self) -> str:
        role = "writer" if self.reader_index is None else f"reader {self.reader_index}"
        lay = self._layout
        return f"ShmChannel({self.name!r}, {role}, {lay.num_readers} readers, {lay.num_chunks} x {lay.chunk_bytes} B)"


def _try_map(name: str) -> mmap.mmap | None:
    """Map an existing, fully initialised channel segment, or return None if it is not there yet."""
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size < _HEADER.size:  # created but not yet sized
            return None
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    if struct.unpack_from("<Q", mm, 8 * _READY_SLOT)[0] != 1:
        mm.close()
        return None
    return mm
