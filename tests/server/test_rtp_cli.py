"""The ``rtp`` console script: ``rtp serve`` / ``rtp generate`` start torchrun through torch's API.

``rtp serve --nproc-per-node 2 --port 0`` answers the openai client with transformers' greedy
continuation, and SIGTERM to the ``rtp`` process stops every rank cleanly (exit 0, no process,
no shared-memory segment left); SIGTERM to ``rtp generate`` stops it the same way but exits 143 (its batch did
not finish). ``rtp generate`` takes its rank count from the config.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rtp.assets import trained_eagle3_dir
from rtp.testing import default_model_dir
from tests.server.test_serve_e2e import Server, kill, shm_segments, wait_ready
from tests.utils import hf_greedy, rank_pids

pytestmark = pytest.mark.slow

RTP = Path(sys.executable).with_name("rtp")  # the console script of this venv (pip install -e .)
EAGLE = {"method": "eagle3", "model": str(trained_eagle3_dir()), "num_speculative_tokens": 2}
CONFIG = "device: cpu\ndtype: float32\nblock_size: 16\ncpu_kv_cache_gib: 0.1\nenforce_eager: true\nlog_level: INFO\n"


def rtp_cmd() -> list[str]:
    if not RTP.exists():
        pytest.fail(f"{RTP} is missing: install rtp (pip install -e .) to get the `rtp` console script")
    return [str(RTP)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie has exited; only its parent's wait() is missing.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture(scope="module")
def hf():
    model = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(default_model_dir()))


@pytest.mark.timeout(240)
def test_rtp_serve_two_ranks_answers_and_stops_cleanly_on_sigterm(tmp_path, hf):
    config = tmp_path / "cpu.yaml"
    config.write_text(CONFIG + "server:\n  shutdown_grace_s: 2\n")
    log = tmp_path / "serve.log"
    cmd = [*rtp_cmd(), "serve", "--nproc-per-node", "2", "--port", "0", "--config", str(config),
           "--model", str(default_model_dir())]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own process group, killed in teardown
    server = Server(proc, log)
    try:
        wait_ready(server)
        ranks = rank_pids(proc.pid)  # the rtp process is torch's elastic agent: the ranks are its children
        assert sorted(ranks) == [0, 1], (ranks, server.text()[-3000:])
        assert ranks[0] == server.rank0_pid

        model, tok = hf
        prompt = "The quick brown fox"
        want = tok.decode(hf_greedy(model, tok.encode(prompt), 8))
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=8,
                                      temperature=0, extra_body={"ignore_eos": True})
        assert r.choices[0].text == want

        start = time.time()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
        text = server.text()
        assert rc == 0, text[-4000:]  # documented in rtp/launcher.py
        assert time.time() - start < 30
        assert "rtp.runtime.coordinator: shut down" in text, text[-4000:]
        assert "stopped by SIGTERM" in text
        assert not [pid for pid in ranks.values() if alive(pid)]
        assert shm_segments(server.rank0_pid) == []
    finally:
        kill(server)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_rtp_generate_stopped_by_a_signal_exits_128_plus_it_and_writes_nothing(tmp_path, sig):
    """An unfinished batch is not a success: SIGTERM (or SIGHUP, a closed terminal: torchrun forwards both) to
    `rtp generate` stops every rank at once and exits 128 + the signal."""
    config = tmp_path / "cpu.yaml"
    config.write_text(CONFIG)
    line = json.dumps({"prompt": "Once", "max_tokens": 1000, "ignore_eos": True}) + "\n"
    (tmp_path / "in.jsonl").write_text(line * 64)  # ~64k tokens: minutes
    log = tmp_path / "generate.log"
    cmd = [*rtp_cmd(), "generate", "--nproc-per-node", "2", "--config", str(config), "--prompts-file", "in.jsonl",
           "--output", "out.jsonl"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.time() + 120
        while "generate:" not in log.read_text(errors="replace"):  # the progress bar: generate() has begun
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
        ranks = rank_pids(proc.pid)
        start = time.time()
        proc.send_signal(sig)
        rc = proc.wait(60)
        text = log.read_text(errors="replace")
        assert rc == 128 + sig, text[-4000:]
        assert time.time() - start < 20  # SIGHUP was ignored by the ranks: torchrun killed them 45 s later
        assert f"stopped by {sig.name} before the batch finished" in text, text[-4000:]
        assert not (tmp_path / "out.jsonl").exists()
        assert not [pid for pid in ranks.values() if alive(pid)]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.timeout(120)
def test_a_shutdown_right_after_init_is_clean(tmp_path):
    """An empty prompts file: rank 0 shuts down as soon as init() returns, while rank 1 may still be attaching to
    the step channel (it found the channel gone, rank 0 waited 10 s at the barrier, rank 1 exited 1)."""
    config = tmp_path / "cpu.yaml"
    config.write_text(CONFIG)
    (tmp_path / "in.jsonl").write_text("")
    start = time.time()
    cmd = [*rtp_cmd(), "generate", "--nproc-per-node", "2", "--config", str(config), "--prompts-file", "in.jsonl",
           "--output", "out.jsonl"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=100)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "wrote 0 completions" in proc.stdout and (tmp_path / "out.jsonl").read_text() == ""
    assert "monitoredBarrier" not in proc.stderr and time.time() - start < 30, proc.stderr[-4000:]


@pytest.mark.timeout(240)
def test_rtp_generate_takes_the_rank_count_from_the_config(tmp_path, hf):
    config = tmp_path / "tp2.yaml"
    config.write_text(CONFIG + f"model: {default_model_dir()}\ntensor_parallel_size: 2\n")
    prompts = [[5, 6, 7, 8], [100, 3, 42]]
    (tmp_path / "in.jsonl").write_text("".join(
        json.dumps({"prompt_token_ids": p, "max_tokens": 6, "temperature": 0, "ignore_eos": True}) + "\n"
        for p in prompts))
    cmd = [*rtp_cmd(), "generate", "--config", str(config), "--prompts-file", "in.jsonl", "--output", "out.jsonl"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=220)
    # rtp refuses a world size other than the config's tensor_parallel_size: success means 2 ranks ran.
    assert proc.returncode == 0, proc.stderr[-4000:]
    outs = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    model, _ = hf
    assert [o["token_ids"] for o in outs] == [hf_greedy(model, p, 6) for p in prompts]


def test_bad_flags_and_configs_fail_before_any_rank_starts(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("block_size: -3\n")
    prompts, binary = tmp_path / "p.jsonl", tmp_path / "b.jsonl"
    prompts.write_text('{"prompt": "a"}\n')
    binary.write_bytes(b"\xff\xfe{}\n")
    for args, words in ((["serve", "--no-such-flag"], "unrecognized arguments"),
                        (["generate", "--config", str(bad)], "block_size"),
                        (["generate", "--nproc-per-node", "0"], "--nproc-per-node must be >= 1, got 0"),
                        (["generate", "--nproc-per-node", "3", "-pp", "2"], "3 is not a multiple of --pipeline"),
                        (["generate", "-pp", "2", "-dp", "2"], "with data_parallel_size=2 is not supported"),
                        (["generate", "-pp", "2", "--speculative-config", json.dumps(EAGLE)], "with pipeline"),
                        (["generate", "--batch-invariant", "--speculative-config", json.dumps(EAGLE)],
                         "with model.batch_invariant=true is not supported"),
                        (["generate", "--max-tokens", "0"], "max_tokens=0 is invalid"),
                        (["generate", "--model", str(tmp_path)], "is not a Hugging Face checkpoint folder"),
                        (["generate", "--prompts-file", str(tmp_path / "missing.jsonl")], "No such file"),
                        (["generate", "--prompts-file", str(tmp_path)], "cannot read the prompts file"),
                        (["generate", "--prompts-file", str(binary)], "cannot read the prompts file"),
                        (["generate", "--prompts-file", str(prompts), "--output", str(tmp_path / "no" / "o.jsonl")],
                         "cannot write a file into"),
                        (["generate", "--prompts-file", str(prompts), "--output", str(tmp_path)], "is a directory"),
                        (["frobnicate"], "unknown command")):
        proc = subprocess.run([*rtp_cmd(), *args], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert proc.returncode in (1, 2) and words in proc.stderr, proc.stderr
        assert "torch.distributed" not in proc.stderr and "Traceback" not in proc.stderr


def test_torchrun_arguments_are_built_with_torchs_parser():
    from rtp.launcher import Launch, torchrun_args

    args = torchrun_args("rtp.entrypoints.serve", Launch(3, 75), ["--port", "0"])
    assert args.standalone and args.module and args.nproc_per_node == "3" and args.shutdown_timeout == 75
    assert args.training_script == "rtp.entrypoints.serve" and args.training_script_args == ["--port", "0"]
