"""rtp.generate / rtp.generate_stream input handling (one rank, in a fresh process)."""

import os
import subprocess
import sys

import pytest

from tests.utils import REPO, WORKERS


@pytest.mark.timeout(300)
def test_generate_api_forms_and_bookkeeping():
    script = WORKERS / "offline_api.py"
    proc = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=280,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-4000:]
