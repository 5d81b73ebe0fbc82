"""The pid watchdog: dead and zombie processes count as dead, stop() silences it."""

import os
import subprocess
import sys
import threading
import time

from rtp.dist.liveness import Watchdog, pid_alive


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
    seen, fired = [], threading.Event()
    dog = Watchdog({3: child.pid}, lambda rank, pid: (seen.append((rank, pid)), fired.set()), interval_s=0.05)
    dog.start()
    assert fired.wait(30)
    assert seen == [(3, child.pid)]
    assert dog.wait_for_dead(0.1) == (3, child.pid)
    child.wait()

    quiet = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    calls = []
    dog2 = Watchdog({1: quiet.pid}, lambda *a: calls.append(a), interval_s=0.05).start()
    dog2.stop()
    quiet.wait()
    time.sleep(0.3)
    assert calls == []
    assert Watchdog({1: os.getpid()}, lambda *a: None).wait_for_dead(0.2) is None


def test_a_reused_pid_is_not_mistaken_for_the_peer():
    dog = Watchdog({1: os.getpid()}, lambda *a: None)
    assert dog.dead_peers() == []
    dog._starts[1] = "0"  # as if this pid had belonged to a process that started earlier and died
    assert dog.dead_peers() == [(1, os.getpid())]
