"""rtp's fused CPU layer ops against the torch code they replace (and float64 where rounding matters)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rtp.kernels import cpu_ops
from rtp.kernels.kv_store import store_kv, store_kv_reference
from rtp.model.ops import RMSNorm, RotaryEmbedding, SiluAndMul, qk_norm_rope
from tests.utils import HAS_CXX

pytestmark = pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler: the kernels cannot be built")


def test_kernel_builds() -> None:
    """A compiler is here, so the kernel must build (a failed build would leave only the torch path)."""
    assert cpu_ops.load() is not None


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape
    if dtype == torch.float32:
        # Same operations, summed in another order: a few ulp.
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    else:
        # fp32 arithmetic then one rounding to the 16-bit dtype, like torch: at most one ulp apart
        # where the fp32 values straddle a rounding boundary.
        torch.testing.assert_close(got.float(), ref.float(), rtol=1e-2, atol=1e-2)
        assert (got != ref).float().mean() < 0.02


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 8), (24, 512), (7, 100), (300, 1024)])
def test_rms_norm_matches_torch(dtype: torch.dtype, rows: int, width: int) -> None:
    gen = torch.Generator().manual_seed(rows + width)
    norm = RMSNorm(width, 1e-6).to(dtype)
    norm.weight.data = torch.randn(width, generator=gen).to(dtype)
    x = (torch.randn(rows, width, generator=gen) * 3).to(dtype)
    _close(norm(x), norm.reference(x), dtype)
    # Strided rows (a slice of a wider tensor) and a 3-D input take the kernel too.
    wide = torch.randn(rows, width + 16, generator=gen).to(dtype)[:, 8:8 + width]
    _close(norm(wide), norm.reference(wide), dtype)
    _close(norm(x.view(1, rows, width)), norm.reference(x).view(1, rows, width), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 8), (24, 512), (7, 100), (300, 1024)])
def test_add_rms_norm_matches_torch(dtype: torch.dtype, rows: int, width: int) -> None:
    """The residual add fused into the norm: the sum exactly as torch's add (one rounding to the dtype), the
    norm of it as the reference; strided rows of either input too."""
    gen = torch.Generator().manual_seed(rows * width)
    norm = RMSNorm(width, 1e-6).to(dtype)
    norm.weight.data = torch.randn(width, generator=gen).to(dtype)
    residual = (torch.randn(rows, width, generator=gen) * 3).to(dtype)
    x = torch.randn(rows, width + 16, generator=gen).to(dtype)[:, 8:8 + width]  # strided rows
    got, total = norm.add(x, residual)
    assert torch.equal(total, residual + x)
    _close(got, norm.reference(residual + x), dtype)
    got2, total2 = norm.add(residual, x)  # the strided one as the residual
    assert torch.equal(total2, total)
    _close(got2, got, dtype)


def test_add_rms_norm_leaves_its_inputs() -> None:
    norm = RMSNorm(32, 1e-6)
    x, residual = torch.randn(4, 32), torch.randn(4, 32)
    x0, r0 = x.clone(), residual.clone()
    norm.add(x, residual)
    assert torch.equal(x, x0) and torch.equal(residual, r0)


def test_rms_norm_fp32_against_float64() -> None:
    x = torch.randn(16, 1024, dtype=torch.float64)
    w = torch.randn(1024, dtype=torch.float64)
    ref = w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    got = cpu_ops.rms_norm(x.float(), w.float(), 1e-6)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inner", [(1, 8), (24, 1536), (5, 13), (64, 3072)])
def test_silu_and_mul_matches_torch(dtype: torch.dtype, rows: int, inner: int) -> None:
    gen = torch.Generator().manual_seed(rows * inner)
    x = (torch.randn(rows, 2 * inner, generator=gen) * 4).to(dtype)
    got = SiluAndMul()(x)
    _close(got, SiluAndMul.reference(x), dtype)


def test_silu_edges_as_torch() -> None:
    # exp overflow and underflow, infinities and NaN: what torch's silu gives.
    g = torch.tensor([-float("inf"), -1000.0, -100.0, -88.5, -50.0, -1e-30, 0.0, 1e-30, 50.0, 88.5, 1000.0,
                      float("inf"), float("nan"), 3.0, -3.0, 20.0])
    x = torch.cat([g, torch.ones_like(g)]).unsqueeze(0)
    got, ref = cpu_ops.silu_and_mul(x)[0], F.silu(g)
    assert torch.equal(got.isnan(), ref.isnan())
    finite = ~ref.isnan()
    torch.testing.assert_close(got[finite], ref[finite], rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 2, 1, 8), (24, 8, 4, 64), (9, 16, 8, 128)])
def test_qk_norm_rope_matches_torch(dtype: torch.dtype, tokens: int, heads: int, kv_heads: int, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(tokens * heads)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    rotary = RotaryEmbedding(head_dim, 512, inv_freq.float(), 1.0)
    q_norm, k_norm = RMSNorm(head_dim, 1e-6).to(dtype), RMSNorm(head_dim, 1e-6).to(dtype)
    q_norm.weight.data = torch.randn(head_dim, generator=gen).to(dtype)
    k_norm.weight.data = torch.randn(head_dim, generator=gen).to(dtype)
    # q and k as the model has them: views into one fused qkv row per token.
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    for positions in (torch.randint(0, 512, (tokens,), generator=gen), torch.arange(tokens, dtype=torch.int32)):
        got_q, got_k = qk_norm_rope(positions, q, k, q_norm, k_norm, rotary)
        ref_q, ref_k = rotary.reference(positions.long(), q_norm.reference(q), k_norm.reference(k))
        _close(got_q, ref_q, dtype)
        _close(got_k, ref_k, dtype)
        assert got_q.is_contiguous() and got_k.is_contiguous()
        # The rotary embedding alone (an EAGLE-3 head's attention has no q/k norm): the same kernel, no norm.
        got_q, got_k = rotary(positions, q, k)
        ref_q, ref_k = rotary.reference(positions.long(), q, k)
        _close(got_q, ref_q, dtype)
        _close(got_k, ref_k, dtype)
        assert got_q.is_contiguous() and got_k.is_contiguous()


def test_qk_norm_rope_refuses_a_position_outside_the_table() -> None:
    q, k = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    cos = torch.randn(4, 4)
    with pytest.raises(RuntimeError, match="outside the table"):
        cpu_ops.qk_norm_rope(q, k, torch.ones(8), torch.ones(8), cos, cos, torch.tensor([1, 4]), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_kv_matches_the_reference(dtype: torch.dtype, slot_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    blocks, block_size, kv_heads, head_dim, tokens = 6, 4, 2, 16, 9
    qkv = torch.randn(tokens, 3 * kv_heads * head_dim, generator=gen).to(dtype)
    key = qkv[:, :kv_heads * head_dim].view(tokens, kv_heads, head_dim)  # strided rows, as in the model
    value = qkv[:, kv_heads * head_dim:2 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens].to(slot_dtype)
    slots[3] = -1  # a padding row: not stored
    caches = [torch.zeros(blocks, block_size, kv_heads, head_dim, dtype=dtype) for _ in range(4)]
    store_kv(key, value, caches[0], caches[1], slots)
    store_kv_reference(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].abs().sum() > 0


def test_store_kv_refuses_a_slot_outside_the_cache() -> None:
    key = torch.randn(2, 1, 8)
    cache = torch.zeros(2, 2, 1, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_ops.store_kv(key, key, cache, cache.clone(), torch.tensor([0, 4]))


def test_the_model_ops_take_the_kernels_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparisons above go through the modules: make sure those really run the C++ kernels on CPU."""
    calls: list[str] = []
    for name in ("rms_norm", "qk_norm_rope", "silu_and_mul", "store_kv", "rope", "add_rms_norm"):
        real = getattr(cpu_ops, name)
        monkeypatch.setattr(cpu_ops, name, lambda *a, _n=name, _f=real, **kw: (calls.append(_n), _f(*a, **kw))[1])
    norm = RMSNorm(16, 1e-6)
    norm(torch.randn(3, 16))
    SiluAndMul()(torch.randn(3, 32))
    rotary = RotaryEmbedding(16, 8, torch.rand(8), 1.0)
    qk_norm_rope(torch.arange(3), torch.randn(3, 2, 16), torch.randn(3, 1, 16), norm, norm, rotary)
    cache = torch.zeros(2, 2, 1, 16)
    store_kv(torch.randn(3, 1, 16), torch.randn(3, 1, 16), cache, cache.clone(), torch.tensor([0, 1, 2]))
    rotary(torch.arange(3), torch.randn(3, 2, 16), torch.randn(3, 1, 16))
    norm.add(torch.randn(3, 16), torch.randn(3, 16))
    assert calls == ["rms_norm", "silu_and_mul", "qk_norm_rope", "store_kv", "rope", "add_rms_norm"]


def test_rms_norm_with_an_fp32_weight_keeps_the_references_dtype() -> None:
    """bf16 activations with an fp32 weight: the reference promotes to fp32, and so must the module."""
    norm = RMSNorm(64, 1e-6)
    x = torch.randn(4, 64).bfloat16()
    got = norm(x)
    assert got.dtype == torch.float32
    assert torch.equal(got, norm.reference(x))
