"""Triton paged attention matches its torch references (CPU, under TRITON_INTERPRET=1) and is chosen on CUDA."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rtp.kernels import paged_attention
from rtp.kernels.paged_attention import paged_decode_attention_reference, paged_prefill_attention_reference
from rtp.model import attention
from rtp.model.attention import PagedAttention, choose_attn_backend
from tests.kernels.paged_attention_cases import CPU_CASES
from tests.kernels.paged_attention_cases import step_metadata as _meta

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_triton_kernels_match_reference_under_interpreter():
    # A subprocess: TRITON_INTERPRET must be set before triton is imported.
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "tests.kernels.paged_attention_cases", "--device", "cpu"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[-1] == "OK"
    for case in CPU_CASES:  # every case ran and printed its error
        assert any(line.startswith(f"{case.name} float32: max abs error") for line in lines), case.name
    assert "PagedAttention triton backend vs torch backend: match" in lines
    assert "ModelRunner triton backend vs torch backend: match" in lines  # eager, the whole model


def test_no_cache_reference_equals_cached_reference():
    # The no-cache path (profiling run; plain causal SDPA) and the paged path agree on whole prompts.
    g = torch.Generator().manual_seed(0)
    q_lens, bs = [3, 6], 4
    q = torch.randn(9, 4, 8, generator=g)
    k, v = torch.randn(2, 9, 2, 8, generator=g)
    k_cache, v_cache = torch.zeros(2, 5, bs, 2, 8)
    tables = torch.tensor([[4, 0], [1, 3]], dtype=torch.int32)
    for cache, new in ((k_cache, k), (v_cache, v)):
        cache[4, :3], cache[1], cache[3, :2] = new[:3], new[3:7], new[7:]
    flat = paged_prefill_attention_reference(q, k, v, q_lens, q_lens, 0.3)
    paged = paged_prefill_attention_reference(q, k_cache, v_cache, q_lens, q_lens, 0.3, tables)
    assert torch.allclose(flat, paged, atol=1e-6)
    # and the first query of each sequence attends to its own key only: its output is that key's value
    assert torch.allclose(flat[[0, 3]], v[[0, 3]].repeat_interleave(2, dim=1), atol=1e-6)


def test_decode_reference_masks_past_context():
    g = torch.Generator().manual_seed(1)
    k_cache, v_cache = torch.randn(2, 3, 4, 1, 8, generator=g)
    q = torch.randn(1, 2, 8, generator=g)
    tables, ctx = torch.tensor([[2, 0, 1]], dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
    out = paged_decode_attention_reference(q, k_cache, v_cache, tables, ctx, 12, 0.5)
    v_cache[0, 1:] = 1e6  # positions 5.. (block 0 from offset 1) and block 1 are past the context
    v_cache[1] = 1e6
    assert torch.equal(out, paged_decode_attention_reference(q, k_cache, v_cache, tables, ctx, 12, 0.5))


def test_backend_choice(monkeypatch):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(attention, "flash_attn_varlen_func", None)  # flash-attn not installed
    monkeypatch.setattr(attention.cpu_attention, "load", lambda: None)  # no C++ compiler
    assert choose_attn_backend(cpu, torch.float32) == "torch"
    monkeypatch.setattr(attention.cpu_attention, "load", lambda: object())
    assert choose_attn_backend(cpu, torch.float32) == "cpu"
    assert choose_attn_backend(cuda, torch.bfloat16) == "triton"  # no CUDA call on this path
    monkeypatch.setattr(paged_attention, "triton", None)
    assert choose_attn_backend(cuda, torch.bfloat16) == "torch"
    # Without triton the rtp::paged_decode_attention op falls back to the torch reference.
    args = (torch.randn(1, 1, 16), torch.randn(1, 4, 1, 16), torch.randn(1, 4, 1, 16),
            torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32))
    torch.testing.assert_close(paged_attention.paged_decode_attention(*args, 1.0),
                               paged_decode_attention_reference(*args, 4, 1.0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(not paged_attention.triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("hq, hkv, d", [(8, 2, 128), (4, 4, 80)])  # GQA; MHA with a head_dim padded to 128
@pytest.mark.parametrize(
    "q_lens, k_lens",
    [([5, 1, 300], [5, 40, 600]), ([1, 1, 1, 1], [7, 16, 17, 1025]), ([1, 64, 1, 33], [16, 64, 1, 97])],
)
def test_triton_attention_matches_torch_path(q_lens, k_lens, hq, hkv, d):
    torch.manual_seed(0)
    dev, bs = torch.device("cuda"), 16
    need = [-(-k // bs) for k in k_lens]
    perm = torch.randperm(sum(need) + 4).tolist()  # shuffled, disjoint block tables
    tables = [perm[sum(need[:i]) : sum(need[: i + 1])] for i in range(len(need))]
    attn = PagedAttention(hq, hkv, d, d**-0.5)
    attn.backend = "triton"
    attn.k_cache = torch.randn(len(perm), bs, hkv, d, device=dev, dtype=torch.bfloat16)
    attn.v_cache = torch.randn_like(attn.k_cache)
    t = sum(q_lens)
    q = torch.randn(t, hq, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(t, hkv, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    meta = _meta(q_lens, k_lens, tables, bs, dev)
    out = attn(q, k, v, meta)  # stores k/v into the cache (Triton), then attends (Triton)
    assert torch.equal(attn.k_cache.view(-1, hkv, d)[meta.slot_mapping], k)
    assert torch.equal(attn.v_cache.view(-1, hkv, d)[meta.slot_mapping], v)
    attn.k_cache, attn.v_cache = attn.k_cache.float(), attn.v_cache.float()
    ref = attn._torch(q.float(), k.float(), v.float(), meta, meta.block_tables)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert torch.allclose(out.float(), ref, atol=2e-2, rtol=2e-2)
