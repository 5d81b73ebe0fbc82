"""bfloat16 on CPU: rtp's bf16 path (bf16 weights and KV cache, fp32 norms/RoPE/softmax) against HF.

Two bf16 implementations round differently, so token-exact equality with HF's bf16 run is not
expected: a near tie between two tokens flips one way or the other and the continuations part.
What must hold is that rtp's bf16 error against HF's float32 logits is of the size of HF's own
bf16 error, on the trained default model and on random ones.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rtp.assets import trained_model_dir
from rtp.distributed.parallel import ParallelState
from rtp.testing import make_tiny_qwen3
from tests.utils import SHAPES, hf_greedy
from tests.workers.model_tp import run_model

STEPS = 24
RANDOM = ("default", "odd_vocab_untied_sharded")


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(123)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (9, 1, 23, 40)]


def _relative(logits: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest per-row relative L2 distance of ``logits [rows, vocab]`` from ``ref``."""
    return ((logits.float() - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16")
    return {"trained": trained_model_dir(), **{n: make_tiny_qwen3(root / n, SHAPES[n]) for n in RANDOM}}


@pytest.mark.parametrize("name", ["trained", *RANDOM])
def test_bf16_logits_are_as_close_to_hf_fp32_as_hf_bf16_is(models, name):
    path = models[name]
    hf32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    prompts = _prompts(min(hf32.config.vocab_size, 3900))  # below the tokenizer's special ids
    got = run_model(ParallelState.single(), str(path), prompts, STEPS, dtype="bfloat16")
    with torch.no_grad():
        ref = torch.stack([hf32(torch.tensor([p])).logits[0, -1] for p in prompts])
        hf_bf16 = torch.stack([hf16(torch.tensor([p])).logits[0, -1] for p in prompts])
        hf_tokens = [hf_greedy(hf16, p, STEPS) for p in prompts]
    ours, theirs = _relative(got["logits"], ref), _relative(hf_bf16, ref)
    # Measured here: trained 0.009 (HF bf16 0.009), random 0.03-0.04 (HF 0.03-0.05).
    assert ours <= 1.5 * theirs + 2e-3, f"{name}: rtp bf16 {ours:.3e} vs HF bf16 {theirs:.3e} (relative to HF fp32)"
    assert ours < (0.02 if name == "trained" else 0.08), ours
    agree = (got["logits"].float().argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.75, f"{name}: next token equals HF fp32's for only {agree:.0%} of the prompts"
    # Greedy agreement with HF bf16: continuations part at a near tie, but not at once on every prompt.
    prefix = [_common_prefix(a, b) for a, b in zip(got["tokens"], hf_tokens)]
    assert sum(prefix) >= len(prompts) * STEPS // 4, f"{name}: common greedy prefix with HF bf16 {prefix}"
