"""CudaGraphs bookkeeping with real values on the CPU (graph objects recorded, not captured):
padded replays fill the static buffers as the decode kernels expect. On a CUDA GPU (scripts/gpu_check.sh):
decode replayed from graphs equals eager decode, with flash-attn and with Triton."""

from __future__ import annotations

import pytest
import torch

from rtp.fake_cuda.device import FakeCuda
from rtp.kernels.paged_attention import triton_available
from rtp.model.attention import AttnMetadata, flash_attn_available
from rtp.runtime.model_runner import CudaGraphs
from tests.kernels.paged_attention_cases import runner_logits


class _Model:
    """Records the static inputs of every call; returns hidden rows that encode the token id."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, bool]] = []

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        self.calls.append((ids.shape[0], fake.capturing))
        return ids[:, None].float().expand(-1, 4).clone()


fake = FakeCuda()


def test_padded_replay_fills_static_buffers():
    model = _Model()
    cpu = torch.device("cpu")
    with fake.activate():
        graphs = CudaGraphs(model, cpu, max_batch=8, max_blocks=6, hidden=4, dtype=torch.float32)  # type: ignore[arg-type]
        # Largest first, each size warmed up eagerly then captured once, into one pool.
        assert model.calls == [(n, capturing) for n in (8, 4, 2, 1) for capturing in (False, True)]
        assert [g.record.captures for g in fake.graphs] == [1, 1, 1, 1]
        assert all(g.record.pool is fake.graphs[0].pool() for g in fake.graphs[1:])
        b = 3
        meta = AttnMetadata(
            slot_mapping=torch.tensor([17, 40, 5]), cu_seqlens_q=torch.arange(4, dtype=torch.int32),
            cu_seqlens_k=torch.tensor([0, 2, 5, 9], dtype=torch.int32),
            context_lens=torch.tensor([2, 3, 4], dtype=torch.int32),
            block_tables=torch.tensor([[1, 0], [2, 0], [3, 4]], dtype=torch.int32),
            max_seqlen_q=1, max_seqlen_k=4, q_lens=[1, 1, 1], k_lens=[2, 3, 4],
        )
        graphs.tables.fill_(9)  # stale entries of an earlier, wider batch
        out = graphs.run(torch.tensor([11, 12, 13]), torch.tensor([1, 2, 3]), meta)
    assert [g.record.replays for g in fake.graphs] == [0, 1, 0, 0]  # the graph of 4 (sizes 8, 4, 2, 1)
    assert out.shape == (3, 4)
    assert graphs.ids[:b].tolist() == [11, 12, 13] and graphs.pos[:b].tolist() == [1, 2, 3]
    assert graphs.slots[:4].tolist() == [17, 40, 5, -1]  # the padding row stores nothing
    assert graphs.ctx[:4].tolist() == [2, 3, 4, 1]  # and reads one key of block 0
    assert graphs.tables[:4].tolist() == [[1, 0, 0, 0, 0, 0], [2, 0, 0, 0, 0, 0], [3, 4, 0, 0, 0, 0], [0] * 6]
    assert graphs.fits(8, 6) and not graphs.fits(9, 6) and not graphs.fits(8, 7)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
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
    # bf16 logits of two implementations differ by their rounding (another summation order, fp32 vs bf16
    # intermediates): both are measured against the float32 model, and Triton must be no further from it.
    ref = runner_logits(path, "torch", True, dev, "float32")
    err_triton = (eager_triton.float() - ref).abs().max().item()
    err_torch = (eager_torch.float() - ref).abs().max().item()
    assert err_triton <= 1.5 * err_torch + 1e-2, f"triton bf16 {err_triton:.3g} vs torch bf16 {err_torch:.3g} from fp32"
