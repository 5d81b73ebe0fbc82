"""Failures never hang: dead workers, a dead coordinator, SIGTERM, bad configs, runs side by side.

Every run goes through torchrun (gloo, CPU) with the tiny default model.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rtp.dist.liveness import pid_alive
from tests.utils import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
BOUND_S = 30.0  # the default liveness bound


class Run:
    """A torchrun launch in its own process group, with its output collected in the background."""

    def __init__(self, nproc: int, *args: str) -> None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.output = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.output += line

    def wait_for(self, text: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output:
            assert self.proc.poll() is None, f"exited early ({self.proc.returncode}):\n{self.output[-4000:]}"
            assert time.monotonic() < deadline, f"no {text!r} within {timeout} s:\n{self.output[-4000:]}"
            time.sleep(0.2)

    def rank_pids(self) -> dict[int, int]:
        """rank -> pid of torchrun's worker processes."""
        pids = {}
        children = subprocess.run(["ps", "--ppid", str(self.proc.pid), "-o", "pid="], capture_output=True, text=True)
        for pid in map(int, children.stdout.split()):
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            for item in env:
                if item.startswith(b"RANK="):
                    pids[int(item[5:])] = pid
        return pids

    def wait(self, timeout: float) -> int:
        rc = self.proc.wait(timeout=timeout)
        self._reader.join(5)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def segments_of(pid: int) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"rtp_{pid}_")]


@pytest.fixture
def long_job(tmp_path):
    """A generation that runs for minutes unless interrupted."""
    prompts = tmp_path / "long.jsonl"
    line = {"prompt": "Once upon a time", "max_tokens": 1900, "ignore_eos": True, "temperature": 0.0}
    prompts.write_text((json.dumps(line) + "\n") * 8)
    runs: list[Run] = []

    def start() -> Run:
        run = Run(2, "launch/generate.py", "--prompts-file", str(prompts), "--output", str(tmp_path / "out.jsonl"))
        runs.append(run)
        run.wait_for("generate:")
        return run

    yield start
    for run in runs:
        run.kill()


def test_sigkill_worker_fails_fast_and_names_the_rank(long_job):
    run = long_job()
    pids = run.rank_pids()
    time.sleep(1.0)
    t0 = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    rc = run.wait(timeout=BOUND_S + 30)
    assert time.monotonic() - t0 < 10, "the dead worker should be noticed within seconds"
    assert rc != 0
    assert re.search(r"rank 1 \(pid \d+\) died", run.output), run.output[-3000:]
    assert not segments_of(pids[0]), "the run's shared-memory segment was left behind"
    assert not any(pid_alive(p) for p in pids.values()), "orphan rank processes"


def test_sigkill_coordinator_stops_workers(long_job):
    run = long_job()
    pids = run.rank_pids()
    t0 = time.monotonic()
    os.kill(pids[0], signal.SIGKILL)
    while pid_alive(pids[1]):
        assert time.monotonic() - t0 < BOUND_S, "worker outlived the coordinator"
        time.sleep(0.2)
    assert run.wait(timeout=BOUND_S) != 0
    assert not segments_of(pids[0]), "the dead coordinator's segment was not cleaned up"


def test_sigterm_shuts_down_cleanly(long_job):
    run = long_job()
    pids = run.rank_pids()
    t0 = time.monotonic()
    run.proc.send_signal(signal.SIGTERM)
    rc = run.wait(timeout=BOUND_S + 30)
    assert time.monotonic() - t0 < BOUND_S
    assert rc in (0, 143, -15, 1), run.output[-3000:]  # 0 or the conventional signal code
    # torchrun prints its own traceback when it is signalled; the ranks must log no error.
    assert f'File "{REPO / "rtp"}' not in run.output and "ERROR" not in run.output, run.output[-3000:]
    assert "shutting down after the current step" in run.output
    assert not segments_of(pids[0])
    assert not any(pid_alive(p) for p in pids.values())


def test_two_runs_side_by_side(tmp_path):
    runs = [Run(2, "launch/generate.py", "--output", str(tmp_path / f"out{i}.jsonl"), "--max-tokens", "8")
            for i in range(2)]
    try:
        codes = [r.wait(timeout=240) for r in runs]
    finally:
        for r in runs:
            r.kill()
    assert codes == [0, 0], "\n\n".join(r.output[-3000:] for r in runs)
    outs = [(tmp_path / f"out{i}.jsonl").read_text() for i in range(2)]
    assert outs[0] == outs[1] and outs[0].count("\n") == 4


@pytest.mark.parametrize(
    "nproc, args, words",
    [
        (2, ["--config", "{tp1}"], ["tensor_parallel_size", "1", "2"]),  # TP fixed at 1, started with 2 ranks
        (3, [], ["num_attention_heads=4", "3"]),  # 4 heads cannot be split 3 ways
        (2, ["--config", "{bad_key}"], ["blok_size", "block_size"]),
        (2, ["--config", "{bad_value}"], ["max_num_seqs", "-1"]),
        (2, ["--model", "/nonexistent/model"], ["/nonexistent/model"]),
    ],
)
def test_bad_setup_gives_one_clear_error_and_every_rank_fails(tmp_path, nproc, args, words):
    (tmp_path / "tp1.yaml").write_text("tensor_parallel_size: 1\ndevice: cpu\n")
    (tmp_path / "bad_key.yaml").write_text("blok_size: 16\n")
    (tmp_path / "bad_value.yaml").write_text("max_num_seqs: -1\n")
    files = {name: tmp_path / f"{name}.yaml" for name in ("tp1", "bad_key", "bad_value")}
    args = [a.format(**files) for a in args]
    run = Run(nproc, "launch/generate.py", "--max-tokens", "4", *args)
    try:
        rc = run.wait(timeout=120)
    finally:
        run.kill()
    assert rc != 0
    errors = [line for line in run.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, run.output[-3000:]  # reported once, by rank 0
    for w in words:
        assert w in errors[0], errors[0]
    # torchrun prints its own summary traceback; none may come from rtp.
    for ours in ("rtp", "launch"):
        assert f'File "{REPO / ours}' not in run.output, run.output[-3000:]
