"""Helpers shared by the entry points (rtp/entrypoints, run by launch/ and the rtp command), which may print."""

from __future__ import annotations

import argparse
import atexit
import os
import sys
import time
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
