"""The CPU kernel cache: a lock file left by a killed process must not make a later load wait."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rtp.kernels import cpu_ops
from tests.utils import HAS_CXX, REPO

pytestmark = pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler: the kernels cannot be built")


def test_a_leftover_build_lock_does_not_block_loading_a_built_kernel() -> None:
    module = cpu_ops.load()
    assert module is not None  # built (and cached) by now
    lock = Path(module.__file__).parent / "lock"  # where torch's loader keeps its build lock
    assert not lock.exists()
    lock.touch()  # what a rank killed inside torch's loader leaves behind
    try:
        # torch's loader would wait on the lock for ever; the cached build is imported directly.
        code = "from rtp.kernels import cpu_ops; assert cpu_ops.available()"
        out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
    finally:
        lock.unlink(missing_ok=True)
