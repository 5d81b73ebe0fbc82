"""Session set-up shared by every test module."""

from __future__ import annotations

import time

import pytest

from tests.utils import HAS_CXX


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build rtp's C++ CPU kernels once, before any multi-process test runs.

    On a fresh machine the first rank to need a kernel compiles it (15-20 s each on two cores) while
    the other ranks wait on the build lock: inside a multi-rank test that eats the test's own
    timeout. Built here, every later process finds them in the extension cache.
    """
    if not HAS_CXX or not any(item.get_closest_marker("slow") for item in session.items):
        return
    from rtp.kernels.cpu_build import load_all
    from rtp.runtime.model_runner import cpu_kernel_loaders

    start = time.monotonic()
    load_all(cpu_kernel_loaders(tp_size=2))  # every kernel: the TP tests need the all-reduce too
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"CPU kernels ready ({time.monotonic() - start:.1f} s)")
