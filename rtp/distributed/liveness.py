"""Liveness: one watchdog thread per rank turns every way a run can stall into one prompt failure.

What it catches (each within about a second of its bound):

- **died**: a watched peer's process is gone (pid check; a zombie or a reused
  pid counts as gone).
- **hung**: a peer's heartbeat (:mod:`rtp.distributed.heartbeat`) is older than
  ``liveness_timeout_s``: stopped, swapped out, stuck in a driver call. The
  runtime SIGKILLs the hung peer (:func:`kill_hung`) once it has cleaned up:
  a stopped process cannot act on SIGTERM, torchrun would wait 30 s before it
  kills it itself, and a rank that missed a whole timeout of collectives can
  never rejoin the run.
- **orphaned**: the launcher that started this rank (torchrun's agent) is
  gone, e.g. SIGKILLed. ``prctl(PR_SET_PDEATHSIG)`` makes the kernel signal
  the rank at once; a parent-pid check every round is the fallback (a signal
  that arrived before its handler, or a kernel without prctl).
- **stuck** (rank 0 only): the current step has run for ``step_timeout_s``.
  Every rank's heartbeat thread dumps its Python stacks to the log, and the
  failure names the ranks that had not finished the step.

The first failure wins: :meth:`Watchdog.report` runs ``on_failure(failure)``
once, from whichever thread reported it first (the watchdog's own, or a main
thread whose collective failed). ``on_failure`` must end the process, after
unlinking what it owns; the runtime's handlers do.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any, Literal, NoReturn, Union

from rtp.distributed.heartbeat import Heartbeat
from rtp.distributed.pids import pid_alive, start_time
from rtp.log import get_logger

# What signal.getsignal returns and signal.signal accepts.
_SignalHandler = Union[Callable[[int, Union[FrameType, None]], Any], int, signal.Handlers, None]

logger = get_logger(__name__)

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
PARENT_DEATH_SIGNAL = signal.SIGUSR2  # no one else sends it (torchrun forwards SIGHUP: a stop, see STOP_SIGNALS)
# What stops a run gracefully: torchrun's agent forwards each of these to every rank (SIGHUP: a closed terminal).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def stop_signals() -> tuple[int, ...]:
    """:data:`STOP_SIGNALS` less SIGHUP where this process ignores it (started under ``nohup``: it must outlive
    the terminal). Call before installing handlers for them."""
    return tuple(s for s in STOP_SIGNALS if s != signal.SIGHUP or signal.getsignal(s) is not signal.SIG_IGN)


def set_parent_death_signal(signum: int) -> bool:
    """Ask the kernel to send ``signum`` to this process when its parent exits (Linux); False if unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(signum), 0, 0, 0) != 0:
            logger.warning("prctl(PR_SET_PDEATHSIG) failed: %s", os.strerror(ctypes.get_errno()))
            return False
    except (OSError, AttributeError):
        return False
    return True


def died_message(rank: int, pid: int) -> str:
    return f"rank {rank} (pid {pid}) died"


def hung_message(rank: int, pid: int, age_s: float) -> str:
    return f"rank {rank} (pid {pid}) stopped responding: no heartbeat for {age_s:.1f} s"


def lost_remote_message(rank: int, where: str, age_s: float) -> str:
    """A rank on another node went silent: its process, its node or the link to it is gone."""
    return f"rank {rank} ({where}) was lost: no heartbeat from its node for {age_s:.1f} s"


FailureKind = Literal["died", "hung", "orphaned", "stuck"]


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


@dataclass(frozen=True)
class Failure:
    """Why the run cannot continue, as the one line every exit path reports."""

    kind: FailureKind
    """died (process gone), hung (no heartbeat), orphaned (launcher gone) or stuck (step timer)."""
    message: str
    """One line naming the rank and what happened."""
    rank: int | None = None
    """The lost rank (died, hung) or the orphaned rank itself; None for a stuck step."""
    pid: int | None = None
    """That rank's pid."""
    start_time: str | None = None
    """That process's start time (see :func:`rtp.distributed.pids.start_time`): a reused pid is not it."""


def kill_hung(failure: Failure) -> None:
    """SIGKILL the rank a "hung" failure names, if that process is still there; otherwise do nothing."""
    if failure.kind != "hung" or failure.pid is None or start_time(failure.pid) != failure.start_time:
        return
    try:
        os.kill(failure.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return
    logger.warning("killed rank %s (pid %d): a stopped process cannot exit on its own", failure.rank, failure.pid)


def exit_now(code: int) -> NoReturn:
    """End a rank whose work is done and whose resources are released: logs and streams flushed, then
    ``os._exit``. The interpreter's exit would also run gloo's C++ destructors, which abort the process
    (std::terminate, exit -6) when a peer's connection is still being torn down: a clean stop must end
    with its own code whatever the peers' timing."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@contextlib.contextmanager
def exit_deadline(seconds: float, what: str) -> Iterator[None]:
    """End the process (exit 1, every thread's Python stack to stderr) if ``what`` outlasts ``seconds``.

    For teardowns, which run after the watchdog stopped watching: a shutdown
    that blocks (a lock, a join, a collective with a peer already gone) must
    still end, and say where it was. Leaving the block in time disarms it.
    """
    def expire() -> None:
        logger.error("%s did not finish within %.0f s: exiting; Python stacks follow", what, seconds)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        os._exit(1)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _parent_death_noted(signum: int, frame: FrameType | None) -> None:
    """The parent-death signal's handler: nothing to do here (see Watchdog._arm_parent_death)."""


class Watchdog:
    """Watches ``peers`` (rank -> pid), the heartbeats, the launcher and (rank 0) the step timer.

    ``remote`` (rank -> "pid P on host H") lists ranks on other nodes: no pid
    can be checked there, so they are watched by their relayed heartbeats only.
    ``heartbeat`` enables the hung and stuck checks (``step_timeout_s``, set on
    rank 0 and the other replicas' coordinators only; ``step_ranks`` are the ranks of
    its steps); ``parent_pid`` enables the orphan check. Runs every ``interval_s``
    on a daemon thread once :meth:`start` is called.
    """

    def __init__(self, rank: int, peers: dict[int, int], on_failure: Callable[[Failure], None], *,
                 heartbeat: Heartbeat | None = None, parent_pid: int | None = None,
                 step_timeout_s: float | None = None, interval_s: float = 0.25, dump_wait_s: float = 3.0,
                 remote: dict[int, str] | None = None, step_ranks: list[int] | None = None) -> None:
        self.rank = rank
        self.step_ranks = step_ranks  # the ranks that run this rank's steps (a data-parallel replica); None: all
        self.peers = dict(peers)
        self.remote = dict(remote or {})
        self._watched = sorted(set(self.peers) | set(self.remote))
        # A pid can be reused by a new process once the peer is gone: remember who it was.
        self._starts = {r: start_time(pid) for r, pid in self.peers.items()}
        self.on_failure = on_failure  # replaceable: the runtime takes over from the startup handler
        self.heartbeat, self.parent_pid = heartbeat, parent_pid
        # Rank 0: called once (this thread) with the node whose ranks got SIGTERM from their own torchrun, not
        # rank 0's (Heartbeat.request_stop); it stops the run as a SIGTERM here would.
        self.on_stop_request: Callable[[int], None] | None = None
        self._stop_passed_on = False
        self.step_timeout_s, self.interval_s, self.dump_wait_s = step_timeout_s, interval_s, dump_wait_s
        self.failure: Failure | None = None  # the first failure reported
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._old_hup: _SignalHandler = None
        self._armed = False
        self._thread = threading.Thread(target=self._run, name="rtp-watchdog", daemon=True)

    # ------------------------------------------------------------ lifecycle

    def start(self) -> Watchdog:
        if self.parent_pid is not None:
            self._arm_parent_death()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (a clean shutdown: peers exiting is expected); the thread is gone after. Idempotent."""
        self._stop.set()
        self._wake.set()
        if self._thread.ident is not None and self._thread is not threading.current_thread() and self.failure is None:
            self._thread.join(5.0)  # a check under way ends and reports nothing (no wait on a failure's handler)
        if self._armed and threading.current_thread() is threading.main_thread():
            set_parent_death_signal(0)
            signal.signal(PARENT_DEATH_SIGNAL, self._old_hup)
            self._armed = False

    def abort_reason(self) -> str | None:
        """The failure's message once one was reported, else None (for ``should_abort`` callables)."""
        failure = self.failure
        return failure.message if failure is not None else None

    def _arm_parent_death(self) -> None:
        # The signal only replaces its default action (exit without cleanup): the watchdog thread
        # sees the new parent pid within interval_s and does the exit. The handler must take no
        # lock: it runs on the main thread between two bytecodes, possibly inside another handler
        # call (the signal can come more than once), and waking an Event there deadlocked.
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers need the main thread; the parent-pid check still runs
        old = signal.signal(PARENT_DEATH_SIGNAL, _parent_death_noted)
        self._old_hup = old if old is not None else signal.SIG_DFL  # None: a handler installed outside Python
        if set_parent_death_signal(PARENT_DEATH_SIGNAL):
            self._armed = True
        else:
            signal.signal(PARENT_DEATH_SIGNAL, self._old_hup)

    # ------------------------------------------------------------ reporting

    def report(self, failure: Failure) -> Failure:
        """Run ``on_failure`` for the first failure reported; returns that first failure."""
        with self._lock:
            if self.failure is not None:
                return self.failure
            self.failure = failure
        try:
            self.on_failure(failure)
        except Exception:  # noqa: BLE001 - the failure must still be recorded and returned
            logger.exception("the failure handler raised")
        return failure

    # ------------------------------------------------------------ checks

    def dead_peers(self) -> list[tuple[int, int]]:
        return [
            (rank, pid)
            for rank, pid in self.peers.items()
            if not pid_alive(pid) or start_time(pid) != self._starts[rank]
        ]

    def lost_node(self) -> Failure | None:
        """A rank on another node whose heartbeats stopped for the liveness timeout (its node is lost); else None."""
        if not self.remote or self.heartbeat is None:
            return None
        silent = self.heartbeat.silent_peer(sorted(self.remote))
        if silent is None:
            return None
        rank, age = silent
        return Failure("hung", lost_remote_message(rank, self.remote[rank], age), rank)

    def check_peers(self, heartbeats: bool = True) -> Failure | None:
        """A dead peer, or (``heartbeats``) a hung one; else None."""
        # First: a lost node is the cause when this node's ranks then leave one after another.
        lost = self.lost_node() if heartbeats else None
        if lost is not None:
            return lost
        dead = self.dead_peers()
        if dead:
            rank, pid = dead[0]
            return Failure("died", died_message(rank, pid), rank, pid)
        if heartbeats and self.heartbeat is not None:
            silent = self.heartbeat.silent_peer(self._watched)
            if silent is not None:
                rank, age = silent
                if rank in self.remote:  # went silent between the two looks
                    return Failure("hung", lost_remote_message(rank, self.remote[rank], age), rank)
                pid = self.peers[rank]
                return Failure("hung", hung_message(rank, pid, age), rank, pid, self._starts[rank])
        return None

    def wait_for_lost(self, timeout_s: float) -> Failure | None:
        """The failure already reported, or the first dead or hung peer seen within ``timeout_s``, else None.

        A collective that failed because a peer died usually returns before the
        peer's process is reaped: polling briefly tells the two cases apart.
        A rank on another node is known to be lost only once its heartbeats
        time out, so with remote peers the wait lasts at least that long.
        """
        if self.remote and self.heartbeat is not None:
            timeout_s = max(timeout_s, self.heartbeat.timeout_s + 4 * self.heartbeat.interval_s)
        deadline = time.monotonic() + timeout_s
        while True:
            found = self.failure or self.check_peers()
            if found is not None or time.monotonic() > deadline:
                return found
            time.sleep(0.05)

    def _orphaned(self) -> Failure | None:
        if self.parent_pid is None or os.getppid() == self.parent_pid:
            return None
        return Failure("orphaned", f"rank {self.rank} (pid {os.getpid()}) lost its launcher: "
                                   f"the torchrun agent (pid {self.parent_pid}) is gone", self.rank, os.getpid())

    def _stuck_step(self) -> Failure | None:
        hb, limit = self.heartbeat, self.step_timeout_s
        if hb is None or limit is None:
            return None
        step, done, running_s = hb.step_state(self.rank)
        if step <= done or running_s <= limit:
            return None
        # Confirm on a second look: on a weakly ordered CPU the step number and its start time
        # may briefly be seen out of order.
        time.sleep(0.05)
        if hb.step_state(self.rank)[:2] != (step, done):
            return None
        ranks = self.step_ranks if self.step_ranks is not None else range(hb.world_size)
        behind = [r for r in ranks if hb.step_state(r)[1] < step]
        waiting = [r for r in behind if hb.waiting(r)]
        culprits = [r for r in behind if r not in waiting] or behind
        message = f"step {step} did not finish within {limit:g} s: {_ranks(culprits)} had not finished it"
        if culprits != behind:
            message += (f" ({_ranks(waiting)} {'was' if len(waiting) == 1 else 'were'} waiting for "
                        f"{'it' if len(culprits) == 1 else 'them'} in a collective)")
        logger.error("%s; asking every rank for its Python stacks", message)
        seq = hb.request_dump(step)
        # Ranks that can answer: this one and every peer whose heartbeat still runs.
        expected = {self.rank} | {r for r in self._watched if hb.age_s(r) < hb.timeout_s}
        deadline = time.monotonic() + self.dump_wait_s
        while not expected <= set(hb.dumped(seq)) and time.monotonic() < deadline:
            time.sleep(0.05)
        answered = hb.dumped(seq)
        if answered:
            message += f"; Python stacks of {_ranks(answered)} are in the log"
        return Failure("stuck", message)

    def _run(self) -> None:
        hb = self.heartbeat
        # If this thread itself did not run for a while (the process was stopped, the machine
        # paused or overloaded), the peers' beats look old for the same reason: give them two
        # beat intervals to show up before judging them.
        stall_s = hb.timeout_s / 4 if hb is not None else float("inf")
        last, judge_from = time.monotonic(), 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now - last > stall_s and hb is not None:
                judge_from = now + 2 * hb.interval_s + self.interval_s
            last = now
            if self.on_stop_request is not None and hb is not None and not self._stop_passed_on:
                node = hb.stop_requested()
                if node is not None:
                    self._stop_passed_on = True
                    self.on_stop_request(node)
            failure = self._orphaned() or self.check_peers(heartbeats=now >= judge_from)
            if failure is None:
                failure = self._stuck_step()
            if failure is not None and not self._stop.is_set():
                self.report(failure)
                return
            self._wake.wait(self.interval_s)
            self._wake.clear()
