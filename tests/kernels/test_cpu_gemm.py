"""rtp's CPU panel GEMM against a float64 F.linear, for the shapes and dtypes the runtime packs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rtp.kernels import cpu_gemm, cpu_ops

pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason="no C++ compiler: the kernel cannot be built")


# Rows on both sides of the weight prefetch limits (up to 16 rows on AVX-512 BF16 only from the row tiles after the
# first with 4 rows or more: 13 rows, 6 + 6 + 1, and the first tile's look-ahead from 4 rows: 6, 7, 13; into L1 up to 48
# elsewhere); 7-9 rows (a Zen 4's in two equal tiles); in_f across K slices (1024; pair panels 2048; 64 at 7-9 rows
# where the tail cannot prefetch, the last one short: 300; an odd 301); 500 rows: row blocks of 240 + 240 + 20. On AMX
# tiles (pair panels where the CPU has them): 16-row tiles (the last one padded), in_f below 32 (no tile: all on the
# vdpbf16ps tail) or past a multiple of 32 (a tail), 1100 rows: row blocks of 368 + 368 + 364.
@pytest.mark.parametrize("rows,out_f,in_f", [(1, 16, 16), (6, 64, 256), (7, 33, 300), (8, 130, 2100), (9, 70, 301),
                                             (12, 130, 2100), (13, 100, 513), (40, 48, 1024), (49, 130, 2048),
                                             (20, 70, 4101), (97, 64, 257), (500, 40, 70), (1100, 70, 96)])
@pytest.mark.parametrize("weights", ["fp32", "bf16", "bf16 pairs", "bf16 pairs, no AMX"])
def test_gemm_matches_float64_linear(rows: int, out_f: int, in_f: int, weights: str) -> None:
    pairs = weights.startswith("bf16 pairs")
    if pairs and not cpu_gemm.bf16_dot():
        pytest.skip("no AVX-512 BF16: no pair panels")
    if weights == "bf16 pairs, no AMX" and not cpu_gemm.has_amx():
        pytest.skip("no AMX tiles: the pair panels' only path is the plain one")
    gen = torch.Generator().manual_seed(rows * 1000 + out_f)
    x = torch.randn(rows, in_f, generator=gen)
    weight_dtype = torch.float32 if weights == "fp32" else torch.bfloat16
    w = torch.randn(out_f, in_f, generator=gen).to(weight_dtype)
    b = torch.randn(out_f, generator=gen)
    packed = cpu_gemm.pack(w, pairs=pairs)
    nr = cpu_gemm.panel_width()
    panels = -(-out_f // nr)
    assert packed.shape == ((panels, -(-in_f // 2), nr, 2) if pairs else (panels, in_f, nr))
    assert packed.dtype == weight_dtype
    # pair panels multiply bf16 rows: exact products of the rounded rows, summed in fp32
    xr = x.bfloat16().double() if pairs else x.double()
    for bias in (None, b):
        ref = F.linear(xr, w.double(), None if bias is None else bias.double())
        got = cpu_gemm.linear(x, packed, out_f, bias, amx=weights != "bf16 pairs, no AMX")
        assert got.shape == (rows, out_f) and got.dtype == torch.float32
        # fp32 accumulation over in_f terms of size ~1: error ~ sqrt(in_f) * 6e-8 * |terms|
        torch.testing.assert_close(got.double(), ref, rtol=0, atol=2e-6 * in_f**0.5 * 4)


@pytest.mark.parametrize("rows,inter,in_f", [(1, 40, 64), (7, 96, 300), (250, 33, 1030)])
@pytest.mark.parametrize("weights", ["fp32", "bf16", "bf16 pairs"])
def test_gate_up_panels_give_the_plain_product_and_silu_mul(rows: int, inter: int, in_f: int, weights: str) -> None:
    """Gate ‖ up panels (each panel half gate, half the same up columns; intermediate sizes off the half-panel
    width, row blocks, K slices): the plain product equals the ordinary panels' bit for bit, and silu_mul is
    silu_and_mul of that product (fp32 rows and, with bf16 weights, bf16 rows rounded where it rounds)."""
    pairs = weights == "bf16 pairs"
    if pairs and not cpu_gemm.bf16_dot():
        pytest.skip("no AVX-512 BF16: no pair panels")
    gen = torch.Generator().manual_seed(rows + inter)
    weight_dtype = torch.float32 if weights == "fp32" else torch.bfloat16
    w = torch.randn(2 * inter, in_f, generator=gen).div(in_f**0.5).to(weight_dtype)
    plain, fused = cpu_gemm.pack(w, pairs=pairs), cpu_gemm.pack(w, pairs=pairs, gate_up=True)
    assert fused.shape[0] == -(-inter // (cpu_gemm.panel_width() // 2))
    for x_dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(rows, in_f, generator=gen).to(x_dtype)
        product = cpu_gemm.linear(x, plain, 2 * inter)
        assert torch.equal(cpu_gemm.linear(x, fused, 2 * inter, gate_up=True), product)
        got = cpu_gemm.silu_mul(x, fused, 2 * inter)
        assert got.shape == (rows, inter) and got.dtype == x_dtype
        ulp = 2e-6 if x_dtype == torch.float32 else 2.0**-7  # the two builds may contract exp's polynomial differently
        torch.testing.assert_close(got, cpu_ops.silu_and_mul(product), rtol=ulp, atol=ulp)
        gate, up = product.double().chunk(2, dim=-1)
        torch.testing.assert_close(got.double(), F.silu(gate) * up, rtol=4 * ulp, atol=4 * ulp)
    with pytest.raises(ValueError, match="two equal halves"):
        cpu_gemm.pack(w[1:], gate_up=True)
    with pytest.raises(RuntimeError, match="no bias"):
        cpu_gemm.linear(x, fused, 2 * inter, torch.zeros(2 * inter), gate_up=True)


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


@pytest.mark.parametrize("weights", ["fp32", "bf16 pairs", "int8"])
def test_no_rows_give_an_empty_product(weights: str) -> None:
    """A batch of zero rows returns [0, N] (it divided by zero: the process died of SIGFPE)."""
    if weights == "bf16 pairs" and not cpu_gemm.bf16_dot():
        pytest.skip("no AVX-512 BF16: no pair panels")
    w = torch.randn(40, 64)
    if weights == "int8":
        got = cpu_gemm.linear(torch.randn(0, 64), cpu_gemm.pack(w.to(torch.int8)), 40, scale=torch.ones(40))
    else:
        dtype = torch.float32 if weights == "fp32" else torch.bfloat16
        got = cpu_gemm.linear(torch.randn(0, 64, dtype=dtype), cpu_gemm.pack(w.to(dtype)), 40)
    assert got.shape == (0, 40)


@pytest.mark.parametrize("pairs", [False, True])
def test_output_takes_the_input_dtype(pairs: bool) -> None:
    if pairs and not cpu_gemm.bf16_dot():
        pytest.skip("no AVX-512 BF16: no pair panels")
    x = torch.randn(5, 200).bfloat16()
    w = torch.randn(70, 200).bfloat16()
    got = cpu_gemm.linear(x, cpu_gemm.pack(w, pairs=pairs), 70)
    assert got.dtype == torch.bfloat16
    ref = F.linear(x.double(), w.double())
    # fp32 sums rounded once to bf16: within one bf16 step (2^-8 relative) of the exact value
    assert bool(((got.double() - ref).abs() <= ref.abs() * 2.0**-8 + 1e-4).all())


def test_bad_inputs_raise() -> None:
    packed = cpu_gemm.pack(torch.randn(32, 64))
    with pytest.raises(RuntimeError, match="does not fit"):
        cpu_gemm.linear(torch.randn(3, 65), packed, 32)
    with pytest.raises(RuntimeError, match="not a packed weight"):
        cpu_gemm.linear(torch.randn(3, 64), torch.randn(32, 64), 32)
    if cpu_gemm.bf16_dot():
        pairs = cpu_gemm.pack(torch.randn(32, 63).bfloat16(), pairs=True)  # an odd K: padded with a zero input
        assert cpu_gemm.linear(torch.randn(3, 63), pairs, 32).shape == (3, 32)
        with pytest.raises(RuntimeError, match="does not fit"):
            cpu_gemm.linear(torch.randn(3, 62), pairs, 32)
