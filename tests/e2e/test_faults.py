"""Failures never hang: dead, stopped and orphaned ranks, stuck steps, SIGTERM, bad configs, runs side by side.

Every run goes through torchrun (gloo, CPU) with the random tiny model of rtp.testing. The
liveness tests use a config with a short ``liveness_timeout_s`` so that each
costs a few seconds beyond its bound.
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
import yaml
from safetensors.torch import load_file, save_file

from rtp.distributed.liveness import pid_alive
from rtp.entrypoints.generate import DEMO_PROMPTS
from rtp.testing import default_model_dir, make_tiny_qwen3
from tests.utils import REPO, rank_pids

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
BOUND_S = 30.0  # generous bound for the failures that do not depend on liveness_timeout_s
LIVENESS_S = 4.0  # liveness_timeout_s of the heartbeat tests


def config_file(tmp_path: Path, **overrides: object) -> Path:
    """configs/cpu.yaml in float32 (outputs are compared across runs) with ``overrides``, in a file of its own."""
    data = yaml.safe_load((REPO / "configs" / "cpu.yaml").read_text())
    data.update({"dtype": "float32", **overrides})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


class Run:
    """A torchrun launch in its own process group, with its output collected in the background."""

    def __init__(self, nproc: int, *args: str, env: dict[str, str] | None = None) -> None:
        if "launch/generate.py" in args and "--model" not in args:
            args = (*args, "--model", str(default_model_dir()))  # the random tiny model, not the trained default
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
        full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.pids: dict[int, int] = {}  # the ranks seen by rank_pids(), killed by kill()
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
        pids = rank_pids(self.proc.pid)
        self.pids.update(pids)
        return pids

    def wait_gone(self, pids: list[int], timeout: float) -> float:
        """Seconds until none of ``pids`` is alive; fails after ``timeout``."""
        t0 = time.monotonic()
        while any(pid_alive(p) for p in pids):
            assert time.monotonic() - t0 < timeout, f"still running after {timeout} s:\n{self.output[-3000:]}"
            time.sleep(0.05)
        return time.monotonic() - t0

    def wait(self, timeout: float) -> int:
        rc = self.proc.wait(timeout=timeout)
        self._reader.join(5)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        # torchrun starts every rank in a session of its own: a failed test must not leave one behind.
        for pid in self.pids.values():
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def segments_of(pid: int) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"rtp_{pid}_")]


@pytest.fixture
def long_job(tmp_path):
    """A generation that runs for minutes unless interrupted.

    1024 requests of 1900 tokens: four waves of cpu.yaml's 256 running sequences, about 1.5 minutes on
    two cores. Eight such requests took under 2 s once decoding got fast, and the job then ended before
    the fault it was started for.
    """
    prompts = tmp_path / "long.jsonl"
    line = {"prompt": "Once upon a time", "max_tokens": 1900, "ignore_eos": True, "temperature": 0.0}
    prompts.write_text((json.dumps(line) + "\n") * 1024)
    runs: list[Run] = []

    def start(config: Path | None = None, env: dict[str, str] | None = None) -> Run:
        extra = ["--config", str(config)] if config is not None else []
        run = Run(2, "launch/generate.py", "--prompts-file", str(prompts), "--output", str(tmp_path / "out.jsonl"),
                  *extra, env=env)
        runs.append(run)
        run.wait_for("generate:")
        run.rank_pids()
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


def test_sigstop_worker_is_caught_by_its_heartbeat(long_job, tmp_path):
    run = long_job(config_file(tmp_path, liveness_timeout_s=LIVENESS_S))
    pids = run.rank_pids()
    time.sleep(1.0)
    t0 = time.monotonic()
    os.kill(pids[1], signal.SIGSTOP)  # alive but not running: only its heartbeat can tell
    rc = run.wait(timeout=LIVENESS_S + 30)
    elapsed = time.monotonic() - t0
    assert rc != 0
    assert elapsed < LIVENESS_S + 5, f"took {elapsed:.1f} s:\n{run.output[-3000:]}"
    line = rf"rank 1 \(pid {pids[1]}\) stopped responding: no heartbeat for \d+\.\d s"
    assert re.search(r"\nerror: " + line, run.output), run.output[-3000:]  # the launcher's one-line error
    run.wait_gone(list(pids.values()), 5)  # the stopped rank was killed, not left for torchrun's 30 s
    assert not segments_of(pids[0]), "the run's shared-memory segment was left behind"


def test_sigstop_coordinator_stops_the_workers(long_job, tmp_path):
    run = long_job(config_file(tmp_path, liveness_timeout_s=LIVENESS_S))
    pids = run.rank_pids()
    time.sleep(1.0)
    t0 = time.monotonic()
    os.kill(pids[0], signal.SIGSTOP)
    rc = run.wait(timeout=LIVENESS_S + 30)
    elapsed = time.monotonic() - t0
    assert rc != 0
    assert elapsed < LIVENESS_S + 5, f"took {elapsed:.1f} s:\n{run.output[-3000:]}"
    line = rf"rank 0 \(pid {pids[0]}\) stopped responding: no heartbeat for \d+\.\d s; rank 1 exits"
    assert re.search(line, run.output), run.output[-3000:]
    run.wait_gone(list(pids.values()), 5)
    assert not segments_of(pids[0]), "the stopped coordinator's segment was not removed"


def test_killed_torchrun_agent_leaves_no_orphan(long_job, tmp_path):
    run = long_job(config_file(tmp_path, liveness_timeout_s=LIVENESS_S))
    pids = run.rank_pids()
    time.sleep(1.0)
    os.kill(run.proc.pid, signal.SIGKILL)  # an OOM killer or `kill -9` of the job: the ranks get no signal
    run.proc.wait()
    elapsed = run.wait_gone(list(pids.values()), 10)
    run._reader.join(5)  # the ranks held the output pipe: it ends when the last one exits
    assert elapsed < 10
    assert re.search(rf"rank \d \(pid \d+\) lost its launcher: the torchrun agent \(pid {run.proc.pid}\) is gone",
                     run.output), run.output[-3000:]
    assert not segments_of(pids[0]), "the orphaned coordinator did not remove its segment"


def test_a_long_step_is_not_a_hung_rank_but_a_stuck_step_is_reported_with_stacks(long_job, tmp_path):
    liveness_s, step_s = 3.0, 6.0
    # Rank 1 sleeps 60 s inside step 5: its main thread stops, its heartbeat thread does not.
    run = long_job(config_file(tmp_path, liveness_timeout_s=liveness_s, step_timeout_s=step_s),
                   env={"RTP_TEST_STEP_DELAY": "1:5:60"})
    pids = run.rank_pids()
    t0 = time.monotonic()
    rc = run.wait(timeout=step_s + 30)
    assert rc != 0
    assert time.monotonic() - t0 < step_s + 8, run.output[-3000:]
    out = run.output
    assert "stopped responding" not in out, out[-3000:]  # beyond liveness_timeout_s, yet not taken for hung
    error = ("\nerror: step 5 did not finish within 6 s: rank 1 had not finished it "
             "(rank 0 was waiting for it in a collective); Python stacks of ranks 0, 1 are in the log")
    assert error in out, out[-4000:]
    for rank in (0, 1):
        assert f"rank {rank} (pid {pids[rank]}): Python stacks follow" in out
    # faulthandler's dump of rank 1's main thread shows where it is stuck: the test hook's sleep.
    assert re.search(r'File "[^"]*rtp/runtime/fault_injection\.py", line \d+ in apply', out), out[-4000:]
    assert out.count("most recent call first") >= 4  # every thread of both ranks (main, heartbeat, watchdog...)
    run.wait_gone(list(pids.values()), 5)
    assert not segments_of(pids[0])


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
    # The demo: each prompt's greedy continuation, then each prompt's seeded sample (the same in both runs).
    assert outs[0] == outs[1] and outs[0].count("\n") == 2 * len(DEMO_PROMPTS)


def test_init_after_shutdown_of_a_multi_rank_job_is_refused_not_hung(tmp_path):
    """The worker ranks exit at shutdown(): a second init() would wait for them forever; it says so at once."""
    script = tmp_path / "reinit.py"
    script.write_text(
        "import rtp\n"
        f"kw = dict(model={str(default_model_dir())!r}, dtype='float32')\n"
        f"rtp.init({str(REPO / 'configs' / 'cpu.yaml')!r}, **kw)\n"
        "rtp.generate(['a'], rtp.SamplingParams(max_tokens=2), use_tqdm=False)\n"
        "rtp.shutdown()\n"
        "try:\n"
        f"    rtp.init({str(REPO / 'configs' / 'cpu.yaml')!r}, **kw)\n"
        "except rtp.RtpError as e:\n"
        "    print('refused:', e)\n")
    run = Run(2, str(script))
    try:
        rc = run.wait(timeout=120)
    finally:
        run.kill()
    assert rc == 0 and "refused: rtp.init() after rtp.shutdown() of a 2-rank job" in run.output, run.output[-3000:]


@pytest.mark.parametrize(
    "nproc, args, words",
    [
        (2, ["--config", "{tp1}"], ["tensor_parallel_size", "1", "2"]),  # TP fixed at 1, started with 2 ranks
        (3, [], ["num_attention_heads=4", "3"]),  # 4 heads cannot be split 3 ways
        (2, ["--config", "{bad_key}"], ["blok_size", "block_size"]),
        (2, ["--config", "{bad_value}"], ["max_num_seqs", "-1"]),
        (2, ["--model", "/nonexistent/model"], ["/nonexistent/model"]),
        # a tensor only the last pipeline stage loads: rank 0 (the first stage) names it
        (2, ["--model", "{stage_bad}", "-pp", "2"], ["rank 1", "missing", "model.layers.1.mlp.down_proj.weight"]),
    ],
)
def test_bad_setup_gives_one_clear_error_and_every_rank_fails(tmp_path, nproc, args, words):
    (tmp_path / "tp1.yaml").write_text("tensor_parallel_size: 1\ndevice: cpu\n")
    (tmp_path / "bad_key.yaml").write_text("blok_size: 16\n")
    (tmp_path / "bad_value.yaml").write_text("max_num_seqs: -1\n")
    files = {name: tmp_path / f"{name}.yaml" for name in ("tp1", "bad_key", "bad_value")}
    if "{stage_bad}" in args:
        files["stage_bad"] = make_tiny_qwen3(tmp_path / "stage_bad")  # two layers, one a stage
        weights = tmp_path / "stage_bad" / "model.safetensors"
        tensors = load_file(weights)
        del tensors["model.layers.1.mlp.down_proj.weight"]
        save_file(tensors, weights)
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


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_lost_pipeline_stage_ends_the_run(long_job, tmp_path, sig):
    # PP=2 on 2 ranks: rank 1 is the whole last stage, and rank 0 waits on it point-to-point.
    run = long_job(config_file(tmp_path, liveness_timeout_s=LIVENESS_S, pipeline_parallel_size=2))
    pids = run.rank_pids()
    time.sleep(1.0)
    t0 = time.monotonic()
    os.kill(pids[1], sig)
    rc = run.wait(timeout=LIVENESS_S + 30)
    elapsed = time.monotonic() - t0
    assert rc != 0
    # A stopped stage: rank 0's main thread can sit in the point-to-point receive, where nothing is checked;
    # then it leaves 3 s after the failure (step_transport's exit grace), on top of the liveness timeout.
    grace = 3.0 if sig == signal.SIGSTOP else 0.0
    assert elapsed < LIVENESS_S + grace + 5, f"took {elapsed:.1f} s:\n{run.output[-3000:]}"
    what = "died" if sig == signal.SIGKILL else "stopped responding"
    assert re.search(rf"rank 1 \(pid {pids[1]}\) {what}", run.output), run.output[-3000:]
    run.wait_gone(list(pids.values()), 5)
    assert not segments_of(pids[0]), "the run's shared-memory segment was left behind"
