"""rtp's Qwen3-MoE against transformers at TP = 1, 2 and 4 (and expert parallelism) through torchrun/gloo.

Each run covers both MoE shapes of ``tests.utils.MOE_SHAPES`` in one launch: a
chunked prefill, a mixed step (a prefill chunk plus decode rows) and 32 greedy
tokens through the paged KV cache.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from rtp.testing import make_tiny_qwen3
from tests.utils import MOE_SHAPES, WORKERS, hf_greedy, torchrun

STEPS = 32
WORKER = WORKERS / "model_tp.py"
VOCAB = 512
assert all(s.vocab_size == VOCAB for s in MOE_SHAPES.values()), "one prompt set for every shape"


def make_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(321)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (9, 1, 23, 40)]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {name: make_tiny_qwen3(root / name, spec) for name, spec in MOE_SHAPES.items()}


@pytest.fixture(scope="module")
def hf_reference(models) -> dict[str, dict]:
    """Final-token logits and 32 greedy tokens from transformers.Qwen3MoeForCausalLM, per model."""
    ref = {}
    for name, path in models.items():
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        assert type(hf).__name__ == "Qwen3MoeForCausalLM"
        with torch.no_grad():
            logits = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in make_prompts()])
        ref[name] = {"logits": logits, "tokens": [hf_greedy(hf, p, STEPS) for p in make_prompts()]}
    return ref


def checkpoint_bytes(path: Path, replicated: tuple[str, ...]) -> tuple[int, int]:
    """(all tensor bytes, bytes of the tensors every rank reads in full)."""
    total = rep = 0
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():
                size = torch.Size(st.get_slice(key).get_shape()).numel() * 4
                total += size
                rep += size if key.endswith(replicated) else 0
    return total, rep


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tp, ep", [(1, False), (2, False), (4, False), (2, True), (4, True)],
                         ids=["tp1", "tp2", "tp4", "tp2-ep", "tp4-ep"])
def test_moe_logits_and_greedy_tokens_match_transformers(tp, ep, models, hf_reference, tmp_path):
    out = tmp_path / "out.pt"
    torchrun(WORKER, tp, "--out", str(out), "--prompts", json.dumps(make_prompts()), "--steps", str(STEPS),
             "--mixed", *(["--expert-parallel"] if ep else []), *[str(p) for p in models.values()])
    saved = torch.load(out)
    for name, path in models.items():
        ref, got = hf_reference[name], saved[str(path)]
        rel = ((got["logits"] - ref["logits"]).norm(dim=-1) / ref["logits"].norm(dim=-1)).max().item()
        assert rel < 1e-4, f"{name} at TP={tp} EP={ep}: final-token logits differ from HF by {rel:.2e} (relative)"
        for i, (want, have) in enumerate(zip(ref["tokens"], got["tokens"])):
            assert have == want, f"{name} TP={tp} EP={ep} prompt {i}: greedy tokens differ\nHF:  {want}\nrtp: {have}"
        assert max(len(set(t)) for t in ref["tokens"]) >= 8, "degenerate model: greedy output repeats itself"
    # Each rank reads only its slice (TP: a slice of every expert; EP: its whole experts); only the
    # norms and the routers are read by every rank. Shape moe_top8_sharded has 4 KV heads and an
    # untied head, so nothing else is replicated at TP <= 4.
    path = models["moe_top8_sharded"]
    reads = saved[str(path)]["bytes_read_per_rank"]
    total, replicated = checkpoint_bytes(path, ("norm.weight", "mlp.gate.weight"))
    assert sum(reads) == total + (tp - 1) * replicated, (reads, total, replicated)
    if tp > 1:
        assert max(reads) < (1 / tp + 0.1) * total, f"a rank read {max(reads)} of {total} bytes at TP={tp}"
