"""GPU-only checks (run by scripts/gpu_check.sh): flash-attn and Triton paths and CUDA graphs against the torch path."""

from __future__ import annotations

import pytest
import torch

from rtp.kernels.paged_attention import triton_available
from rtp.model.attention import PagedAttention, flash_attn_available
from tests.kernels.paged_attention_cases import runner_logits
from tests.kernels.paged_attention_cases import step_metadata as _meta

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


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
    from rtp.config import CacheConfig, ModelConfig, RtpConfig
    from rtp.core.step import CachedSeq, NewSeq, StepPlan
    from rtp.distributed.parallel import ParallelState
    from rtp.runtime.model_runner import ModelRunner
    from rtp.testing import TinyQwen3Spec, make_tiny_qwen3

    spec = TinyQwen3Spec(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         intermediate_size=512)
    path = make_tiny_qwen3(tmp_path / "m", spec)
    outs = []
    for eager in (True, False):
        config = RtpConfig(model=ModelConfig(dtype="bfloat16", enforce_eager=eager, cuda_graph_max_batch=8),
                           cache=CacheConfig(block_size=256, num_kv_blocks=16))
        runner = ModelRunner(ParallelState.single("cuda"), path, config)
        prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
        logits = [runner.execute(StepPlan(new_seqs=[NewSeq(i, p, [i], 0, len(p)) for i, p in enumerate(prompts)]))
                  .sample_logits]
        for _ in range(5):
            nxt = logits[-1].argmax(-1).tolist()
            plan = StepPlan(cached_seqs=[CachedSeq(i, 1, [nxt[i]], []) for i in range(2)])
            logits.append(runner.execute(plan).sample_logits)
        assert (runner.graphs is None) == eager
        outs.append(torch.stack(logits))
    # bf16, and flash-attn may split the KV differently for the graph's wider block table.
    assert torch.allclose(outs[0], outs[1], atol=5e-2, rtol=5e-2)
    assert torch.equal(outs[0].argmax(-1), outs[1].argmax(-1))


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
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
    ref = attn._torch(q.float(), k.float(), v.float(), meta, True)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert torch.allclose(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_cuda_graph_decode_with_triton_matches_eager_and_torch(tmp_path):
    from rtp.testing import TinyQwen3Spec, make_tiny_qwen3

    spec = TinyQwen3Spec(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         intermediate_size=512)
    path = make_tiny_qwen3(tmp_path / "m", spec)
    dev = torch.device("cuda")
    # Each run also asserts: block size 16 by default, every layer on the backend, graphs captured iff not eager.
    eager_torch = runner_logits(path, "torch", True, dev, "bfloat16")
    eager_triton = runner_logits(path, "triton", True, dev, "bfloat16")
    graph = runner_logits(path, "triton", False, dev, "bfloat16")
    assert torch.allclose(graph, eager_triton, atol=1e-2, rtol=1e-2)  # the same kernels, replayed
    assert torch.equal(graph.argmax(-1), eager_triton.argmax(-1))
    assert torch.allclose(eager_triton, eager_torch, atol=5e-2, rtol=5e-2)  # bf16, another summation order
