"""The Triton KV-store kernel matches its torch reference (run under TRITON_INTERPRET=1 on CPU)."""

import os
import subprocess
import sys

import pytest
import torch

from rtp.kernels.kv_store import store_kv

CHECK = r"""
import torch
from rtp.kernels.kv_store import store_kv_reference, store_kv_triton
g = torch.Generator().manual_seed(0)
for heads, dim, block_size in [(1, 16, 4), (2, 32, 16), (4, 64, 8), (3, 16, 4)]:  # 3 x 16: not a power of two
    num_blocks, t = 12, 23
    key = torch.randn(t, heads, dim, generator=g)
    value = torch.randn(t, heads, dim, generator=g)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:t]
    slots[::5] = -1  # skipped rows (CUDA-graph padding)
    caches = [torch.zeros(num_blocks, block_size, heads, dim) for _ in range(4)]
    store_kv_reference(key, value, caches[0], caches[1], slots)
    store_kv_triton(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[2].abs().sum() > 0
    # non-contiguous rows (a q/k/v split view) are accepted as long as each row is contiguous
    qkv = torch.randn(t, 3 * heads * dim, generator=g)
    k_view = qkv[:, heads * dim : 2 * heads * dim].view(t, heads, dim)
    store_kv_triton(k_view, k_view, caches[2], caches[3], slots)
    store_kv_reference(k_view, k_view, caches[0], caches[1], slots)
    assert torch.equal(caches[0], caches[2])
print("OK")
"""


@pytest.mark.timeout(300)
def test_triton_kernel_matches_reference_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK" in out.stdout


def test_reference_writes_each_slot_and_skips_negative():
    key = torch.arange(2 * 3 * 4, dtype=torch.float32).view(3, 2, 4) + 1
    k_cache, v_cache = torch.zeros(2, 4, 2, 4), torch.zeros(2, 4, 2, 4)
    store_kv(key, -key, k_cache, v_cache, torch.tensor([5, -1, 0]))
    flat = k_cache.view(8, 2, 4)
    assert torch.equal(flat[5], key[0]) and torch.equal(flat[0], key[2])
    assert torch.equal(v_cache.view(8, 2, 4)[5], -key[0])
    assert flat[[1, 2, 3, 4, 6, 7]].abs().sum() == 0  # row 1 (slot -1) was not written anywhere
