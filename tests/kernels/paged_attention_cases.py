"""Triton paged attention against its torch references, runnable without pytest.

    TRITON_INTERPRET=1 python -m tests.kernels.paged_attention_cases   # CPU, the interpreter (fp32)
    python -m tests.kernels.paged_attention_cases --device cuda        # a GPU (fp32 and bf16, graphs, timings)

tests/kernels/test_paged_attention.py runs the first, scripts/gpu_check.sh the second. Prints one
line per case and "OK" at the end; exits 1 at the first mismatch.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from rtp.config import CacheConfig, ModelConfig, RtpConfig
from rtp.kernels.kv_store import store_kv_reference, store_kv_triton
from rtp.kernels.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_reference,
    paged_prefill_attention,
    paged_prefill_attention_reference,
)
from rtp.model.attention import AttnMetadata, PagedAttention

POISON = 1e3  # cache slots no sequence owns: a kernel that reads one is far off


@dataclass
class Case:
    """One batch: sequence i has q_lens[i] queries at the end of its k_lens[i] keys."""

    name: str
    q_lens: list[int]
    k_lens: list[int]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    block_m: int = 16  # prefill tiles (small: the interpreter runs a Python loop per program)
    block_n: int = 16
    splits: tuple[int | None, ...] = (1,)  # decode KV splits to try (None = the default choice)

    @property
    def decode(self) -> bool:
        return all(q == 1 for q in self.q_lens)


CPU_CASES = [
    # GQA decode: one token, a context ending exactly on a block boundary (4, 8) and one past it (5, 9)
    Case("decode-gqa", [1] * 6, [1, 4, 5, 8, 9, 33], 4, 2, 16, 4, splits=(1, 4)),
    # MHA decode, head_dim 24 (padded to 32), 4 splits over a 3-tile context, one split with nothing to do
    Case("decode-mha-d24", [1] * 4, [1, 16, 17, 40], 2, 2, 24, 8, splits=(1, 2, 4)),
    # prefill: a one-token prompt, full prompts, a cached prefix (q_len < k_len), a block boundary
    Case("prefill-gqa", [1, 5, 3, 17], [1, 5, 11, 17], 4, 1, 16, 4),
    # mixed decode + prefill-with-prefix, MHA, head_dim 20, default tile sizes, block size 1
    Case("mixed-mha-d20", [1, 1, 7, 1], [9, 16, 20, 3], 2, 2, 20, 1, block_m=64, block_n=64),
    # mixed, GQA, block size 8, queries spanning two query blocks past a cached prefix of 8
    Case("mixed-gqa", [1, 18, 2], [24, 26, 2], 4, 2, 32, 8),
]

CUDA_CASES = [
    *CPU_CASES,
    Case("decode-qwen3-shape", [1] * 5, [1, 16, 17, 600, 2049], 16, 2, 128, 16, splits=(1, 8, None)),
    Case("mixed-qwen3-shape", [1, 300, 64, 1, 130], [513, 300, 700, 17, 130], 8, 8, 128, 16, 64, 64),
    Case("prefill-d80-bs32", [257, 33], [300, 33], 8, 4, 80, 32, 64, 32),
]


def build(case: Case, device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> dict:
    """Random q and cache, shuffled block tables padded with -1, unowned slots poisoned."""
    bs = case.block_size
    need = [-(-k // bs) for k in case.k_lens]
    num_blocks = sum(need) + 3  # a few blocks nobody owns
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], torch.zeros(num_blocks * bs, dtype=torch.bool)
    for n, k in zip(need, case.k_lens):
        blocks, perm = perm[:n], perm[n:]
        tables.append(blocks + [-1] * (max(need) + 2 - n))  # entries past the context are never read
        for pos in range(k):
            used[blocks[pos // bs] * bs + pos % bs] = True
    shape = (num_blocks, bs, case.num_kv_heads, case.head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    for cache in (k_cache, v_cache):
        cache.view(num_blocks * bs, -1)[~used] = POISON
    q = torch.randn(sum(case.q_lens), case.num_heads, case.head_dim, generator=gen)
    cu_q = torch.tensor([0, *torch.tensor(case.q_lens).cumsum(0).tolist()], dtype=torch.int32)

    def to(x: torch.Tensor) -> torch.Tensor:
        return x.to(device, dtype if x.is_floating_point() else x.dtype)

    return {
        "q": to(q), "k_cache": to(k_cache), "v_cache": to(v_cache), "cu_q": to(cu_q),
        "tables": to(torch.tensor(tables, dtype=torch.int32)), "ctx": to(torch.tensor(case.k_lens, dtype=torch.int32)),
    }


def _close(name: str, got: torch.Tensor, want: torch.Tensor, atol: float) -> float:
    err = (got.float() - want).abs().max().item()
    if not torch.allclose(got.float(), want, atol=atol, rtol=atol) or not torch.isfinite(got).all():
        raise AssertionError(f"{name}: max abs error {err:.3g} > {atol}")
    return err


def check_case(case: Case, device: torch.device, dtype: torch.dtype, atol: float, gen: torch.Generator) -> float:
    """Compare the Triton kernels with the references (computed in fp32 from the same inputs)."""
    t = build(case, device, dtype, gen)
    scale = case.head_dim**-0.5
    q32, k32, v32 = t["q"].float(), t["k_cache"].float(), t["v_cache"].float()
    ref = paged_prefill_attention_reference(q32, k32, v32, case.q_lens, case.k_lens, scale, t["tables"])
    got = paged_prefill_attention(t["q"], t["k_cache"], t["v_cache"], t["tables"], t["cu_q"], t["ctx"], scale,
                                  block_m=case.block_m, block_n=case.block_n)
    err = _close(f"{case.name} prefill kernel", got, ref, atol)
    if case.decode:
        ref_dec = paged_decode_attention_reference(q32, k32, v32, t["tables"], t["ctx"], max(case.k_lens), scale)
        _close(f"{case.name} decode reference vs prefill reference", ref_dec, ref, 1e-5)
        for splits in case.splits:
            got = paged_decode_attention(t["q"], t["k_cache"], t["v_cache"], t["tables"], t["ctx"], scale,
                                         num_splits=splits, block_n=case.block_n)
            err = max(err, _close(f"{case.name} decode kernel, splits={splits}", got, ref, atol))
    return err


def step_metadata(q_lens: list[int], k_lens: list[int], tables: list[list[int]], block_size: int,
                  device: torch.device) -> AttnMetadata:
    """Metadata of one step: new tokens' slots from the block tables, offsets, lengths."""
    slots = [t[p // block_size] * block_size + p % block_size
             for q, k, t in zip(q_lens, k_lens, tables) for p in range(k - q, k)]
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    return AttnMetadata(torch.tensor(slots, device=device), cu_q, cu_k,
                        torch.tensor(k_lens, dtype=torch.int32, device=device), bt, max(q_lens), max(k_lens),
                        list(q_lens), list(k_lens))


def check_layer(device: torch.device, dtype: torch.dtype, atol: float, gen: torch.Generator) -> None:
    """PagedAttention with the triton backend stores K/V and attends like the torch backend, step by step."""
    hq, hkv, d, bs = 4, 2, 16, 4
    layers = {}
    for backend in ("triton", "torch"):
        layers[backend] = PagedAttention(hq, hkv, d, d**-0.5)
        layers[backend].backend = backend
        layers[backend].k_cache = torch.zeros(8, bs, hkv, d, device=device, dtype=dtype)
        layers[backend].v_cache = torch.zeros_like(layers[backend].k_cache)
    tables = [[5, 2, 7], [0, 3, 6]]
    # prompts of 5 and 3 tokens; then a decode step beside a 4-token prefill chunk; then a decode step
    for q_lens, k_lens in [([5, 3], [5, 3]), ([1, 4], [6, 7]), ([1, 1], [7, 8])]:
        meta = step_metadata(q_lens, k_lens, tables, bs, device)
        q = torch.randn(sum(q_lens), hq, d, generator=gen).to(device, dtype)
        k, v = torch.randn(2, sum(q_lens), hkv, d, generator=gen).to(device, dtype)
        outs = {name: layer(q, k, v, meta) for name, layer in layers.items()}
        _close(f"layer step {q_lens}/{k_lens}", outs["triton"], outs["torch"].float(), atol)
    assert torch.equal(layers["triton"].k_cache, layers["torch"].k_cache), "layer: caches differ"
    assert layers["triton"].k_cache.abs().sum() > 0


def runner_logits(model_dir: Path, backend: str, eager: bool, device: torch.device, dtype: str,
                  prepare: Callable[[Any], None] | None = None) -> torch.Tensor:
    """Logits ``[steps, 2, vocab]`` of a ModelRunner pinned to one attention backend: two prompts (35 and 20
    tokens, 3 and 2 blocks of 16), then decode steps fed fixed tokens (so every backend sees the same inputs).
    ``prepare(runner)``, if given, runs before the first step (hooks on the model, say)."""
    from rtp.core.step import CachedSeq, NewSeq, StepPlan
    from rtp.distributed.parallel import ParallelState
    from rtp.runtime.model_runner import ModelRunner

    # The runner would pick flash-attn where installed, and never Triton on CPU: pin the backend under test.
    with mock.patch("rtp.runtime.model_runner.choose_attn_backend", return_value=backend):
        config = RtpConfig(model=ModelConfig(dtype=dtype, enforce_eager=eager, cuda_graph_max_batch=8),
                           cache=CacheConfig(num_kv_blocks=16))
        runner = ModelRunner(ParallelState.single(device.type), model_dir, config)
    try:
        assert runner.block_size == 16, f"default block size {runner.block_size} without flash-attn"
        assert {a.backend for a in runner.model.attention_layers()} == {backend}
        assert (runner.graphs is None) == eager, "CUDA graphs not captured"
        if prepare is not None:
            prepare(runner)
        prompts, blocks = [list(range(1, 36)), list(range(40, 60))], [[0, 1, 2], [5, 4, 3]]
        logits = [runner.execute(StepPlan(new_seqs=[NewSeq(i, p, blocks[i], 0, len(p))
                                                    for i, p in enumerate(prompts)])).sample_logits]
        for step in range(6):
            toks = [(7 * step + 3 * i) % 500 for i in range(2)]
            logits.append(runner.execute(StepPlan(cached_seqs=[CachedSeq(i, 1, [toks[i]], []) for i in range(2)]))
                          .sample_logits)
        return torch.stack(logits)
    finally:
        runner.close()


def check_runner(device: torch.device, tmp: Path) -> None:
    """The whole model with the triton backend (eager, and CUDA graphs on a GPU) against the torch backend."""
    from rtp.testing import TinyQwen3Spec, make_tiny_qwen3

    spec = TinyQwen3Spec(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model_dir = make_tiny_qwen3(tmp / "m", spec)
    dtype, atol = ("bfloat16", 5e-2) if device.type == "cuda" else ("float32", 1e-4)
    ref = runner_logits(model_dir, "torch", True, device, dtype)
    _close("model, triton backend vs torch", runner_logits(model_dir, "triton", True, device, dtype), ref, atol)
    if device.type == "cuda":
        graph = runner_logits(model_dir, "triton", False, device, dtype)
        _close("model, triton CUDA graphs vs torch", graph, ref, atol)


def check_store_kv(device: torch.device, gen: torch.Generator) -> None:
    """The Triton KV store writes what the reference writes (on the GPU; the CPU test covers the interpreter)."""
    key, value = torch.randn(2, 37, 2, 80, generator=gen).to(device)
    slots = torch.randperm(8 * 16, generator=gen)[:37].to(device)
    slots[::7] = -1
    caches = [torch.zeros(8, 16, 2, 80, device=device) for _ in range(4)]
    store_kv_reference(key, value, caches[0], caches[1], slots)
    store_kv_triton(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3]), "store_kv: triton != reference"


def check_decode_graph(device: torch.device, gen: torch.Generator) -> None:
    """Capture the decode kernel once, then replay it with other context lengths and block tables."""
    # Every sequence owns 44 blocks (700 tokens): any context up to 700 and any row order of the tables is valid.
    case = Case("graph", [1] * 3, [700, 700, 700], 8, 2, 128, 16)
    t = build(case, device, torch.bfloat16, gen)
    scale = 128**-0.5
    q, ctx, tables = t["q"].clone(), t["ctx"].clone(), t["tables"].clone()
    paged_decode_attention(q, t["k_cache"], t["v_cache"], tables, ctx, scale)  # warm-up: compile
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention(q, t["k_cache"], t["v_cache"], tables, ctx, scale)
    for k_lens in ([700, 5, 64], [1, 700, 33], [16, 17, 699]):
        ctx.copy_(torch.tensor(k_lens, dtype=torch.int32))
        tables.copy_(tables.flip(0))
        graph.replay()
        ref = paged_decode_attention_reference(q.float(), t["k_cache"].float(), t["v_cache"].float(), tables, ctx,
                                               700, scale)
        _close(f"graph replay {k_lens}", out, ref, 2e-2)


def bench(device: torch.device, gen: torch.Generator) -> None:
    """Kernel vs torch-path times on Qwen3-8B-like heads (32 q / 8 KV heads, head_dim 128, bf16)."""

    def timed(fn) -> float:  # noqa: ANN001
        fn()
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(10):
            fn()
        torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) / 10 * 1e3

    for name, q_lens, k_lens in [("decode 64 x 1024", [1] * 64, [1024] * 64), ("decode 1 x 8192", [1], [8192]),
                                 ("prefill 4 x 1024", [1024] * 4, [1024] * 4)]:
        case = Case(name, q_lens, k_lens, 32, 8, 128, 16)
        t = build(case, device, torch.bfloat16, gen)
        scale = 128**-0.5
        args = (t["q"], t["k_cache"], t["v_cache"])
        if case.decode:
            ms = timed(lambda: paged_decode_attention(*args, t["tables"], t["ctx"], scale))  # noqa: B023
            ref = timed(lambda: paged_decode_attention_reference(*args, t["tables"], t["ctx"], max(k_lens), scale))  # noqa: B023
        else:
            ms = timed(lambda: paged_prefill_attention(*args, t["tables"], t["cu_q"], t["ctx"], scale))  # noqa: B023
            ref = timed(lambda: paged_prefill_attention_reference(*args, q_lens, k_lens, scale, t["tables"]))  # noqa: B023
        print(f"bench {name}: triton {ms:.3f} ms, torch path {ref:.3f} ms")


def main(argv: list[str] | None = None) -> int:
    """Run every case on one device; 0 when all match."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu (needs TRITON_INTERPRET=1) or cuda")
    parser.add_argument("--bench", action="store_true", help="also time the kernels (cuda)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    # fp32 on the small cases (the GPU kernels' fp32 dots are exact, "ieee", not TF32), and on a GPU bf16 on
    # every case, larger ones included (against fp32 references computed from the same bf16 inputs).
    runs = [(torch.float32, 1e-4, CPU_CASES)]
    if device.type == "cuda":
        runs.append((torch.bfloat16, 2e-2, CUDA_CASES))
    try:
        for dtype, atol, cases in runs:
            for case in cases:
                err = check_case(case, device, dtype, atol, gen)
                print(f"{case.name} {str(dtype).removeprefix('torch.')}: max abs error {err:.2e}")
        check_layer(device, *runs[-1][:2], gen)
        print("PagedAttention triton backend vs torch backend: match")
        with tempfile.TemporaryDirectory() as tmp:
            check_runner(device, Path(tmp))
        print("ModelRunner triton backend vs torch backend: match")
        if device.type == "cuda":
            check_store_kv(device, gen)
            check_decode_graph(device, gen)
            print("store_kv and CUDA-graph decode replay: match")
            if args.bench:
                bench(device, gen)
    except AssertionError as e:
        print(f"FAIL {e}")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
