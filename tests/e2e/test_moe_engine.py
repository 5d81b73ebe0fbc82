"""The engine with a tiny Qwen3-MoE at TP=2: prefix caching, and preemption with chunked prefill.

Both compare with transformers.Qwen3MoeForCausalLM's greedy output token for token.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from rtp.testing import make_tiny_qwen3
from tests.utils import MOE_SHAPES, WORKERS, hf_greedy, torchrun

PREFIX_WORKER = WORKERS / "prefix_cache.py"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    path = make_tiny_qwen3(tmp_path_factory.mktemp("moe") / "m", MOE_SHAPES["moe_dense_layer"])
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.timeout(600)
def test_moe_shared_prefix_is_computed_once_and_output_is_unchanged(moe, tmp_path):
    path, hf = moe
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, 440, (96,), generator=g).tolist()  # 6 full blocks of 16
    suffix = lambda: torch.randint(0, 440, (5,), generator=g).tolist()  # noqa: E731
    first = [prefix + suffix() for _ in range(3)]
    second = [prefix + suffix() for _ in range(3)]
    (tmp_path / "prompts.json").write_text(json.dumps([first, second]))
    (tmp_path / "c.yaml").write_text(
        f"model: {path}\ndevice: cpu\ndtype: float32\nblock_size: 16\nnum_kv_blocks: 128\nenable_prefix_caching: true\n"
    )
    torchrun(PREFIX_WORKER, 2, str(tmp_path / "c.yaml"), str(tmp_path / "prompts.json"), str(tmp_path / "out.json"))
    a, b = json.loads((tmp_path / "out.json").read_text())
    assert a["hits"] >= 2 * 96 and 96 <= a["computed"] <= 101 + 2 * 5, a  # shared within the first batch's step
    assert b["hits"] >= 3 * 96
    assert b["computed"] <= 3 * 5 + 3, b
    with torch.no_grad():
        for batch, res in ((first, a), (second, b)):
            assert res["tokens"] == [hf_greedy(hf, p, 8) for p in batch]


@pytest.mark.timeout(600)
def test_moe_generate_matches_hf_under_preemption_and_chunking(moe, tmp_path):
    path, hf = moe
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 440, (n,), generator=g).tolist() for n in (1, 17, 60, 100, 130)]
    lines = [{"prompt_token_ids": p, "temperature": 0.0, "max_tokens": 12, "ignore_eos": True} for p in prompts]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    # 12 blocks x 16 slots for ~370 tokens of work: preemption; 48 tokens per step: chunked prefill.
    (tmp_path / "small.yaml").write_text(
        f"model: {path}\ndevice: cpu\ndtype: float32\nblock_size: 16\nnum_kv_blocks: 12\n"
        "max_num_batched_tokens: 48\nmax_num_seqs: 4\nlog_level: INFO\nenable_prefix_caching: false\n"
    )
    proc = torchrun("launch/generate.py", 2, "--config", str(tmp_path / "small.yaml"),
                    "--prompts-file", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"))
    results = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    with torch.no_grad():
        for i, (p, r) in enumerate(zip(prompts, results, strict=True)):
            assert r["token_ids"] == hf_greedy(hf, p, 12), f"prompt {i} (length {len(p)})"
    m = re.search(r"(\d+) preemptions", proc.stderr)
    assert m and int(m.group(1)) > 0, "the small cache should have forced preemption:\n" + proc.stderr[-3000:]
