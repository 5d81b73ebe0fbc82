"""Rank 0's API frontend processes: start them, talk to each over its socket, notice when one is gone.

Each frontend is ``python -m rtp.server.frontend`` started by rank 0 with two
inherited descriptors: the server's listening TCP socket (every frontend
accepts on the same socket, the kernel spreads the connections) and its end of
a Unix-domain socket pair to rank 0 (frames of rtp/server/frontend_wire.py).
A frontend dies with rank 0 (parent-death signal, and EOF on its socket).
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from rtp.distributed.pids import pid_alive
from rtp.log import get_logger
from rtp.server.frontend_wire import FrameReader, Kind, StepOutputs, encode_hello

logger = get_logger(__name__)

SOCK_BUF_BYTES = 4 << 20  # step outputs of a large batch fit without a blocking write


def default_api_processes() -> int:
    """The frontends when ``server.api_processes`` is not set: one, as vLLM's --api-server-count.

    Measured on a 2-core machine (vLLM's serving client, 96 streamed requests of 128/64 tokens, the
    shipped model): one frontend against the single-process server gave 1.23x against 0.84x vLLM's
    tok/s at rate inf, and at 8 requests/s a mean TPOT of 7.6 ms against ~13 ms. Even where the
    ranks use every core, moving HTTP, JSON and text off rank 0's interpreter frees the engine loop
    from the GIL for longer than the frontend takes from the forward pass. More frontends only pay
    for hundreds of concurrent streams and are asked for explicitly.
    """
    return 1


METRICS_DIR_PREFIX = "rtp_metrics_"


def metrics_dir() -> str:
    """A fresh directory for this run's multiprocess metrics files, after removing those of dead runs.

    Named ``rtp_metrics_<pid>_*`` in the temp directory; rank 0 removes its own on every exit but
    SIGKILL, and the next start removes those whose process is gone.
    """
    tmp = Path(tempfile.gettempdir())
    for old in tmp.glob(f"{METRICS_DIR_PREFIX}*_*"):
        pid = old.name[len(METRICS_DIR_PREFIX) :].split("_", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            logger.info("removing %s, left by a server that is gone", old)
            shutil.rmtree(old, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{METRICS_DIR_PREFIX}{os.getpid()}_")


class FrontendLink:
    """One frontend process and an engine's end of its socket.

    Rank 0 started the process (``proc``); another data-parallel replica's
    coordinator only accepted its connection and knows its ``pid``, or (a
    replica on another node, ``pid`` None) not even that: such a frontend is
    known to be gone when its connection ends.
    """

    def __init__(self, index: int, proc: subprocess.Popen[bytes] | None, sock: socket.socket, send_timeout_s: float,
                 pid: int | None = None) -> None:
        self.index, self.proc, self.sock = index, proc, sock
        self._pid = proc.pid if proc is not None else pid
        sock.settimeout(send_timeout_s)  # a frontend that reads nothing for this long is hung
        self.reader = FrameReader()
        self.ready = False
        self.last_heard = time.monotonic()  # when a frame last came (a ready frontend beats: frontend_wire.BEAT)
        self.closed = False
        self.live: dict[int, str] = {}  # handle -> engine request id, of the requests in the engine
        self.prompt_logprobs_sent: set[int] = set()
        self.pending = StepOutputs()
        self._lock = threading.Lock()  # the engine loop and the failure hook (watchdog thread) both send

    @property
    def pid(self) -> int:
        return self._pid if self._pid is not None else -1

    def returncode(self) -> int | None:
        """The process's exit code once it is gone (-1 when it is not this process's child), else None
        (always None for a frontend on another node: its connection tells)."""
        if self.proc is not None:
            return self.proc.poll()
        if self._pid is None:
            return None
        return None if pid_alive(self.pid) else -1

    def wait(self, timeout: float) -> int:
        """Wait up to ``timeout`` s for the process to exit; raises TimeoutError if it is still there."""
        if self.proc is not None:
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                raise TimeoutError from None
        if self._pid is None:
            return self._wait_eof(timeout)
        deadline = time.monotonic() + timeout
        while (code := self.returncode()) is None:
            if time.monotonic() > deadline:
                raise TimeoutError
            time.sleep(0.05)
        return code

    def _wait_eof(self, timeout: float) -> int:
        """A frontend on another node: -1 once its connection ends (what it still sends is dropped)."""
        deadline = time.monotonic() + timeout
        while not self.closed and (left := deadline - time.monotonic()) > 0:
            if not select.select([self.sock], [], [], left)[0]:
                break
            try:
                if not self.sock.recv(1 << 16):
                    return -1
            except OSError:
                return -1
        raise TimeoutError

    def send(self, data: bytes) -> bool:
        """Write one or more frames; False when the frontend is gone or hung (it is killed then)."""
        if self.closed:
            return False
        with self._lock:
            try:
                self.sock.sendall(data)
                return True
            except TimeoutError:
                logger.error("API frontend %d (pid %d) read nothing for %.0f s: killing it", self.index, self.pid,
                             self.sock.gettimeout() or 0.0)
                self.kill()
            except OSError:
                pass
        return False

    def recv_frames(self) -> list[tuple[Kind, memoryview]] | None:
        """The frames that arrived (the socket is readable); None at EOF."""
        try:
            data = self.sock.recv(1 << 20, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return []
        except OSError:
            return None
        if not data:
            return None
        self.last_heard = time.monotonic()
        return self.reader.feed(data)

    def flush(self, stats: dict[str, float]) -> bool:
        """Send the OUTPUTS frame built during this step (with the engine's stats); False if the link broke."""
        out, self.pending = self.pending, StepOutputs()
        out.stats = stats
        return self.send(out.encode())

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:  # rank 0's child; a replica only closes
            try:
                self.proc.send_signal(signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass


def spawn_frontends(count: int, listen: socket.socket, hello: dict[str, Any], metrics_dir: str | None,
                    send_timeout_s: float) -> list[FrontendLink]:
    """Start ``count`` frontends serving on ``listen``; each gets HELLO (``hello`` plus its index).

    ``metrics_dir``: where they keep their metrics series, to be summed (None: each in its own memory).
    """
    links: list[FrontendLink] = []
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)  # (not a directory of this server's)
    if metrics_dir is not None:
        env["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    try:
        for i in range(count):
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            for s in (ours, theirs):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCK_BUF_BYTES)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCK_BUF_BYTES)
            cmd = [sys.executable, "-m", "rtp.server.frontend", "--index", str(i),
                   "--listen-fd", str(listen.fileno()), "--engine-fd", str(theirs.fileno())]
            proc = subprocess.Popen(cmd, pass_fds=(listen.fileno(), theirs.fileno()), env=env)
            theirs.close()
            link = FrontendLink(i, proc, ours, send_timeout_s)
            links.append(link)
            link.send(encode_hello({**hello, "index": i}))
    except BaseException:
        for link in links:
            link.kill()
            link.close()
        raise
    return links
