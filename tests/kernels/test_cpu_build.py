"""The CPU kernel cache: a lock file left by a killed process must not make a later load wait."""

from __future__ import annotations

import os
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


_ZEN4 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
cpu MHz\t\t: 2595.124
flags\t\t: fpu avx2 avx512f avx512_bf16
bogomips\t: 5190.24

processor\t: 1
vendor_id\t: AuthenticAMD
"""


def test_the_kernel_cache_tag_tells_apart_cpus_with_the_same_model_name() -> None:
    """A cache folder shared between a Zen 4 and a Zen 5 VM (both "AMD EPYC") must not hand one the other's
    -march=native build; the clock and bogomips, which change between boots, must not force a rebuild."""
    from rtp.kernels.cpu_build import _cpu_tag

    zen5 = _ZEN4.replace("cpu family\t: 25", "cpu family\t: 26").replace("model\t\t: 17", "model\t\t: 2") \
                .replace("avx512_bf16", "avx512_bf16 avx512_vp2intersect")
    other_flags = _ZEN4.replace("avx512_bf16", "avx512_bf16 avx512_vp2intersect")
    reboot = _ZEN4.replace("2595.124", "2600.000").replace("5190.24", "5200.00")
    assert _cpu_tag(_ZEN4) != _cpu_tag(zen5)
    assert _cpu_tag(_ZEN4) != _cpu_tag(other_flags)
    assert _cpu_tag(_ZEN4) == _cpu_tag(reboot)
    assert _cpu_tag(_ZEN4) == _cpu_tag(_ZEN4.replace("processor\t: 1", "processor\t: 1\ncpu MHz\t\t: 1"))


def test_load_all_builds_side_by_side_and_calls_every_loader_once(monkeypatch) -> None:
    """With two cores, two loaders run at once (each waits for the other at a barrier: run one after the other,
    they would time out); with one core they run in turn. Every loader is called exactly once."""
    import threading

    from rtp.kernels.cpu_build import load_all

    calls: list[str] = []
    barrier = threading.Barrier(2, timeout=30)

    def loader(name: str, meet: bool):
        def load():
            if meet:
                barrier.wait()
            calls.append(name)
            return None
        return load

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    load_all([loader("a", True), loader("b", True), loader("c", False)])
    assert sorted(calls) == ["a", "b", "c"]
    calls.clear()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    load_all([loader("a", False), loader("b", False)])
    assert calls == ["a", "b"]
