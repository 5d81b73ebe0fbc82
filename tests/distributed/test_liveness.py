"""The watchdog: dead, hung (SIGSTOP) and orphaned ranks, stuck steps with stack dumps, stop() silences it.

The peers here are small subprocesses that map a heartbeat region by name,
so every case runs in a second or two without torchrun (but the last: three ranks under torchrun, one of which
never joins).
"""

from __future__ import annotations

import _posixshmem
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from rtp.distributed.heartbeat import Heartbeat
from rtp.distributed.liveness import PARENT_DEATH_SIGNAL, Failure, Watchdog, kill_hung, pid_alive
from rtp.distributed.shm_segment import make_segment_name, map_segment
from tests.utils import REPO, torchrun

TIMEOUT_S = 1.5  # liveness timeout of these tests (short, with room for a loaded machine)
INTERVAL_S = 0.05  # heartbeat interval

# A peer (rank 1) that maps the region, beats from its thread, and does what argv[2] says:
# "beat" just beats, "step" also starts a step and never finishes it.
PEER = """
import sys, time
from rtp.distributed.heartbeat import Heartbeat
from rtp.distributed.shm_segment import map_segment
name, mode = sys.argv[1], sys.argv[2]
hb = Heartbeat(map_segment(name, Heartbeat.region_bytes(2), create=False, what="test"), 1, 2, {interval}, {timeout})
hb.start()
if mode == "step":
    hb.start_step()
print("ready", flush=True)
while True:
    time.sleep(0.5)  # the main thread is "busy"; only the heartbeat thread beats
""".format(interval=INTERVAL_S, timeout=TIMEOUT_S)


class Peer:
    """Rank 0's end of a two-rank heartbeat region, with rank 1 in a subprocess."""

    def __init__(self, mode: str = "beat") -> None:
        name = make_segment_name()
        mm = map_segment(name, Heartbeat.region_bytes(2), create=True, what="test")
        self.hb = Heartbeat(mm, 0, 2, INTERVAL_S, TIMEOUT_S)
        self.proc = subprocess.Popen([sys.executable, "-c", PEER, name, mode], cwd=REPO, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        try:
            assert self.proc.stdout.readline().strip() == "ready", self.proc.stderr.read()
        finally:
            _posixshmem.shm_unlink("/" + name)  # both ends mapped it: nothing can leak
        self.hb.start()

    def close(self) -> str:
        """Kill the peer if still there; returns its stderr."""
        if self.proc.poll() is None:
            self.proc.kill()
        _, err = self.proc.communicate(timeout=30)
        self.hb.stop()
        return err


class Recorder:
    """An on_failure callback that records failures (a real one would end the process)."""

    def __init__(self) -> None:
        self.failures: list[Failure] = []
        self.fired = threading.Event()

    def __call__(self, failure: Failure) -> None:
        self.failures.append(failure)
        self.fired.set()


def test_pid_alive_sees_exit_and_zombies():
    assert pid_alive(os.getpid())
    assert not pid_alive(0) and not pid_alive(-5)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while pid_alive(child.pid):  # exited but not reaped yet: a zombie, which must count as dead
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert child.poll() == 0
    assert not pid_alive(child.pid)


def test_watchdog_reports_a_dead_peer_once_and_stop_silences_it():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    rec = Recorder()
    dog = Watchdog(0, {3: child.pid}, rec, interval_s=0.05).start()
    assert rec.fired.wait(30)
    assert rec.failures == [Failure("died", f"rank 3 (pid {child.pid}) died", 3, child.pid)]
    assert dog.wait_for_lost(0.1) == rec.failures[0]
    assert dog.report(Failure("hung", "later", 3, child.pid)) == rec.failures[0]  # the first failure wins
    assert len(rec.failures) == 1 and dog.abort_reason() == rec.failures[0].message
    child.wait()

    quiet = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    calls = Recorder()
    dog2 = Watchdog(0, {1: quiet.pid}, calls, interval_s=0.05).start()
    dog2.stop()
    assert not dog2._thread.is_alive()  # gone when stop() returns: a script may init again and count threads
    quiet.wait()
    time.sleep(0.3)
    assert calls.failures == [] and dog2.abort_reason() is None
    assert Watchdog(0, {1: os.getpid()}, Recorder()).wait_for_lost(0.2) is None


def test_a_reused_pid_is_not_mistaken_for_the_peer():
    dog = Watchdog(0, {1: os.getpid()}, Recorder())
    assert dog.dead_peers() == []
    dog._starts[1] = "0"  # as if this pid had belonged to a process that started earlier and died
    assert dog.dead_peers() == [(1, os.getpid())]


def test_a_busy_peer_beats_and_a_stopped_one_is_declared_hung_and_killed():
    peer = Peer()
    rec = Recorder()
    dog = Watchdog(0, {1: peer.proc.pid}, rec, heartbeat=peer.hb, interval_s=0.05).start()
    try:
        # Its main thread only sleeps, for longer than the timeout: the heartbeat thread keeps it alive.
        assert not rec.fired.wait(2 * TIMEOUT_S), rec.failures
        assert peer.hb.beats(1) > 10 and peer.hb.pid(1) == peer.proc.pid
        os.kill(peer.proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        assert rec.fired.wait(TIMEOUT_S + 5)
        assert time.monotonic() - t0 < TIMEOUT_S + 1.0
        [failure] = rec.failures
        assert failure.kind == "hung" and failure.rank == 1 and failure.pid == peer.proc.pid
        assert failure.message.startswith(f"rank 1 (pid {peer.proc.pid}) stopped responding: no heartbeat for ")
        kill_hung(failure)  # what the runtime's handlers do: a stopped rank cannot exit by itself
        assert peer.proc.wait(10) == -signal.SIGKILL
        kill_hung(failure)  # gone (a zombie reaped): nothing to kill, no error
    finally:
        dog.stop()
        peer.close()


def test_a_stuck_step_names_the_rank_that_holds_it_and_every_rank_dumps_its_stacks(capfd, caplog):
    peer = Peer("step")  # rank 1 started step 1 and never finishes it
    rec = Recorder()
    dog = Watchdog(0, {1: peer.proc.pid}, rec, heartbeat=peer.hb, step_timeout_s=1.5, interval_s=0.05)
    try:
        assert peer.hb.start_step() == 1
        peer.hb.set_waiting(True)  # rank 0 waits for rank 1 in a collective
        dog.start()
        assert rec.fired.wait(30)
        [failure] = rec.failures
        assert failure.kind == "stuck"
        assert failure.message == ("step 1 did not finish within 1.5 s: rank 1 had not finished it "
                                   "(rank 0 was waiting for it in a collective); "
                                   "Python stacks of ranks 0, 1 are in the log")
        assert peer.proc.poll() is None  # a slow step is not a hung rank: nobody was killed
    finally:
        dog.stop()
        peer_err = peer.close()
    # Each rank logs a header line, then faulthandler writes every thread's stack to stderr.
    ours = capfd.readouterr().err
    assert f"rank 0 (pid {os.getpid()}): Python stacks follow" in caplog.text  # pytest holds rank 0's log
    assert "most recent call first" in ours and "in _stuck_step" in ours  # the watchdog thread that asked
    assert f"rank 1 (pid {peer.proc.pid}): Python stacks follow" in peer_err
    assert 'File "<string>", line 12 in <module>' in peer_err, peer_err  # rank 1's main thread, in its sleep


def test_finished_steps_and_idle_time_are_not_stuck():
    hb = Heartbeat.private(INTERVAL_S, TIMEOUT_S).start()
    rec = Recorder()
    dog = Watchdog(0, {}, rec, heartbeat=hb, step_timeout_s=0.3, interval_s=0.02).start()
    try:
        for _ in range(3):
            hb.start_step()
            time.sleep(0.1)
            hb.finish_step()
            time.sleep(0.4)  # idle for longer than step_timeout_s: only a running step counts
        assert hb.step_state(0)[:2] == (3, 3)
        assert not rec.fired.is_set(), rec.failures
    finally:
        dog.stop()
        hb.stop()


def test_a_changed_parent_pid_is_an_orphaned_rank():
    rec = Recorder()
    # Started off the main thread: no signal handler, only the parent-pid check.
    dog = Watchdog(4, {}, rec, parent_pid=os.getppid() + 100_000, interval_s=0.05)
    starter = threading.Thread(target=dog.start)
    starter.start()
    starter.join()
    assert rec.fired.wait(10)
    assert rec.failures[0].kind == "orphaned" and rec.failures[0].message.startswith(f"rank 4 (pid {os.getpid()})")
    assert "lost its launcher" in rec.failures[0].message


# A launcher (the middle process) that starts a rank and waits; the rank arms the parent-death
# signal (so that the signal's default action does not kill it before its watchdog cleans up) and
# keeps its main thread busy in Python, where signal handlers run.
ORPHAN = """
import os, sys, time
from rtp.distributed.liveness import Watchdog
def lost(failure):
    print(failure.message, flush=True)
    os._exit(3)
Watchdog(1, {}, lost, parent_pid=os.getppid(), interval_s=0.25).start()
print("armed", flush=True)
while True:
    sum(range(1000))
"""
LAUNCHER = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=open(sys.argv[2], "w"))
print(child.pid, flush=True)
child.wait()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
@pytest.mark.parametrize("extra_signals", [0, 300])
def test_an_orphaned_rank_exits_through_its_watchdog(tmp_path, extra_signals):
    # extra_signals: a burst of the parent-death signal first, which must neither kill the rank
    # early nor wedge it. (A handler that set an Event was once re-entered inside itself and
    # deadlocked a rank on its Condition lock; this burst did not reproduce that race reliably.)
    out = tmp_path / "rank.out"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, ORPHAN, str(out)], cwd=REPO,
                                stdout=subprocess.PIPE, text=True)
    rank_pid = int(launcher.stdout.readline())
    deadline = time.monotonic() + 30
    while "armed" not in out.read_text():
        assert time.monotonic() < deadline and pid_alive(rank_pid)
        time.sleep(0.05)
    for _ in range(extra_signals):
        os.kill(rank_pid, PARENT_DEATH_SIGNAL)
    launcher.kill()
    launcher.wait()
    t0 = time.monotonic()
    while pid_alive(rank_pid):
        assert time.monotonic() - t0 < 5, "the orphaned rank did not notice its launcher's death"
        time.sleep(0.05)
    assert f"lost its launcher: the torchrun agent (pid {launcher.pid}) is gone" in out.read_text()


def test_exit_deadline_ends_a_blocked_teardown_with_its_stacks_and_passes_a_quick_one():
    code = (
        "import threading, time\n"
        "from rtp.distributed.liveness import exit_deadline\n"
        "with exit_deadline(2.0, 'quick'):\n"
        "    pass\n"
        "time.sleep(2.5)  # that deadline was disarmed: still alive here\n"
        "print('after quick', flush=True)\n"
        "def stuck_teardown():\n"
        "    lock = threading.Lock()\n"
        "    lock.acquire()\n"
        "    lock.acquire()\n"
        "with exit_deadline(1.0, 'the test teardown'):\n"
        "    stuck_teardown()\n"
    )
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "after quick" in proc.stdout
    assert "the test teardown did not finish within 1 s" in proc.stderr, proc.stderr
    assert "in stuck_teardown" in proc.stderr, proc.stderr  # the main thread's stack, where it blocked
    assert time.monotonic() - t0 < 30


def test_a_rank_that_never_joins_is_named(tmp_path):
    """A rank lost before it joins the process group (stopped, failed, or a node that never came): the others'
    join timeout names it instead of ending in the store's traceback ("wait timeout ..., keys: /default_pg/...")."""
    script = tmp_path / "join.py"
    script.write_text(
        "import os, sys\n"
        "from rtp.distributed.parallel import ParallelState\n"
        "from rtp.errors import RtpError\n"
        "if os.environ['RANK'] == '2':\n"
        "    sys.exit(0)\n"
        "try:\n"
        "    ParallelState.from_env('cpu', timeout_s=3)\n"
        "except RtpError as e:\n"
        f"    open(f'{tmp_path}/error' + os.environ['RANK'], 'w').write(str(e))\n"
        "    sys.exit(3)\n")
    out = torchrun(script, 3, check=False, timeout=120)
    assert out.returncode != 0, out.stdout[-3000:] + out.stderr[-3000:]
    for rank in (0, 1):
        message = (tmp_path / f"error{rank}").read_text()
        assert message.startswith("rank 2 did not join the process group within 3 s"), message


def test_sighup_stops_a_run_unless_ignored_under_nohup():
    """torchrun forwards SIGHUP (a closed terminal) as it does SIGTERM: a stop signal, except in a process started
    under nohup, which must outlive the terminal."""
    import signal

    from rtp.distributed.liveness import PARENT_DEATH_SIGNAL, stop_signals

    assert PARENT_DEATH_SIGNAL not in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT)
    old = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        assert signal.SIGHUP in stop_signals()
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        assert stop_signals() == (signal.SIGTERM, signal.SIGINT)
    finally:
        signal.signal(signal.SIGHUP, old)
