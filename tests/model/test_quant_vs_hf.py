"""Quantized checkpoints (Qwen's FP8 blocks, AutoAWQ GEMM) against transformers at TP = 1, 2, 4 and with EP.

The shapes put TP shard boundaries inside the 128 x 128 FP8 blocks (and inside AWQ's groups of
128 inputs): the dense MLP's 384 rows are 192 per rank at TP = 2 and 96 at TP = 4, the experts'
192 are 96 and 48, and two KV heads of 64 give 64 rows of k/v per rank (replicated at TP = 4).

References: the dense FP8 checkpoint runs in transformers itself (it dequantizes FP8 on CPU).
transformers mis-dequantizes a projection whose size is not a multiple of 128 (it takes the block
as ``rows // scale_rows``: 96-row blocks for the experts' 192 rows), so the MoE checkpoint, and
the AWQ one, are compared with transformers running a float64 checkpoint whose projections
``rtp.testing_quant`` dequantized from the quantized integers and scales it wrote (rtp's
loader plays no part in it). On the dense FP8 model that reference and transformers' own
FP8 loading agree, which the fixture checks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rtp.testing import TinyQwen3MoeSpec, TinyQwen3Spec, make_tiny_qwen3
from rtp.testing_quant import write_awq_checkpoint, write_fp8_checkpoint
from tests.utils import WORKERS, hf_greedy, torchrun

STEPS = 16
WORKER = WORKERS / "model_tp.py"
DIMS = dict(hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
DENSE = TinyQwen3Spec(**DIMS, seed=7)
MOE = TinyQwen3MoeSpec(**DIMS, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=192,
                       mlp_only_layers=(1,), seed=8)
AWQ = TinyQwen3Spec(**DIMS, tie_word_embeddings=False, seed=9)


def make_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(23)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in (11, 2, 23)]


def hf_outputs(path: Path, dtype: torch.dtype) -> dict:
    # The eager experts loop: the grouped-GEMM one has no float64 kernel on CPU.
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, experts_implementation="eager").eval()
    with torch.no_grad():
        logits = torch.stack([hf(torch.tensor([p])).logits[0, -1].float() for p in make_prompts()])
        return {"logits": logits, "tokens": [hf_greedy(hf, p, STEPS) for p in make_prompts()]}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """name -> (quantized checkpoint rtp loads, checkpoint transformers runs as the reference)."""
    root = tmp_path_factory.mktemp("quant")
    dense = write_fp8_checkpoint(make_tiny_qwen3(root / "dense", DENSE), root / "dense-fp8", root / "dense-ref")
    moe = write_fp8_checkpoint(make_tiny_qwen3(root / "moe", MOE), root / "moe-fp8", root / "moe-ref")
    awq = write_awq_checkpoint(make_tiny_qwen3(root / "awq", AWQ), root / "awq-int4", root / "awq-ref")
    return {"fp8_dense": (dense, dense), "fp8_moe": (moe, root / "moe-ref"), "awq_dense": (awq, root / "awq-ref")}


@pytest.fixture(scope="module")
def references(checkpoints) -> dict[str, dict]:
    ref = {}
    for name, (_, path) in checkpoints.items():
        ref[name] = hf_outputs(path, torch.float32 if name == "fp8_dense" else torch.float64)
        assert max(len(set(t)) for t in ref[name]["tokens"]) >= 8, f"{name}: degenerate greedy output"
    # transformers' own FP8 dequantization and the float64 reference agree where the former is right.
    own = hf_outputs(checkpoints["fp8_dense"][0].parent / "dense-ref", torch.float64)
    rel = ((own["logits"] - ref["fp8_dense"]["logits"]).norm(dim=-1) / own["logits"].norm(dim=-1)).max()
    assert rel < 1e-5 and own["tokens"] == ref["fp8_dense"]["tokens"], rel
    return ref


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_quantized_checkpoints_match_reference(tp, checkpoints, references, tmp_path):
    """Every checkpoint at ``tp``; at TP = 4 the MoE also with expert parallelism (2 of 8 experts per rank)."""
    out = tmp_path / "out.pt"
    moe = str(checkpoints["fp8_moe"][0])
    torchrun(WORKER, tp, "--out", str(out), "--prompts", json.dumps(make_prompts()), "--steps", str(STEPS),
             *[str(path) for path, _ in checkpoints.values()], *(["--ep-models", moe] if tp == 4 else []))
    saved = torch.load(out)
    runs = [(name, str(path), False) for name, (path, _) in checkpoints.items()]
    runs += [("fp8_moe", moe + "#ep", True)] if tp == 4 else []
    for name, key, ep in runs:
        ref, got = references[name], saved[key]
        rel = ((got["logits"] - ref["logits"]).norm(dim=-1) / ref["logits"].norm(dim=-1)).max().item()
        assert rel < 1e-4, f"{name} at TP={tp} EP={ep}: final-token logits differ by {rel:.2e} (relative)"
        for i, (want, have) in enumerate(zip(ref["tokens"], got["tokens"])):
            assert have == want, f"{name} TP={tp} EP={ep} prompt {i}: greedy tokens differ\nref: {want}\nrtp: {have}"
