"""Shared-memory all-reduce and gather between torchrun ranks: exact sums, chunking, dead peers, no leaks."""

from __future__ import annotations

import pytest

from rtp.dist import shm_allreduce
from tests.utils import REPO, torchrun

WORKER = REPO / "tests" / "dist" / "allreduce_worker.py"

pytestmark = pytest.mark.skipif(not shm_allreduce.supported(), reason="needs x86-64 store ordering")


@pytest.mark.parametrize("nproc", [2, 3])
def test_collectives_equal_the_reference_on_every_rank(nproc: int) -> None:
    out = torchrun(WORKER, nproc, "check", timeout=300)
    assert out.stdout.count(": OK") == nproc, out.stdout


def test_a_dead_peer_is_an_error_not_a_hang() -> None:
    out = torchrun(WORKER, 2, "dead", timeout=120, check=False)
    assert "rank 0: rank 1 (pid" in out.stdout and "died during a collective" in out.stdout, out.stdout + out.stderr
    assert out.returncode != 0
