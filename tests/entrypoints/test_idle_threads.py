"""A serving rank's idle OpenMP threads sleep (OMP_WAIT_POLICY=PASSIVE) instead of spinning on cores the API
frontends need; a policy or spin count the user set is kept."""

from __future__ import annotations

import os
import subprocess
import sys

from rtp.cli import idle_threads_sleep

SERVE_HELP = "from rtp.entrypoints.serve import main; main(['--help'])"


def test_passive_unless_the_user_chose():
    env: dict[str, str] = {}
    idle_threads_sleep(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}
    for mine in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "5000"}):
        env = dict(mine)
        idle_threads_sleep(env)
        assert env == mine


def _spin_count(code: str, **extra: str) -> str:
    """The spin count libgomp settled on in a fresh interpreter running ``code`` (it prints it at load)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(OMP_DISPLAY_ENV="VERBOSE", **extra)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in r.stderr.splitlines() if "GOMP_SPINCOUNT" in line]
    assert lines, r.stderr[-2000:]
    return lines[0].split("=")[1].strip().strip("'")


def test_the_serve_entry_point_sets_it_before_torch_loads():
    assert _spin_count("import torch") != "0"  # libgomp's default spins
    assert _spin_count(SERVE_HELP) == "0"  # the server's ranks: passive
    assert _spin_count(SERVE_HELP, GOMP_SPINCOUNT="5000") == "5000"  # the user's choice stays
