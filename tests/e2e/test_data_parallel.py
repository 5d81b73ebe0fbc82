"""Data parallelism offline: launch/generate.py at DP=2 x TP=1 and DP=2 x TP=2 against HF's greedy output.

Each replica is a full engine; rank 0 spreads the batch round-robin over the
replicas' coordinators and writes the outputs in input order. The prompts mix
lengths (1 to 150 tokens) so each replica gets long and short ones, and the
small token budget makes the long ones prefill in chunks.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from rtp.distributed.liveness import pid_alive
from rtp.testing import default_model_dir
from tests.e2e.test_faults import LIVENESS_S, Run, config_file, segments_of
from tests.utils import hf_greedy, torchrun

LENGTHS = [1, 150, 7, 33, 64, 2, 100, 17, 129]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp")
    model = default_model_dir()
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in LENGTHS]
    lines = [{"prompt_token_ids": p, "temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
             for p in prompts]
    (root / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (root / "dp.yaml").write_text(
        f"model: {model}\ndevice: cpu\ndtype: float32\nblock_size: 16\nnum_kv_blocks: 64\n"
        "max_num_batched_tokens: 64\nmax_num_seqs: 8\nlog_level: INFO\n"
    )
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    return root, ref


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("tp", [1, 2])
def test_data_parallel_generate_matches_hf_in_input_order(workload, tp):
    root, ref = workload
    out = root / f"out{tp}.jsonl"
    proc = torchrun("launch/generate.py", 2 * tp, "--config", str(root / "dp.yaml"), "--data-parallel-size", "2",
                    "--prompts-file", str(root / "in.jsonl"), "--output", str(out))
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["token_ids"] for r in results] == ref
    # Both replicas' coordinators (global ranks 0 and TP) generated their round-robin share.
    counts = {int(rank): int(n) for rank, n in
              re.findall(r"\[rank(\d+)\] INFO rtp.runtime.coordinator: generated (\d+) requests", proc.stderr)}
    assert counts == {0: (len(LENGTHS) + 1) // 2, tp: len(LENGTHS) // 2}, proc.stderr[-3000:]
    assert "replica 1: shutdown" in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_rank_of_another_replica_ends_the_whole_run(tmp_path):
    # DP = 2 x TP = 2; rank 3 is replica 1's worker: every rank's watchdog (all replicas) sees it go.
    prompts = tmp_path / "long.jsonl"
    line = {"prompt": "Once upon a time", "max_tokens": 1900, "ignore_eos": True, "temperature": 0.0}
    prompts.write_text((json.dumps(line) + "\n") * 8)
    config = config_file(tmp_path, liveness_timeout_s=LIVENESS_S)
    run = Run(4, "launch/generate.py", "--prompts-file", str(prompts), "--output", str(tmp_path / "out.jsonl"),
              "--config", str(config), "--data-parallel-size", "2")
    try:
        run.wait_for("generate:")
        pids = run.rank_pids()
        assert sorted(pids) == [0, 1, 2, 3]
        time.sleep(1.0)
        t0 = time.monotonic()
        os.kill(pids[3], signal.SIGKILL)
        rc = run.wait(timeout=LIVENESS_S + 30)
        assert time.monotonic() - t0 < LIVENESS_S + 10, "the whole run should end within the liveness bound"
        assert rc != 0
        assert re.search(rf"rank 3 \(pid {pids[3]}\) died", run.output), run.output[-3000:]
        assert not any(pid_alive(p) for p in pids.values()), "orphan rank processes"
        assert not any(segments_of(p) for p in pids.values()), "a shared-memory segment was left behind"
    finally:
        run.kill()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_prompt_refused_by_another_replica_names_its_line(workload):
    root, _ = workload
    bad = root / "bad.jsonl"
    lines = [{"prompt_token_ids": [5] * n, "max_tokens": 4} for n in (3, 4, 5)] + [{"prompt_token_ids": [5] * 5000}]
    bad.write_text("".join(json.dumps(x) + "\n" for x in lines))
    # Line 4 (index 3) is replica 1's share; its refusal reaches rank 0 and names the line of the file.
    proc = torchrun("launch/generate.py", 2, "--config", str(root / "dp.yaml"), "--data-parallel-size", "2",
                    "--prompts-file", str(bad), "--output", str(root / "bad_out.jsonl"), check=False)
    assert proc.returncode != 0
    assert f"{bad}:4:" in proc.stdout + proc.stderr, proc.stderr[-3000:]
