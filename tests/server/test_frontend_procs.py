"""Rank 0's helpers for its API frontend processes."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from rtp.server.frontend_procs import METRICS_DIR_PREFIX, metrics_dir


def test_metrics_dirs_of_dead_runs_are_removed_and_live_ones_kept(tmp_path, monkeypatch):
    # A temp directory of its own: a server started by a test running beside this one cleans the shared one.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    tmp = Path(tempfile.gettempdir())
    stale = tmp / f"{METRICS_DIR_PREFIX}{int(dead.stdout)}_test"
    live = tmp / f"{METRICS_DIR_PREFIX}{os.getppid()}_test"  # pytest's parent: alive for the whole test
    for d in (stale, live):
        d.mkdir(exist_ok=True)
        (d / "counter_1.db").write_bytes(b"x")
    mine = Path(metrics_dir())
    try:
        assert mine.is_dir() and mine.name.startswith(f"{METRICS_DIR_PREFIX}{os.getpid()}_")
        assert not stale.exists() and live.exists()
    finally:
        for d in (mine, live, stale):
            for f in d.glob("*"):
                f.unlink()
            if d.exists():
                d.rmdir()


def test_a_signal_during_a_send_to_a_frontend_stops_the_loop_without_deadlock():
    """SIGTERM can arrive while the loop is inside ``link.send`` holding the link's lock: the handler only
    notes it (sending SHUTDOWN from the handler deadlocked the server), the loop then sends SHUTDOWN."""
    import signal
    import socket
    import threading
    from types import SimpleNamespace

    from rtp.server.engine_loop import EngineLoop
    from rtp.server.frontend_procs import FrontendLink
    from rtp.server.frontend_wire import FrameReader, Kind

    server = SimpleNamespace(shutdown_grace_s=4.0, log_stats_interval_s=0.0)
    runtime = SimpleNamespace(engine=None, config=SimpleNamespace(server=server),
                              report_lost_peer=lambda: False)  # every rank alive
    loop = EngineLoop(runtime, None, 1, "", False)  # type: ignore[arg-type]
    ours, theirs = socket.socketpair()
    link = FrontendLink(0, None, ours, 5.0, pid=os.getpid())
    loop.links = [link]
    try:
        with link._lock:  # the main thread is in the middle of a send
            handler = threading.Thread(target=loop._on_signal, args=(signal.SIGTERM, None))
            handler.start()
            handler.join(2.0)
            assert not handler.is_alive(), "the signal handler blocked on the link's lock"
            assert not loop.stopping
        loop._take_signals()
        assert loop.stopping
        theirs.settimeout(2.0)
        reader = FrameReader()
        kinds = [kind for kind, _ in reader.feed(theirs.recv(4096))]
        assert kinds == [Kind.SHUTDOWN]
    finally:
        loop._stop_bound.close()  # disarm the stop's exit deadline: this is the test process
        for s in (ours, theirs, loop._wake_r, loop._wake_w):
            s.close()


def test_a_signal_after_a_rank_was_lost_fails_the_frontends_instead_of_draining_them():
    """torchrun sends SIGTERM to the other ranks when one dies: if the loop finds a rank gone when it takes the
    signal, the frontends get FAIL naming that rank (their /health and clients say why), not SHUTDOWN."""
    import signal
    import socket
    from types import SimpleNamespace

    from rtp.server.engine_loop import EngineLoop
    from rtp.server.frontend_procs import FrontendLink
    from rtp.server.frontend_wire import FrameReader, Kind

    cause = "rank 1 (pid 4242) died"
    reported: list[str] = []

    def report_lost_peer() -> bool:  # as the runtime does: its failure hook is the loop's
        reported.append(cause)
        loop._on_runtime_failure(cause)
        return True

    server = SimpleNamespace(shutdown_grace_s=4.0, log_stats_interval_s=0.0)
    runtime = SimpleNamespace(engine=None, config=SimpleNamespace(server=server),
                              report_lost_peer=report_lost_peer)
    loop = EngineLoop(runtime, None, 1, "", False)  # type: ignore[arg-type]
    ours, theirs = socket.socketpair()
    loop.links = [FrontendLink(0, None, ours, 5.0, pid=os.getpid())]
    try:
        loop._on_signal(signal.SIGTERM, None)
        loop._take_signals()
        assert reported == [cause] and loop.failure == cause and not loop.stopping
        theirs.settimeout(2.0)
        frames = list(FrameReader().feed(theirs.recv(4096)))
        assert [kind for kind, _ in frames] == [Kind.FAIL] and bytes(frames[0][1]).decode() == cause
    finally:
        loop._stop_bound.close()
        for s in (ours, theirs, loop._wake_r, loop._wake_w):
            s.close()


def test_a_frontend_that_stops_gracefully_stops_the_replica_with_exit_code_0():
    """Another node's replica gets no SIGTERM when node 0's server stops: its frontends say SHUTDOWN before they
    close, and it stops as gracefully (a closed connection alone was a dead frontend: exit code 1). Rank 0 stops
    only on its own signals: there a frontend's SHUTDOWN changes nothing."""
    import socket
    from types import SimpleNamespace

    from rtp.server.engine_loop import EngineLoop
    from rtp.server.frontend_procs import FrontendLink
    from rtp.server.frontend_wire import Kind, frame

    server = SimpleNamespace(shutdown_grace_s=4.0, log_stats_interval_s=0.0)
    runtime = SimpleNamespace(engine=None, config=SimpleNamespace(server=server, liveness=SimpleNamespace(
        timeout_s=5.0)), report_lost_peer=lambda: False)
    for replica in (True, False):
        loop = EngineLoop(runtime, None, 1, "", False,  # type: ignore[arg-type]
                          accept_on=SimpleNamespace() if replica else None)  # type: ignore[arg-type]
        ours, theirs = socket.socketpair()
        loop.links = [FrontendLink(0, None, ours, 5.0, pid=os.getpid())]
        try:
            theirs.sendall(frame(Kind.SHUTDOWN))
            theirs.close()
            loop._poll(2.0)
            assert loop.stopping == replica and loop.exit_code == 0
            loop._poll(2.0)
            assert loop.links[0].closed and loop.exit_code == (0 if replica else 1)
        finally:
            loop._stop_bound.close()
            for s in (ours, loop._wake_r, loop._wake_w):
                s.close()
