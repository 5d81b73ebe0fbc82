"""The rtp:: custom ops: fake implementations check their arguments and give outputs of the right shape;
the real implementations agree with the torch references (the value oracle)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import rtp.kernels.fused_moe as fm
import rtp.kernels.kv_store as kv
import rtp.kernels.paged_attention as pa
from rtp.fake_cuda.device import install_cuda_guard
from rtp.kernels.op_checks import KernelArgError

BF16 = torch.bfloat16


@pytest.fixture(autouse=True, scope="module")
def _cuda_guard() -> None:
    install_cuda_guard()  # fake CUDA tensors need a device guard for slicing on a CPU-only build


def _attn_args(device: str, dtype: torch.dtype = BF16, cache_dtype: torch.dtype = BF16, batch: int = 3):
    q = torch.empty(batch, 8, 16, dtype=dtype, device=device)
    k_cache = torch.empty(10, 16, 2, 16, dtype=cache_dtype, device=device)
    tables = torch.zeros(batch, 4, dtype=torch.int32, device=device)
    ctx = torch.ones(batch, dtype=torch.int32, device=device)
    return q, k_cache, k_cache.clone(), tables, ctx


def test_fake_ops_return_right_shapes_on_fake_cuda():
    with FakeTensorMode():
        q, kc, vc, tables, ctx = _attn_args("cuda")
        out = torch.ops.rtp.paged_decode_attention(q, kc, vc, tables, ctx, 0.25, 4, 32)
        assert (out.shape, out.dtype, out.device.type) == (q.shape, BF16, "cuda")
        qp = torch.empty(7, 8, 16, dtype=BF16, device="cuda")
        cu = torch.tensor([0, 3, 4, 7], dtype=torch.int32, device="cuda")
        out = torch.ops.rtp.paged_prefill_attention(qp, kc, vc, tables, cu, ctx, 0.25, 0, 0)
        assert out.shape == qp.shape and out.dtype == BF16
        key = torch.empty(7, 2, 16, dtype=BF16, device="cuda")
        torch.ops.rtp.store_kv(key, key, kc, vc, torch.zeros(7, dtype=torch.long, device="cuda"))
        x = torch.empty(5, 64, dtype=BF16, device="cuda")
        w13, w2 = torch.empty(8, 64, 64, dtype=BF16, device="cuda"), torch.empty(8, 64, 32, dtype=BF16, device="cuda")
        ids = torch.zeros(5, 2, dtype=torch.long, device="cuda")
        out = torch.ops.rtp.fused_moe(x, w13, w2, torch.empty(5, 2, dtype=BF16, device="cuda"), ids)
        assert out.shape == x.shape and out.dtype == BF16 and out.device.type == "cuda"


@pytest.mark.parametrize("bug, message", [
    ("fp32 query", "q is float32 but k_cache is bfloat16"),
    ("cpu tables", "block_tables is on cpu but q is on cuda:0"),
    ("int64 lens", "context_lens is int64; expected int32"),
    ("batch", "q has shape [2, 8, 16]; expected [B, Hq, D] (one query per sequence)"),
])
def test_fake_decode_rejects_mismatched_arguments(bug, message):
    with FakeTensorMode():
        q, kc, vc, tables, ctx = _attn_args("cuda", dtype=torch.float32 if bug == "fp32 query" else BF16)
        if bug == "cpu tables":
            tables = torch.zeros(3, 4, dtype=torch.int32)
        if bug == "int64 lens":
            ctx = ctx.long()
        if bug == "batch":
            q = q[:2]
        with pytest.raises(KernelArgError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                           .replace(")", r"\)")):
            torch.ops.rtp.paged_decode_attention(q, kc, vc, tables, ctx, 0.25, 1, 32)


def test_fake_store_kv_and_moe_reject_mismatches():
    with FakeTensorMode():
        kc = torch.empty(10, 16, 2, 16, dtype=BF16, device="cuda")
        key = torch.empty(7, 2, 16, dtype=torch.float32, device="cuda")
        with pytest.raises(KernelArgError, match="key is float32 but k_cache is bfloat16"):
            torch.ops.rtp.store_kv(key, key, kc, kc.clone(), torch.zeros(7, dtype=torch.long, device="cuda"))
        x = torch.empty(5, 64, dtype=BF16, device="cuda")
        w13 = torch.empty(8, 64, 64, dtype=torch.float32, device="cuda")
        w2 = torch.empty(8, 64, 32, dtype=BF16, device="cuda")
        with pytest.raises(KernelArgError, match="w13 is float32 but x is bfloat16"):
            torch.ops.rtp.fused_moe(x, w13, w2, torch.empty(5, 2, dtype=BF16, device="cuda"),
                                    torch.zeros(5, 2, dtype=torch.long, device="cuda"))


def test_real_ops_match_the_references_without_triton(monkeypatch):
    # Where triton cannot run the ops fall back to the torch references: same numbers.
    monkeypatch.setattr(pa, "triton", None)
    monkeypatch.setattr(kv, "triton", None)
    monkeypatch.setattr(fm, "triton", None)
    g = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(10, 4, 2, 16, generator=g), torch.randn(10, 4, 2, 16, generator=g)
    tables = torch.tensor([[3, 1, 0], [2, 5, 7]], dtype=torch.int32)
    ctx = torch.tensor([6, 11], dtype=torch.int32)
    q = torch.randn(2, 8, 16, generator=g)
    got = pa.paged_decode_attention(q, kc, vc, tables, ctx, 0.25)
    want = pa.paged_decode_attention_reference(q, kc, vc, tables, ctx, 11, 0.25)
    torch.testing.assert_close(got, want)
    qp = torch.randn(5, 8, 16, generator=g)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    got = pa.paged_prefill_attention(qp, kc, vc, tables, cu, ctx, 0.25)
    want = pa.paged_prefill_attention_reference(qp, kc, vc, [2, 3], [6, 11], 0.25, tables)
    torch.testing.assert_close(got, want)
    key = torch.randn(3, 2, 16, generator=g)
    slots = torch.tensor([4, -1, 9])
    caches = [kc.clone(), vc.clone(), kc.clone(), vc.clone()]
    torch.ops.rtp.store_kv(key, -key, caches[0], caches[1], slots)
    kv.store_kv_reference(key, -key, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert not torch.equal(caches[0], kc)
    x = torch.randn(5, 16, generator=g)
    w13, w2 = torch.randn(4, 24, 16, generator=g), torch.randn(4, 16, 12, generator=g)
    w, ids = torch.rand(5, 2, generator=g), torch.randint(0, 4, (5, 2), generator=g)
    torch.testing.assert_close(torch.ops.rtp.fused_moe(x, w13, w2, w, ids), fm.fused_moe_reference(x, w13, w2, w, ids))
