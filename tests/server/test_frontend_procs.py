"""Rank 0's helpers for its API frontend processes."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from rtp.server.frontend_procs import METRICS_DIR_PREFIX, metrics_dir


def test_metrics_dirs_of_dead_runs_are_removed_and_live_ones_kept():
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
