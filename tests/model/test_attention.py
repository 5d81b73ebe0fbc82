"""PagedAttention's flash-attn path against its torch path (CUDA only: run by scripts/gpu_check.sh)."""

from __future__ import annotations

import pytest
import torch

from rtp.model.attention import PagedAttention, flash_attn_available
from tests.kernels.paged_attention_cases import step_metadata as _meta


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(not flash_attn_available(), reason="flash-attn is not installed")
@pytest.mark.parametrize("q_lens, k_lens", [([5, 1, 300], [5, 40, 600]), ([1, 1, 1], [7, 300, 513])])
def test_flash_attention_matches_torch_path(q_lens, k_lens):
    torch.manual_seed(0)
    dev, bs, hq, hkv, d = torch.device("cuda"), 256, 8, 2, 128
    tables = [[3 * i + j for j in range(-(-k // bs))] for i, k in enumerate(k_lens)]
    attn = PagedAttention(hq, hkv, d, d**-0.5)
    attn.k_cache = torch.randn(16, bs, hkv, d, device=dev, dtype=torch.bfloat16)
    attn.v_cache = torch.randn_like(attn.k_cache)
    t = sum(q_lens)
    q = torch.randn(t, hq, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(t, hkv, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    meta = _meta(q_lens, k_lens, tables, bs, dev)
    flash = attn(q, k, v, meta)  # stores k/v into the cache, then attends
    attn.k_cache, attn.v_cache = attn.k_cache.float(), attn.v_cache.float()
    ref = attn._torch(q.float(), k.float(), v.float(), meta, meta.block_tables)
    assert torch.allclose(flash.float(), ref, atol=2e-2, rtol=2e-2)
