"""Speculative decoding at TP = 2 (torchrun, gloo), n-gram, draft model and EAGLE-3: greedy output equals HF
transformers', with chunked prefill and preemption, and the worker rank's mirror follows every rollback
of rejected drafts."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from rtp.testing import default_model_dir
from tests.spec.drafts import noisy_draft, write_eagle3_head
from tests.utils import WORKERS, hf_greedy, torchrun

WORKER = WORKERS / "spec_decode.py"


def _tp2_greedy_equals_hf(tmp_path, prompts: list[list[int]], speculative: str) -> dict:
    """Greedy with ``speculative`` (the YAML lines under speculative_config) at TP = 2 under torchrun: 20
    tokens per step chunk the prompts next to other sequences' drafts, and 10 blocks of 16 cannot hold all
    of them. Checks the tokens equal HF's; returns the worker's output (tokens and engine stats)."""
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    (tmp_path / "c.yaml").write_text(
        f"model: {default_model_dir()}\ndevice: cpu\ndtype: float32\nblock_size: 16\nnum_kv_blocks: 10\n"
        f"max_num_batched_tokens: 20\nspeculative_config:\n{speculative}")
    torchrun(WORKER, 2, str(tmp_path / "c.yaml"), str(tmp_path / "prompts.json"), str(tmp_path / "out.json"))
    out = json.loads((tmp_path / "out.json").read_text())
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32).eval()
    assert out["tokens"] == [hf_greedy(hf, p, 32) for p in prompts]
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tp2_greedy_with_ngram_drafts_equals_hf(tmp_path):
    gen = torch.Generator().manual_seed(5)
    prompts = [(torch.randint(0, 400, (p,), generator=gen).tolist() * 12)[:n]
               for p, n in [(2, 6), (3, 40), (4, 70), (5, 23)]]
    out = _tp2_greedy_equals_hf(tmp_path, prompts, "  method: ngram\n  num_speculative_tokens: 4\n")
    assert out["stats"]["spec_num_accepted_tokens"] > 0 and out["stats"]["num_preemptions"] > 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tp2_greedy_with_a_draft_model_equals_hf(tmp_path):
    """The draft runs on rank 0 alone (draft_tensor_parallel_size 1) beside a target split over 2 ranks."""
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 500, (n,), generator=gen).tolist() for n in (3, 40, 70, 23)]
    out = _tp2_greedy_equals_hf(tmp_path, prompts, f"  method: draft_model\n  model: {noisy_draft()}\n"
                                "  num_speculative_tokens: 3\n  draft_tensor_parallel_size: 1\n"
                                "  min_acceptance_rate: 0.0\n")
    stats = out["stats"]
    assert stats["num_preemptions"] > 0
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]  # accepted and rejected drafts


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tp2_greedy_with_an_eagle3_head_equals_hf(tmp_path):
    """The head runs on rank 0 from rank 0's auxiliary hidden states (the residual stream is replicated) and
    its own copy of the target's embedding (rank 0 holds only a vocabulary shard of it)."""
    head = write_eagle3_head(tmp_path / "head", default_model_dir())
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 500, (n,), generator=gen).tolist() for n in (3, 40, 70, 23)]
    out = _tp2_greedy_equals_hf(tmp_path, prompts, f"  method: eagle3\n  model: {head}\n"
                                "  num_speculative_tokens: 3\n  min_acceptance_rate: 0.0\n")
    stats = out["stats"]
    assert stats["num_preemptions"] > 0 and stats["spec_num_draft_tokens"] > 100
