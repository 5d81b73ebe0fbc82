"""Helpers shared by the entry points (rtp/entrypoints, run by launch/ and the rtp command), which may print."""

from __future__ import annotations

import argparse
import os
import sys
import time

from rtp.errors import RtpError


def add_common_args(ap: argparse.ArgumentParser) -> None:
    """--config and --model, the same on every launcher."""
    ap.add_argument("--config", help="YAML config (default: configs/cpu.yaml)")
    ap.add_argument("--model", help="HF Qwen3 checkpoint folder (overrides the config's model)")


def fail(error: RtpError) -> int:
    """Report a user-facing error once (on rank 0) and return the exit code every rank uses.

    Every rank hits the same config or shape error; only rank 0 prints it.
    The others wait a moment before exiting so that torchrun, which stops the
    whole group at the first failure, does not cut rank 0 off before it prints.
    """
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"error: {error}", file=sys.stderr, flush=True)
    else:
        time.sleep(2.0)
    return 1
