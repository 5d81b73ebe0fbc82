"""Heartbeats: every rank proves, from a thread of its own, that its process is still running.

A pid check tells a dead process from a live one, but not a live process that
no longer runs: one stopped by SIGSTOP, swapped out, or stuck in a driver
call. Each rank therefore runs a heartbeat thread that bumps a counter and
stamps ``CLOCK_MONOTONIC`` into its slot of a small shared region every
``interval_s``. A stopped process stops all its threads, so its stamp ages;
a long step (a big prefill, a Triton compile, CUDA graph capture) does not
stop the thread, so its stamp stays fresh. The watchdog
(:mod:`rtp.distributed.liveness`) declares a rank lost when its stamp is older than
``timeout_s`` (the config's ``liveness_timeout_s``).

The thread needs the GIL for a few microseconds per beat. A C call that holds
the GIL for longer than ``timeout_s`` silences it like a hung process would;
torch's ops release the GIL, and ``liveness_timeout_s`` is sized to leave
room for the rest (30 s in the GPU configs).

The region also carries what the stuck-step check needs: the number of the
last step each rank started and finished, whether it is blocked waiting for
its peers in a collective, and a stack-dump request that rank 0 raises and
every rank's heartbeat thread answers (see :meth:`Heartbeat.request_dump`), and, with several nodes, a node's
request that the run stop (its ranks got SIGTERM from their own torchrun, not rank 0: see
:meth:`Heartbeat.request_stop`).

Layout: signed 64-bit words, one 64-byte cache line for the header and one per
rank, so no two ranks ever write the same line::

    header      magic | world_size | dump_seq | dump_step | stop_node | unused x3
    slot[r]     pid | beats | beat_ns | step_started | step_done | step_started_ns | waiting | dump_ack

Each slot is written by its own rank only (another node's rank: by this
node's relay); the header by the node's leader (rank 0 on one node). Every
word is one aligned 8-byte store or load, so a reader never sees it torn.
Slots are indexed by global rank. With several nodes each node has a region
of its own (nodes share no memory) that still holds a slot for every rank:
on each node the leader runs a :class:`HeartbeatRelay`, which publishes its
node's slots to the rendezvous ``TCPStore`` and copies the other nodes' into
its region, stamping ``beat_ns`` with this node's clock whenever a remote
beat count changes (clocks of different machines are never compared). The
watchdog reads one region whatever the topology: a lost node is a set of
slots that stopped beating.

Lifetime: the region is shared through :func:`rtp.distributed.node_segment.share_segment`,
which unlinks its name before the run starts, so it can never leak.
"""

from __future__ import annotations

import faulthandler
import mmap
import os
import sys
import threading
import time

from rtp.distributed.node_segment import share_segment
from rtp.log import get_logger

logger = get_logger(__name__)

_WORDS = 8  # 64-bit words per cache line
_MAGIC = 0x52_54_50_48_42_45_41_54  # "RTPHBEAT"
# header words
_H_MAGIC, _H_WORLD, _H_DUMP_SEQ, _H_DUMP_STEP, _H_STOP_NODE = 0, 1, 2, 3, 4
# slot words
_PID, _BEATS, _BEAT_NS, _STARTED, _DONE, _STARTED_NS, _WAITING, _DUMP_ACK = range(8)


def interval_for(timeout_s: float) -> float:
    """A beat interval for ``timeout_s``: ten beats per timeout, between 20 ms and 1 s."""
    return min(1.0, max(0.02, timeout_s / 10.0))


class Heartbeat:
    """One rank's end of the heartbeat region: its own slot to write, every slot to read."""

    def __init__(self, mm: mmap.mmap, rank: int, world_size: int, interval_s: float, timeout_s: float,
                 creator: bool | None = None) -> None:
        # Private: use shared() or private(). ``creator`` (default: rank 0) writes the header.
        self.rank, self.world_size = rank, world_size
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self._q = memoryview(mm).cast("q")  # every word, as int64; the view keeps the mapping alive
        self._slot = _WORDS * (1 + rank)  # index of this rank's first word
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if creator if creator is not None else rank == 0:
            self._q[_H_WORLD] = world_size
            self._q[_H_MAGIC] = _MAGIC
        self._q[self._slot + _PID] = os.getpid()
        self.beat()  # before any peer can look: shared() meets the others at a barrier after this

    @staticmethod
    def region_bytes(world_size: int) -> int:
        return 8 * _WORDS * (1 + world_size)

    @classmethod
    def shared(cls, ps, interval_s: float, timeout_s: float) -> Heartbeat:  # noqa: ANN001 - a ParallelState
        """Collective over ``ps.cpu_group``: map the node's region on every rank and return this rank's end."""
        mm = share_segment(ps, cls.region_bytes(ps.world_size), "heartbeat region")
        leader = ps.rank == ps.node_leader
        heartbeat = cls(mm, ps.rank, ps.world_size, interval_s, timeout_s, leader)  # stamps this rank's first beat
        if leader and ps.num_nodes > 1:  # other nodes' slots: fresh until their relay says otherwise
            local = set(ps.local_ranks)
            for r in range(ps.world_size):
                if r not in local:
                    heartbeat._q[_WORDS * (1 + r) + _BEAT_NS] = time.monotonic_ns()
        ps.barrier()  # every slot holds a beat before any watchdog can read it (an empty slot reads as hours old)
        return heartbeat

    @classmethod
    def private(cls, interval_s: float, timeout_s: float) -> Heartbeat:
        """A world of one rank: an anonymous region (step tracking and stack dumps still work)."""
        return cls(mmap.mmap(-1, cls.region_bytes(1)), 0, 1, interval_s, timeout_s)

    # ------------------------------------------------------------ the thread

    def start(self) -> Heartbeat:
        """Start beating every ``interval_s`` on a daemon thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rtp-heartbeat", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating (a clean shutdown: peers stop watching first). Idempotent.

        The region stays mapped as long as this object lives: after a failure a
        thread stuck in a collective may still read it.
        """
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.beat()
            seq = self._q[_H_DUMP_SEQ]
            if seq > self._q[self._slot + _DUMP_ACK]:
                self.dump_stacks(f"rank 0 asked for them: step {self._q[_H_DUMP_STEP]} is stuck")
                self._q[self._slot + _DUMP_ACK] = seq

    def beat(self) -> None:
        q, s = self._q, self._slot
        q[s + _BEAT_NS] = time.monotonic_ns()
        q[s + _BEATS] += 1

    # ------------------------------------------------------------ this rank's progress

    def start_step(self) -> int:
        """Record that this rank starts its next step; returns the step's number (1, 2, ...)."""
        q, s = self._q, self._slot
        k = q[s + _STARTED] + 1
        q[s + _STARTED_NS] = time.monotonic_ns()  # before the number: whoever sees k sees its start time
        q[s + _STARTED] = k
        return k

    def finish_step(self) -> None:
        """Record that this rank finished the step it started last."""
        self._q[self._slot + _DONE] = self._q[self._slot + _STARTED]

    def set_waiting(self, waiting: bool) -> None:
        """Mark this rank as blocked on its peers in a collective (True) or working (False)."""
        self._q[self._slot + _WAITING] = int(waiting)

    # ------------------------------------------------------------ reading any slot

    def pid(self, rank: int) -> int:
        return self._q[_WORDS * (1 + rank) + _PID]

    def beats(self, rank: int) -> int:
        return self._q[_WORDS * (1 + rank) + _BEATS]

    def age_s(self, rank: int) -> float:
        """Seconds since ``rank``'s last beat."""
        return (time.monotonic_ns() - self._q[_WORDS * (1 + rank) + _BEAT_NS]) / 1e9

    def silent_peer(self, ranks: list[int]) -> tuple[int, float] | None:
        """The first of ``ranks`` whose last beat is older than ``timeout_s``, with its age; None if all beat.

        If this rank's own beat is stale too, this process (or the whole
        machine) was not running: the peers' silence says nothing, so nobody
        is judged until this rank has beaten again.
        """
        if self.age_s(self.rank) > self.timeout_s / 2:
            return None
        for r in ranks:
            age = self.age_s(r)
            if age > self.timeout_s:
                return r, age
        return None

    def step_state(self, rank: int) -> tuple[int, int, float]:
        """``rank``'s (last step started, last step finished, seconds since it started the last one)."""
        base = _WORDS * (1 + rank)
        # The number first, then its start time: start_step() writes them in the opposite order, so the
        # time read is that step's or a later one's, never an earlier step's (which after an idle
        # minute would make a step that just began look minutes old).
        started = self._q[base + _STARTED]
        done = self._q[base + _DONE]
        started_ns = self._q[base + _STARTED_NS]
        return started, done, (time.monotonic_ns() - started_ns) / 1e9

    def waiting(self, rank: int) -> bool:
        return bool(self._q[_WORDS * (1 + rank) + _WAITING])

    # ------------------------------------------------------------ a stop asked by another node

    def request_stop(self, node: int) -> None:
        """A rank of ``node`` (not rank 0's) got SIGTERM: ask rank 0, through the relays, to stop the run as
        if it had got it (its own torchrun did not)."""
        self._q[_H_STOP_NODE] = node + 1

    def stop_requested(self) -> int | None:
        """The node that asked the run to stop (:meth:`request_stop`), or None."""
        node = self._q[_H_STOP_NODE]
        return node - 1 if node else None

    # ------------------------------------------------------------ stack dumps

    def request_dump(self, step: int) -> int:
        """Rank 0: ask every rank's heartbeat thread (its own included) to dump its Python stacks.

        Returns the request number; :meth:`dumped` tells who answered. The
        heartbeat threads do the dumping because they run whatever the main
        thread is stuck in.
        """
        seq = self._q[_H_DUMP_SEQ] + 1
        self._q[_H_DUMP_STEP] = step
        self._q[_H_DUMP_SEQ] = seq  # last: a thread that sees seq sees the step
        return seq

    def dumped(self, seq: int) -> list[int]:
        """Ranks that answered dump request ``seq``."""
        return [r for r in range(self.world_size) if self._q[_WORDS * (1 + r) + _DUMP_ACK] >= seq]

    def dump_stacks(self, why: str) -> None:
        """Write every thread's Python stack of this process to stderr (faulthandler: no locks, no allocation)."""
        logger.error("rank %d (pid %d): Python stacks follow (%s)", self.rank, os.getpid(), why)
        try:
            sys.stderr.flush()
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        except (AttributeError, ValueError, OSError):  # stderr replaced by an object without a file descriptor
            if sys.__stderr__ is not None:
                faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)


# Slot words a relay carries to the other nodes, and the header words node 0 hands on (dump requests).
_RELAYED = (_PID, _BEATS, _STARTED, _DONE, _WAITING, _DUMP_ACK)
_RELAYED_HEADER = (_H_DUMP_SEQ, _H_DUMP_STEP)


class HeartbeatRelay:
    """A node leader's thread that carries heartbeats between nodes through the rendezvous store.

    Every ``interval_s`` it writes its node's slots (the words in ``_RELAYED``)
    under its own key and reads the other nodes' keys: a remote slot whose beat
    count changed gets ``beat_ns`` = now on this node's clock. If a node is lost,
    or the store itself (it lives on node 0's torchrun agent), the remote beats
    stop changing and the watchdog sees those ranks' stamps age past
    ``timeout_s``: no call here needs to succeed for a loss to be detected.
    Node 0 also hands rank 0's stack-dump requests on to the other nodes.
    """

    def __init__(self, heartbeat: Heartbeat, store, prefix: str,  # noqa: ANN001 - a torch.distributed Store
                 node: int, ranks_by_node: list[list[int]]) -> None:
        self.hb, self.store, self.node = heartbeat, store, node
        self.ranks_by_node = ranks_by_node
        self._keys = [f"{prefix}{n}" for n in range(len(ranks_by_node))]
        self._others = [n for n in range(len(ranks_by_node)) if n != node]
        self._thread: threading.Thread | None = None
        self.publish()  # before any peer reads (the runtime meets the other nodes at a barrier after this)

    def start(self) -> HeartbeatRelay:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rtp-heartbeat-relay", daemon=True)
            self._thread.start()
        return self

    def publish(self) -> None:
        q = self.hb._q
        words = [q[_WORDS * (1 + r) + w] for r in self.ranks_by_node[self.node] for w in _RELAYED]
        if self.node == 0:
            words += [q[w] for w in _RELAYED_HEADER]
        words.append(q[_H_STOP_NODE])  # every node's, last
        self.store.set(self._keys[self.node], ",".join(map(str, words)))

    def pull(self) -> None:
        q = self.hb._q
        values = self.store.multi_get([self._keys[n] for n in self._others])
        now = time.monotonic_ns()
        for n, raw in zip(self._others, values):
            words = [int(x) for x in raw.decode().split(",")]
            for i, r in enumerate(self.ranks_by_node[n]):
                base = _WORDS * (1 + r)
                slot = words[i * len(_RELAYED): (i + 1) * len(_RELAYED)]
                if slot[1] != q[base + _BEATS]:
                    q[base + _BEAT_NS] = now
                if slot[2] != q[base + _STARTED]:
                    q[base + _STARTED_NS] = now
                for w, v in zip(_RELAYED, slot):
                    q[base + w] = v
            if words[-1] and not q[_H_STOP_NODE]:
                q[_H_STOP_NODE] = words[-1]
            if n == 0:
                seq, step = words[-3:-1]
                if seq > q[_H_DUMP_SEQ]:
                    q[_H_DUMP_STEP] = step
                    q[_H_DUMP_SEQ] = seq

    def _run(self) -> None:
        while not self.hb._stop.wait(self.hb.interval_s):
            try:
                self.publish()
                self.pull()
            except Exception as e:  # noqa: BLE001 - the store is gone or did not answer within the timeout
                # A client does not come back from a broken store connection, and a call that timed out
                # took the whole liveness timeout: either way the other nodes are as good as lost. Stop,
                # so their stamps age and the watchdog ends the run with the one error naming them.
                logger.warning("heartbeat relay of node %d stopped: the rendezvous store failed: %s",
                               self.node, str(e).splitlines()[0] if str(e) else type(e).__name__)
                return
