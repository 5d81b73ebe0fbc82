"""GPU-only checks (run by scripts/gpu_check.sh): flash-attn paths and CUDA graphs against the torch path."""

from __future__ import annotations

import pytest
import torch

from rtp.model.attention import AttnMetadata, PagedAttention, flash_attn_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _meta(q_lens, k_lens, tables, block_size, device):
    slots = []
    for q, k, t in zip(q_lens, k_lens, tables):
        for pos in range(k - q, k):
            slots.append(t[pos // block_size] * block_size + pos % block_size)
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    return AttnMetadata(torch.tensor(slots, device=device), cu_q, cu_k,
                        torch.tensor(k_lens, dtype=torch.int32, device=device), bt, max(q_lens), max(k_lens),
                        list(q_lens), list(k_lens))


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
    ref = attn._torch(q.float(), k.float(), v.float(), meta, True)
    assert torch.allclose(flash.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not flash_attn_available(), reason="flash-attn is not installed")
def test_cuda_graph_decode_matches_eager(tmp_path):
    from rtp.core.step import CachedSeq, NewSeq, StepPlan
    from rtp.dist.parallel import ParallelState
    from rtp.runtime.model_runner import ModelRunner
    from rtp.testing import TinyQwen3Spec, make_tiny_qwen3

    spec = TinyQwen3Spec(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         intermediate_size=512)
    path = make_tiny_qwen3(tmp_path / "m", spec)
    outs = []
    for eager in (True, False):
        runner = ModelRunner(ParallelState.single("cuda"), path, dtype="bfloat16", block_size=256, num_kv_blocks=16,
                             enforce_eager=eager, cuda_graph_max_batch=8)
        prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
        logits = [runner.execute(StepPlan(new_seqs=[NewSeq(i, p, [i], 0, len(p)) for i, p in enumerate(prompts)]))]
        for _ in range(5):
            nxt = logits[-1].argmax(-1).tolist()
            logits.append(runner.execute(StepPlan(cached_seqs=[CachedSeq(i, 1, [nxt[i]], []) for i in range(2)])))
        assert (runner.graphs is None) == eager
        outs.append(torch.stack(logits))
    # bf16, and flash-attn may split the KV differently for the graph's wider block table.
    assert torch.allclose(outs[0], outs[1], atol=5e-2, rtol=5e-2)
    assert torch.equal(outs[0].argmax(-1), outs[1].argmax(-1))
