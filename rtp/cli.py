"""Helpers shared by the entry points (rtp/entrypoints, run by launch/ and the rtp command), which may print."""

from __future__ import annotations

import argparse
import atexit
import os
import sys
import time
from collections.abc import MutableMapping
from typing import NoReturn

from rtp.distributed.liveness import exit_now
from rtp.errors import RtpError


def add_common_args(ap: argparse.ArgumentParser) -> None:
    """--config and --model, the same on every launcher."""
    ap.add_argument("--config", help="YAML config (default: configs/cpu.yaml)")
    ap.add_argument("--model", help="HF Qwen3 checkpoint folder (overrides the config's model)")


def fail(error: RtpError) -> int:
    """Report a user-facing error once per node (on its local rank 0) and return the exit code every rank uses.

    Every rank hits the same config or shape error; only each node's first rank prints it (rank 0 on
    one node), so every node's log says why. The others wait a moment before exiting so that
    torchrun, which stops the whole group at the first failure, does not cut the printer off.
    """
    if int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))) == 0:
        sys.stderr.write(f"error: {error}\n")  # one write: a log line from another thread cannot split it
        sys.stderr.flush()
    else:
        time.sleep(2.0)
    return 1


def exit_process(code: int) -> NoReturn:
    """End an entry point's process with ``code`` once its work is done and rtp is shut down: the atexit
    handlers run as at a normal exit, then :func:`rtp.distributed.liveness.exit_now` skips the
    interpreter's finalization, where gloo's destructors aborted rank 0 of a two-node pipeline run
    ("terminate called without an active exception") after all its work was written. Worker ranks end
    through ``exit_now`` too (rtp/runtime/startup.py).
    """
    atexit._run_exitfuncs()
    exit_now(code)


def idle_threads_sleep(environ: MutableMapping[str, str] = os.environ) -> None:
    """Make a serving rank's idle OpenMP threads sleep rather than spin: ``OMP_WAIT_POLICY=PASSIVE`` unless the
    user chose a policy or a spin count. Call before torch is imported (libgomp reads it when it loads).

    A rank's compute threads share the host's cores with the API frontends (and rank 0's own event loop).
    By default libgomp's idle threads spin up to 300,000 rounds (milliseconds) between parallel regions: through
    every Python gap of a step, on a core a frontend needs. Served on a 2-core host (shipped model, TP = 1, two
    compute threads, one frontend, 256 streams of 128 + 128 tokens), rank 0 used 30-38 s of CPU spinning
    included against 19-24 s passive, and passive waits served 1.18x-1.54x the tokens a second (96 streams of
    128 + 64: 1.11x and 1.37x, TTFT 0.86-0.92x). The cost: one request alone waits a thread's wake-up per
    parallel region, its time per token 3.5-3.7 ms against 2.9-3.3 (the shipped model's short steps). Offline
    ``generate()`` keeps spinning threads (passive ones cost it 0.85-0.92x: nothing else wants the cores there).
    """
    if "OMP_WAIT_POLICY" not in environ and "GOMP_SPINCOUNT" not in environ:
        environ["OMP_WAIT_POLICY"] = "PASSIVE"
