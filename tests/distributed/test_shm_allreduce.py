"""Shared-memory all-reduce and gather between torchrun ranks: exact sums, chunking, lost peers, no leaks."""

from __future__ import annotations

import re

import pytest

from rtp.distributed import shm_allreduce
from tests.utils import HAS_CXX, WORKERS, torchrun

WORKER = WORKERS / "shm_allreduce.py"

pytestmark = pytest.mark.skipif(not shm_allreduce.supported(), reason="needs x86-64 store ordering")


@pytest.mark.parametrize("path", ["check", "check-torch"])
@pytest.mark.parametrize("nproc", [2, 3])
def test_collectives_equal_the_reference_on_every_rank(nproc: int, path: str) -> None:
    # Bitwise: the C++ piece adds the slots in the same order with the same roundings as the torch path.
    out = torchrun(WORKER, nproc, path, timeout=300)
    assert out.stdout.count(": OK") == nproc, out.stdout
    kernel = path == "check" and HAS_CXX
    assert out.stdout.count(f": kernel {'yes' if kernel else 'no'}") == nproc, out.stdout


def test_a_dead_peer_is_an_error_not_a_hang() -> None:
    out = torchrun(WORKER, 2, "dead", timeout=120, check=False)
    assert "rank 0: rank 1 (pid" in out.stdout and "died during a collective" in out.stdout, out.stdout + out.stderr
    assert out.returncode != 0


def test_a_hung_peer_is_an_error_within_the_liveness_timeout() -> None:
    out = torchrun(WORKER, 2, "hung", timeout=120, check=False)
    m = re.search(r"rank 0 after ([\d.]+) s: rank 1 \(pid \d+\) stopped responding: no heartbeat for [\d.]+ s",
                  out.stdout)
    assert m, out.stdout + out.stderr[-3000:]
    # HUNG_TIMEOUT_S, not the 20 s collective timeout; the last beat may predate the stop by an interval or two.
    assert 1.7 <= float(m.group(1)) < 2.0 + 1.5
    assert out.returncode != 0


def test_a_failed_run_aborts_a_waiting_collective() -> None:
    out = torchrun(WORKER, 2, "abort", timeout=120, check=False)
    m = re.search(r"rank 0 after ([\d.]+) s: collective \d+ aborted: the run failed", out.stdout)
    assert m and float(m.group(1)) < 2.0, out.stdout + out.stderr[-3000:]
