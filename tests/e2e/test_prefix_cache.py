"""Prefix caching end to end (TP=2): prompts sharing a long prefix compute it once, in one batch and across
batches, with the same output."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from rtp.testing import default_model_dir
from tests.utils import WORKERS, hf_greedy, torchrun

WORKER = WORKERS / "prefix_cache.py"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_shared_prefix_is_computed_once_and_output_is_unchanged(tmp_path):
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, 440, (160,), generator=g).tolist()  # 10 full blocks of 16
    suffix = lambda: torch.randint(0, 440, (5,), generator=g).tolist()  # noqa: E731
    first = [prefix + suffix() for _ in range(3)]
    second = [prefix + suffix() for _ in range(3)]
    (tmp_path / "prompts.json").write_text(json.dumps([first, second]))
    (tmp_path / "c.yaml").write_text(f"model: {default_model_dir()}\ndevice: cpu\ndtype: float32\nblock_size: 16\n"
                                     "num_kv_blocks: 256\nenable_prefix_caching: true\n")
    torchrun(WORKER, 2, str(tmp_path / "c.yaml"), str(tmp_path / "prompts.json"), str(tmp_path / "out.json"))
    a, b = json.loads((tmp_path / "out.json").read_text())

    # The first batch computes the prefix once (its other two prompts share the blocks the first one computes
    # in the same step); the second batch finds the 10 shared blocks of each prompt in the cache.
    assert a["hits"] >= 2 * 160 and 160 <= a["computed"] <= 165 + 2 * 5, a
    assert b["hits"] >= 3 * 160
    assert b["computed"] <= 3 * 5 + 3, b
    assert all(c >= 160 for c in b["cached"])

    hf = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32).eval()
    for batch, res in ((first, a), (second, b)):
        assert res["tokens"] == [hf_greedy(hf, p, 8) for p in batch]
