"""Fused-MoE checks shared by the pytest tests and scripts/gpu_check.sh (no pytest needed).

    TRITON_INTERPRET=1 python -m tests.kernels.fused_moe_cases --device cpu   # Triton interpreter
    python -m tests.kernels.fused_moe_cases --device cuda [--bench]           # on a GPU

Every case compares :func:`fused_moe_triton` with the torch path on odd sizes: token
counts that are not a multiple of the row block, experts that get no tokens, top-1
and top-8 routing, and experts held by another rank (expert parallelism).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from rtp.kernels.fused_moe import align_by_expert, fused_moe_reference, fused_moe_triton

# (tokens, hidden, moe_intermediate, experts, top_k)
CASES = [
    (37, 64, 32, 8, 2),  # 74 pairs: not a multiple of the 16-row block
    (5, 48, 40, 16, 8),  # top-8; H and I not multiples of the column blocks
    (19, 32, 96, 4, 1),  # top-1
    (1, 64, 64, 16, 8),  # one token (decode): 8 experts busy, 8 idle
    (70, 64, 64, 16, 8),
]


def routing(num_tokens: int, num_experts: int, top_k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing where expert 0 and the last expert never receive a token."""
    logits = torch.randn(num_tokens, num_experts, generator=g)
    logits[:, 0] = logits[:, -1] = -1e9
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    return weights, ids


def check_align(g: torch.Generator) -> None:
    """Every row block holds one expert's pairs; every pair appears exactly once."""
    ids = torch.randint(0, 6, (13, 3), generator=g)
    ids[ids == 2] = 3  # expert 2 gets nothing
    sorted_pairs, block_experts, num_padded = align_by_expert(ids, 6, 4)
    flat = ids.flatten()
    real = sorted_pairs[sorted_pairs < flat.numel()].long()
    assert sorted(real.tolist()) == list(range(flat.numel())), "each (token, slot) pair exactly once"
    for b, e in enumerate(block_experts.tolist()):
        rows = sorted_pairs[4 * b : 4 * b + 4]
        rows = rows[rows < flat.numel()].long()
        if e < 6:
            assert (flat[rows] == e).all(), f"block {b} mixes experts"
        else:
            assert rows.numel() == 0 and 4 * b >= int(num_padded), "blocks past the end are empty"
    assert 2 not in block_experts.tolist(), "an expert without tokens gets no block"


def check_kernels(device: str, dtype: torch.dtype = torch.float32) -> int:
    """Compare the Triton path with the torch path on every case; returns the number of checks."""
    g = torch.Generator().manual_seed(0)
    check_align(g)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    n = 0
    for t, h, i, e, k in CASES:
        x = torch.randn(t, h, generator=g)
        w13 = torch.randn(e, 2 * i, h, generator=g) * h**-0.5
        w2 = torch.randn(e, h, i, generator=g) * i**-0.5
        weights, ids = routing(t, e, k, g)
        x, w13, w2, weights = (v.to(device, dtype) for v in (x, w13, w2, weights))
        ids = ids.to(device)
        want = fused_moe_reference(x.float(), w13.float(), w2.float(), weights.float(), ids)
        got = fused_moe_triton(x, w13, w2, weights, ids)
        err = ((got.float() - want).abs().max() / want.abs().max()).item()
        assert err < tol, f"T={t} H={h} I={i} E={e} k={k} {dtype}: max error {err:.2e} (relative to max)"
        # Expert parallelism: this rank holds experts [0, e/2); the others are id e/2 (skipped).
        half = e // 2
        local = torch.where(ids < half, ids, torch.full_like(ids, half))
        want = fused_moe_reference(x.float(), w13[:half].float(), w2[:half].float(), weights.float(), local)
        got = fused_moe_triton(x, w13[:half].contiguous(), w2[:half].contiguous(), weights, local)
        err = ((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()
        assert err < tol, f"EP half of T={t} E={e} k={k} {dtype}: max error {err:.2e}"
        n += 2
    return n


def check_graph(device: str) -> None:
    """Capture the fused MoE in a CUDA graph once, then replay it with other tokens and routings."""
    g = torch.Generator().manual_seed(1)
    t, h, i, e, k = 24, 64, 32, 16, 4
    w13 = (torch.randn(e, 2 * i, h, generator=g) * h**-0.5).to(device)
    w2 = (torch.randn(e, h, i, generator=g) * i**-0.5).to(device)
    x = torch.randn(t, h, generator=g).to(device)
    weights, ids = (v.to(device) for v in routing(t, e, k, g))
    fused_moe_triton(x, w13, w2, weights, ids)  # warm-up: compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_triton(x, w13, w2, weights, ids)
    for _ in range(3):
        new_w, new_ids = routing(t, e, k, g)
        x.copy_(torch.randn(t, h, generator=g))
        weights.copy_(new_w)
        ids.copy_(new_ids)
        graph.replay()
        want = fused_moe_reference(x, w13, w2, weights, ids)
        err = ((out - want).abs().max() / want.abs().max()).item()
        assert err < 1e-5, f"CUDA-graph replay of the fused MoE: max error {err:.2e}"


def check_model(device: str) -> None:
    """A tiny Qwen3-MoE through ModelRunner on the GPU (fused MoE, eager and CUDA graphs) vs the CPU torch path."""
    import tempfile
    from pathlib import Path

    from rtp.testing import TinyQwen3MoeSpec, make_tiny_qwen3
    from tests.kernels.paged_attention_cases import runner_logits

    with tempfile.TemporaryDirectory() as tmp:
        spec = TinyQwen3MoeSpec(num_hidden_layers=3, mlp_only_layers=(1,), num_experts=16, num_experts_per_tok=8)
        model_dir = make_tiny_qwen3(Path(tmp) / "moe", spec)
        ref = runner_logits(model_dir, "torch", True, torch.device("cpu"), "float32")
        for eager in (True, False):
            got = runner_logits(model_dir, "triton", eager, torch.device(device), "float32").cpu()
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            assert err < 1e-2, f"tiny MoE on {device} (eager={eager}) vs CPU: max error {err:.2e}"


def check_model_interpreted() -> None:
    """CPU (under TRITON_INTERPRET=1): the tiny MoE model with its experts on the Triton path equals the torch path."""
    import tempfile
    from pathlib import Path
    from unittest import mock

    from rtp.testing import TinyQwen3MoeSpec, make_tiny_qwen3
    from tests.kernels.paged_attention_cases import runner_logits

    with tempfile.TemporaryDirectory() as tmp:
        spec = TinyQwen3MoeSpec(num_hidden_layers=2, mlp_only_layers=(0,), num_experts=16, num_experts_per_tok=8)
        model_dir = make_tiny_qwen3(Path(tmp) / "moe", spec)
        cpu = torch.device("cpu")
        ref = runner_logits(model_dir, "torch", True, cpu, "float32")
        with mock.patch("rtp.model.moe.fused_moe", fused_moe_triton):
            got = runner_logits(model_dir, "torch", True, cpu, "float32")
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-5, f"tiny MoE, Triton experts (interpreter) vs torch path: max error {err:.2e}"


def bench(device: str) -> None:
    """Time one Qwen3-30B-A3B MoE layer (128 experts, top-8, H 2048, I 768) on one GPU, bf16."""
    g = torch.Generator(device=device).manual_seed(0)
    e, k, h, i = 128, 8, 2048, 768
    w13 = torch.randn(e, 2 * i, h, device=device, dtype=torch.bfloat16, generator=g) * h**-0.5
    w2 = torch.randn(e, h, i, device=device, dtype=torch.bfloat16, generator=g) * i**-0.5
    for t in (1, 64, 2048):
        x = torch.randn(t, h, device=device, dtype=torch.bfloat16, generator=g)
        weights, ids = torch.randn(t, e, device=device, generator=g).softmax(-1).topk(k, dim=-1)
        weights = weights.to(torch.bfloat16)
        for name, fn in (("triton", fused_moe_triton), ("torch", fused_moe_reference)):
            fn(x, w13, w2, weights, ids)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(10):
                fn(x, w13, w2, weights, ids)
            torch.cuda.synchronize()
            print(f"bench fused MoE {name:6s} T={t:5d}: {(time.perf_counter() - t0) / 10 * 1e3:.3f} ms")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--bench", action="store_true")
    args = ap.parse_args()
    n = check_kernels(args.device)
    if args.device == "cuda":
        n += check_kernels(args.device, torch.bfloat16)
        check_graph(args.device)
        check_model(args.device)
        n += 2
        if args.bench:
            bench(args.device)
    else:
        check_model_interpreted()
        n += 1
    print(f"OK {n} fused-MoE checks on {args.device}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
