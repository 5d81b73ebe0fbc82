"""rtp's int8 x int8 CPU GEMM (VNNI and AMX) against float64 torch: the same activation quantization with
exact products, and the dequantized float product it approximates."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rtp.kernels import cpu_int8_gemm

pytestmark = pytest.mark.skipif(not cpu_int8_gemm.available(), reason="the CPU has no AVX-512 VNNI")

PATHS = [False, True] if cpu_int8_gemm.has_amx() else [False]


def quantized_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
    """x quantized per row and group of 128 inputs (round half to even, max|x| / 127), then exact float64 sums."""
    m, k = x.shape
    g = -(-k // cpu_int8_gemm.GROUP)
    pad = g * cpu_int8_gemm.GROUP - k
    xg = F.pad(x.float(), (0, pad)).view(m, g, -1)
    amax = xg.abs().amax(dim=2, keepdim=True)
    sx = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    xq = torch.round(xg / sx).clamp(-127, 127).double()
    qg = F.pad(q.double(), (0, pad)).view(q.shape[0], g, -1)
    y = torch.einsum("mgk,ngk,mg->mn", xq, qg, sx.squeeze(2).double()) * scale.double()
    return y if bias is None else y + bias.double()


# 300 rows: row blocks of 256 + 44 (the AMX path's 32-row blocks end in a 16-row and a partial tile);
# odd panel counts (N = 33, 40), K not a multiple of 4, 64 or 128.
@pytest.mark.parametrize("rows,out_f,in_f", [(1, 40, 130), (8, 256, 1024), (13, 33, 257), (300, 64, 384),
                                             (7, 16, 3), (47, 48, 200)])
@pytest.mark.parametrize("amx", PATHS, ids=lambda a: "amx" if a else "vnni")
def test_int8_gemm_equals_the_quantized_product(rows: int, out_f: int, in_f: int, amx: bool) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + out_f)
    x = torch.randn(rows, in_f, generator=gen) * torch.logspace(-2, 1, in_f)  # groups of very different ranges
    if rows > 2:
        x[2] = 0.0  # an all-zero row
    q = torch.randint(-127, 128, (out_f, in_f), generator=gen, dtype=torch.int8)
    scale = torch.rand(out_f, generator=gen) / 127 + 1e-3
    b = torch.randn(out_f, generator=gen)
    packed = cpu_int8_gemm.pack(q)
    assert packed.shape == (-(-out_f // 16), -(-in_f // 64) * 16, 16, 4) and packed.dtype == torch.uint8
    for bias in (None, b):
        ref = quantized_reference(x, q, scale, bias)
        got = cpu_int8_gemm.linear(x, packed, out_f, scale, bias, amx=amx)
        assert got.shape == (rows, out_f) and got.dtype == torch.float32
        # int32 sums are exact; fp32 rounding of each group's scaled sum and their accumulation remain
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        # ... and it approximates the float product with the dequantized weight
        want = F.linear(x.double(), q.double() * scale.double()[:, None], None if bias is None else bias.double())
        assert ((got.double() - want).norm() / want.norm()).item() < 2e-2


def test_amx_and_vnni_give_the_same_result_and_the_input_dtype() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(70, 320, generator=gen).bfloat16()
    q = torch.randint(-127, 128, (48, 320), generator=gen, dtype=torch.int8)
    scale = torch.rand(48, generator=gen) / 127 + 1e-3
    packed = cpu_int8_gemm.pack(q)
    results = [cpu_int8_gemm.linear(x, packed, 48, scale, amx=amx) for amx in PATHS]
    assert all(r.dtype == torch.bfloat16 for r in results)
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_an_outlier_coarsens_only_its_own_group() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 256, generator=gen)
    q = torch.randint(-127, 128, (16, 256), generator=gen, dtype=torch.int8)
    ones = torch.ones(16)
    packed = cpu_int8_gemm.pack(q)
    x_out = x.clone()
    x_out[:, 0] = 1000.0  # in the first group of 128 inputs
    # The second group's contribution is quantized exactly as without the outlier.
    second = torch.zeros_like(x)
    second[:, 128:] = x[:, 128:]
    q_second = q.clone()
    q_second[:, :128] = 0
    packed_second = cpu_int8_gemm.pack(q_second)
    got = cpu_int8_gemm.linear(x_out, packed_second, 16, ones)
    assert torch.equal(got, cpu_int8_gemm.linear(second, packed_second, 16, ones))
    assert torch.equal(got, cpu_int8_gemm.linear(x, packed_second, 16, ones))
    assert packed.shape[1] == 64


def test_bad_arguments_fail_with_a_message() -> None:
    q = torch.randint(-127, 128, (32, 64), dtype=torch.int8)
    packed = cpu_int8_gemm.pack(q)
    with pytest.raises(RuntimeError, match="does not fit"):
        cpu_int8_gemm.linear(torch.randn(2, 200), packed, 32, torch.ones(32))
    with pytest.raises(RuntimeError, match="must be"):
        cpu_int8_gemm.linear(torch.randn(2, 64), packed, 32, torch.ones(31))
    with pytest.raises(RuntimeError, match="int8"):
        cpu_int8_gemm.pack(q.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_pack_equals_quantize_then_pack(dtype) -> None:
    from rtp.model.quant.int8 import quantize_per_channel

    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(37, 200, generator=gen) * torch.logspace(-3, 1, 37)[:, None]).to(dtype)
    w[5] = 0.0  # an all-zero row
    q, scale = quantize_per_channel(w)
    panels, got_scale = cpu_int8_gemm.quantize_pack(w)
    assert torch.equal(panels, cpu_int8_gemm.pack(q))
    assert torch.equal(got_scale, scale)
