"""rtp's CPU panel GEMM against a float64 F.linear, for the shapes and dtypes the runtime packs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rtp.kernels import cpu_gemm

pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason="no C++ compiler: the kernel cannot be built")


# Up to 48 rows the tiles prefetch the weights; 500 rows: row blocks of 240 + 240 + 20.
@pytest.mark.parametrize("rows,out_f,in_f", [(1, 16, 16), (6, 64, 256), (7, 33, 300), (13, 100, 513), (40, 48, 1024),
                                             (49, 130, 2048), (97, 64, 257), (500, 40, 70)])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_gemm_matches_float64_linear(rows: int, out_f: int, in_f: int, weight_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + out_f)
    x = torch.randn(rows, in_f, generator=gen)
    w = torch.randn(out_f, in_f, generator=gen).to(weight_dtype)
    b = torch.randn(out_f, generator=gen)
    packed = cpu_gemm.pack(w)
    nr = cpu_gemm.panel_width()
    assert packed.shape == (-(-out_f // nr), in_f, nr) and packed.dtype == weight_dtype
    for bias in (None, b):
        ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        got = cpu_gemm.linear(x, packed, out_f, bias)
        assert got.shape == (rows, out_f) and got.dtype == torch.float32
        # fp32 accumulation over in_f terms of size ~1: error ~ sqrt(in_f) * 6e-8 * |terms|
        torch.testing.assert_close(got.double(), ref, rtol=0, atol=2e-6 * in_f**0.5 * 4)


@pytest.mark.parametrize("rows,out_f,in_f", [(1, 16, 16), (8, 100, 513), (13, 48, 1024), (60, 70, 96), (500, 40, 70)])
def test_int8_panels_with_scales_match_float64_dequantized_linear(rows: int, out_f: int, in_f: int) -> None:
    gen = torch.Generator().manual_seed(rows + out_f)
    x = torch.randn(rows, in_f, generator=gen)
    q = torch.randint(-127, 128, (out_f, in_f), generator=gen, dtype=torch.int8)
    scale = torch.rand(out_f, generator=gen) / 127 + 1e-3
    b = torch.randn(out_f, generator=gen)
    packed = cpu_gemm.pack(q)
    assert packed.dtype == torch.int8
    w = q.double() * scale.double()[:, None]  # [N, K]
    for bias in (None, b):
        ref = F.linear(x.double(), w, None if bias is None else bias.double())
        got = cpu_gemm.linear(x, packed, out_f, bias, scale)
        assert got.shape == (rows, out_f) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), ref, rtol=0, atol=2e-6 * in_f**0.5 * 4)
    with pytest.raises(RuntimeError, match="need a scale"):
        cpu_gemm.linear(x, packed, out_f)
    with pytest.raises(RuntimeError, match="must be"):
        cpu_gemm.linear(x, packed, out_f, None, scale[:-1])


def test_output_takes_the_input_dtype() -> None:
    x = torch.randn(5, 64).bfloat16()
    w = torch.randn(32, 64).bfloat16()
    got = cpu_gemm.linear(x, cpu_gemm.pack(w), 32)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), F.linear(x.float(), w.float()), rtol=1e-2, atol=1e-2)


def test_bad_inputs_raise() -> None:
    packed = cpu_gemm.pack(torch.randn(32, 64))
    with pytest.raises(RuntimeError, match="does not fit"):
        cpu_gemm.linear(torch.randn(3, 65), packed, 32)
    with pytest.raises(RuntimeError, match="not a packed weight"):
        cpu_gemm.linear(torch.randn(3, 64), torch.randn(32, 64), 32)
