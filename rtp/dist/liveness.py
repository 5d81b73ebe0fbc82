"""Peer-death detection: a watchdog thread that notices a rank's process is gone.

Collectives and the shm channel can block forever when a peer dies, so each
rank runs a watchdog that polls its peers' pids (all ranks of one node). When
a watched peer is gone, ``on_dead(rank, pid)`` runs; it must end the process.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from rtp.log import get_logger

logger = get_logger(__name__)


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (a killed child not yet reaped)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return True  # no /proc: trust kill(0)


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks (field 22 of /proc/PID/stat), None if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


class Watchdog:
    """Polls ``peers`` (rank -> pid) every ``interval_s`` on a daemon thread."""

    def __init__(self, peers: dict[int, int], on_dead: Callable[[int, int], None], interval_s: float = 0.25) -> None:
        self.peers = dict(peers)
        # A pid can be reused by a new process once the peer is gone: remember who it was.
        self._starts = {rank: _start_time(pid) for rank, pid in self.peers.items()}
        self.on_dead = on_dead
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rtp-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (a clean shutdown is under way: peers exiting is expected)."""
        self._stop.set()

    def dead_peers(self) -> list[tuple[int, int]]:
        return [
            (rank, pid)
            for rank, pid in self.peers.items()
            if not pid_alive(pid) or _start_time(pid) != self._starts[rank]
        ]

    def wait_for_dead(self, timeout_s: float) -> tuple[int, int] | None:
        """The first dead peer (rank, pid) seen within ``timeout_s``, else None.

        A collective that failed because a peer died usually returns before the
        peer's process is reaped: polling briefly tells the two cases apart.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            dead = self.dead_peers()
            if dead or time.monotonic() > deadline:
                return dead[0] if dead else None
            time.sleep(0.05)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            dead = self.dead_peers()
            if dead and not self._stop.is_set():
                self.on_dead(*dead[0])
                return
