"""The FP8 KV cache's kernels: the store rounds to e4m3, attention reads the dequantized cache (torch and Triton)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

from rtp.kernels.fp8_kv import FP8_KV_DTYPE, FP8_MAX, dequantize, kv_cache_dtype
from rtp.kernels.kv_store import check_store_kv_args, store_kv
from rtp.kernels.op_checks import KernelArgError
from rtp.kernels.paged_attention import check_paged_attention_args
from rtp.model import attention
from rtp.model.attention import PagedAttention, choose_attn_backend
from tests.kernels.fp8_kv_cases import attention_f64, e4m3_edges
from tests.kernels.paged_attention_cases import step_metadata

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_triton_fp8_kernels_match_references_under_interpreter():
    # The interpreter runs float8 (stored as uint8, converted in numpy); a subprocess, as TRITON_INTERPRET is
    # read when triton is imported.
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "tests.kernels.fp8_kv_cases", "--device", "cpu"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[-1] == "OK"
    assert any(line.startswith("store: triton == reference byte for byte") for line in lines)
    assert any(line.startswith("attention float32: kernels and references vs float64") for line in lines)
    assert any(line.startswith("model, fp8 cache: triton backend vs torch backend") for line in lines)


def _e4m3_step(y: torch.Tensor) -> torch.Tensor:
    """Spacing of e4m3's grid around |y| (computed from the format's definition: 3 mantissa bits, min exponent
    -6, subnormal step 2**-9), in float64."""
    exp = torch.floor(torch.log2(y.abs().clamp_min(2.0**-6)))
    return torch.exp2(exp - 3)


def test_store_rounds_to_the_nearest_e4m3_value_and_saturates():
    g = torch.Generator().manual_seed(1)
    k_scale, v_scale = torch.tensor([0.02]), torch.tensor([0.7])
    key = torch.cat([torch.randn(40, 2, 16, generator=g) * 4, e4m3_edges()[:32].view(1, 2, 16) * 0.02])
    value = torch.randn(41, 2, 16, generator=g) * 200  # some past 448 * 0.7
    slots = torch.randperm(6 * 8, generator=g)[:41]
    slots[::9] = -1
    k_cache = torch.full((6, 8, 2, 16), 3.0, dtype=FP8_KV_DTYPE)
    v_cache = k_cache.clone()
    store_kv(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    for x, cache, s in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        written = cache.view(-1, 2, 16)[slots[slots >= 0]].double()  # what the cache holds, unscaled
        y = (x[slots >= 0].double() / s.double()).clamp(-FP8_MAX, FP8_MAX)
        # Nearest: within half a step of the exact x / scale (saturated at 448).
        assert ((written - y).abs() <= _e4m3_step(y) / 2).all()
        assert written.abs().max() <= FP8_MAX
    assert v_cache.float().abs().max() == FP8_MAX  # some values did saturate
    untouched = torch.ones(6 * 8, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert (k_cache.view(-1, 2, 16)[untouched].float() == 3.0).all()  # skipped slots (-1) and free ones


@pytest.mark.parametrize("case", [([1, 1, 1], [1, 9, 30]), ([1, 5, 3], [12, 5, 10])], ids=["decode", "mixed"])
def test_layer_with_an_fp8_cache_matches_float64_on_the_dequantized_cache(case):
    # PagedAttention (torch backend, the CPU path) over three steps: what it returns is float64 attention over
    # what its cache holds, dequantized with the layer's scales.
    q_lens, k_lens = case
    g = torch.Generator().manual_seed(2)
    hq, hkv, d, bs = 4, 2, 16, 4
    layer = PagedAttention(hq, hkv, d, d**-0.5)
    layer.k_scale.fill_(0.05)
    layer.v_scale.fill_(0.3)
    layer.k_cache = torch.zeros(16, bs, hkv, d, dtype=FP8_KV_DTYPE)
    layer.v_cache = torch.zeros_like(layer.k_cache)
    blocks = torch.randperm(16, generator=g).tolist()
    tables = []
    for k_len in k_lens:  # disjoint, shuffled
        n = -(-k_len // bs)
        tables.append(blocks[:n])
        blocks = blocks[n:]
    # The prompts first (each sequence's keys before this step's), then the step under test.
    prompts = [k - q for q, k in zip(q_lens, k_lens) if k - q > 0]
    seqs = [i for i, (q, k) in enumerate(zip(q_lens, k_lens)) if k - q > 0]
    if prompts:
        meta = step_metadata(prompts, prompts, [tables[i] for i in seqs], bs, torch.device("cpu"))
        k, v = torch.randn(2, sum(prompts), hkv, d, generator=g) * 2
        layer(torch.randn(sum(prompts), hq, d, generator=g), k, v, meta)
    meta = step_metadata(q_lens, k_lens, tables, bs, torch.device("cpu"))
    q = torch.randn(sum(q_lens), hq, d, generator=g)
    k, v = torch.randn(2, sum(q_lens), hkv, d, generator=g) * 2
    got = layer(q, k, v, meta)
    want = attention_f64(q, layer.k_cache, layer.v_cache, layer.k_scale, layer.v_scale, meta.block_tables,
                         q_lens, k_lens, d**-0.5)
    assert (got.double() - want).abs().max() < 1e-5
    # The step's own keys, as the cache holds them, are within e4m3's rounding of what was given.
    stored = layer.k_cache.view(-1, hkv, d)[meta.slot_mapping].double() * 0.05
    assert ((stored - k.double()).abs() <= _e4m3_step(k.double() / 0.05) * 0.05 / 2 + 1e-12).all()


def test_fp8_cache_args_are_checked_with_one_line_errors():
    q = torch.zeros(2, 4, 16)
    cache = torch.zeros(3, 4, 2, 16, dtype=FP8_KV_DTYPE)
    tables, ctx = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    one = torch.ones(1)
    op = "rtp::paged_decode_attention"
    check_paged_attention_args(op, q, cache, cache, tables, ctx, None, one, one)  # fits
    with pytest.raises(KernelArgError, match="float8_e4m3fn cache needs v_scale"):
        check_paged_attention_args(op, q, cache, cache, tables, ctx, None, one, None)
    with pytest.raises(KernelArgError, match=r"k_scale is float16\[1\] on cpu; expected one float32"):
        check_paged_attention_args(op, q, cache, cache, tables, ctx, None, one.half(), one)
    with pytest.raises(KernelArgError, match="v_cache is float32 but k_cache is float8_e4m3fn"):
        check_paged_attention_args(op, q, cache, cache.float(), tables, ctx, None, one, one)
    key = torch.zeros(2, 2, 16)
    with pytest.raises(KernelArgError, match="needs k_scale"):
        check_store_kv_args(key, key, cache, cache, torch.zeros(2, dtype=torch.long))
    with pytest.raises(KernelArgError, match="needs k_scale"):  # the CPU path checks too
        store_kv(key, key, cache, cache.clone(), torch.zeros(2, dtype=torch.long))


def test_an_fp8_cache_skips_flash_attn_and_the_cpu_kernels():
    cpu, fp32 = torch.device("cpu"), torch.float32
    with mock.patch.object(attention.cpu_attention, "load", return_value=object()):
        assert choose_attn_backend(cpu, fp32) == "cpu"
        assert choose_attn_backend(cpu, fp32, FP8_KV_DTYPE) == "torch"
    cuda = torch.device("cuda")
    with mock.patch.object(attention, "use_flash_attn", return_value=True), \
            mock.patch.object(attention, "triton_available", return_value=True):
        assert choose_attn_backend(cuda, torch.bfloat16) == "flash"
        assert choose_attn_backend(cuda, torch.bfloat16, FP8_KV_DTYPE) == "triton"
    assert kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_dtype("fp8_e4m3", torch.bfloat16) == FP8_KV_DTYPE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_table_dequantize_equals_elementwise_conversion(dtype):
    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_KV_DTYPE).view(4, 8, 8)[:, ::2]
    scale = torch.tensor([0.37])
    got = dequantize(every_byte, scale, dtype)  # (a strided view: half the bytes)
    want = (every_byte.float() * scale).to(dtype)
    assert got.shape == want.shape and got.dtype == dtype
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[~got.isnan()], want[~want.isnan()])
