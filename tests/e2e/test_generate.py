"""End to end through launch/generate.py: rtp at TP=1, 2, 4 against HF transformers' greedy output.

A small KV cache and a small token budget force preemption and chunked
prefill; the prompts have lengths from 1 to 200.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from rtp.testing import default_model_dir
from tests.utils import REPO, hf_greedy, torchrun

LENGTHS = [1, 2, 7, 16, 17, 33, 64, 100, 129, 150, 199, 200]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    model = default_model_dir()
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in LENGTHS]
    lines = [{"prompt_token_ids": p, "temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True, "logprobs": 2}
             for p in prompts]
    (root / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    # 24 blocks x 16 tokens = 384 slots for ~1,200 tokens of work: sequences must be preempted.
    # 48 tokens per step: prompts longer than that are prefilled in chunks.
    (root / "small.yaml").write_text(
        f"model: {model}\ndevice: cpu\ndtype: float32\nblock_size: 16\nnum_kv_blocks: 24\n"
        "max_num_batched_tokens: 48\nmax_num_seqs: 8\nlog_level: INFO\nenable_prefix_caching: false\n"
    )
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
        # log_softmax of HF's logits at every generated position: [MAX_TOKENS, vocab] per prompt
        ref_logprobs = [torch.log_softmax(hf(torch.tensor([p + r])).logits[0, len(p) - 1 : -1], -1)
                        for p, r in zip(prompts, ref)]
    return root, ref, ref_logprobs


def run_generate(root, tp: int) -> tuple[list[dict], str]:
    out = root / f"out{tp}.jsonl"
    args = ["--config", str(root / "small.yaml"), "--prompts-file", str(root / "in.jsonl"), "--output", str(out)]
    if tp == 1:
        proc = subprocess.run([sys.executable, "launch/generate.py", *args], cwd=REPO, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
    else:
        proc = torchrun("launch/generate.py", tp, *args)
    return [json.loads(line) for line in out.read_text().splitlines()], proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_generate_matches_hf_greedy_under_preemption_and_chunking(workload, tp):
    root, ref, ref_logprobs = workload
    results, log = run_generate(root, tp)
    assert len(results) == len(ref)
    for i, (r, want, lp) in enumerate(zip(results, ref, ref_logprobs)):
        assert r["token_ids"] == want, f"prompt {i} (length {LENGTHS[i]}) at TP={tp}"
        assert r["finish_reason"] == "length"
        # Top-2 log-probabilities of every position (plus the sampled token) equal HF's log_softmax.
        for pos, entry in enumerate(r["logprobs"]):
            top2 = set(lp[pos].topk(2).indices.tolist()) | {want[pos]}
            assert {int(t) for t in entry} == top2
            for token, value in entry.items():
                assert abs(value - lp[pos, int(token)].item()) < 1e-4
    m = re.search(r"(\d+) prompt tokens computed, (\d+) prefix-cache hits, (\d+) decode tokens, (\d+) preemptions", log)
    assert m, log[-3000:]
    computed, _, _, preemptions = map(int, m.groups())
    assert preemptions > 0, "the small cache should have forced preemption"
    # Without a prefix cache, recompute after preemption computes more tokens than the prompts hold.
    assert computed > sum(LENGTHS)
