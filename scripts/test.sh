#!/usr/bin/env bash
# Set up a local virtualenv (first run only) and run the test suite.
#   bash scripts/test.sh                 # everything
#   bash scripts/test.sh tests/core -x   # any pytest arguments
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${RTP_VENV:-.venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# torch is pinned in pyproject.toml to the CPU build this machine ships (never an unpinned CUDA build).
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e '.[test,serve]' \
    2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)  # noise from this machine's pip config
# One BLAS thread per process: torchrun tests start several ranks on few cores.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
"$VENV/bin/ruff" check --quiet rtp launch scripts tests
"$VENV/bin/mypy"  # rtp/, configured in setup.cfg; any error fails the run
# Two tests at a time (pytest-xdist): a multi-rank test spends much of its time in start-up and waits
# with one core or none busy, so a second test fills the gaps (the suite takes ~0.8x the time).
# Each file's tests run on one worker, in their order (--dist loadfile): a file's module-scoped servers
# start once, and tests written to run last in their file (a SIGTERM to the server) do; work stealing
# could run a test after them on a server they had stopped.
# RTP_TEST_WORKERS=0 runs the tests one after the other.
# (nproc without the OMP variables: GNU nproc reports OMP_NUM_THREADS, set to 1 above, as the core count)
CORES="$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)"
WORKERS="${RTP_TEST_WORKERS:-$(( CORES < 2 ? CORES : 2 ))}"
XDIST=()
if [ "$WORKERS" -gt 1 ]; then XDIST=(-n "$WORKERS" --dist loadfile); fi
exec "$VENV/bin/python" -m pytest "${XDIST[@]}" "$@"
