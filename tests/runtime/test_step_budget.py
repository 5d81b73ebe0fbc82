"""The step budget (max_num_batched_tokens): as configured, or derived from the model (null, the default)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rtp.config import ModelConfig, ParallelConfig, RtpConfig, SchedulerConfig
from rtp.distributed.parallel import ParallelState
from rtp.model.qwen3 import Qwen3Spec
from rtp.model.qwen3_moe import Qwen3MoeSpec
from rtp.runtime.engine import Engine
from rtp.runtime.model_runner import CPU_RECYCLED_BYTES, GPU_STEP_TOKENS, ModelRunner, step_token_budget
from rtp.testing import default_model_dir

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
# Qwen3-0.6B's and Qwen3-8B's shapes (random weights are not needed: only the shape matters).
QWEN3_06B = Qwen3Spec(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
                      num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, tie_word_embeddings=True,
                      max_position_embeddings=40960, attention_bias=False)
QWEN3_8B = dataclasses.replace(QWEN3_06B, hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32)


def widest_row_bytes(spec: Qwen3Spec, dtype: torch.dtype, tp: int) -> int:
    """Bytes per token of this rank's largest activation, computed independently of the code under test."""
    qkv = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    widths = [qkv, 2 * spec.intermediate_size]
    if isinstance(spec, Qwen3MoeSpec):
        widths.append(2 * spec.moe_intermediate_size * spec.num_experts_per_tok)
    return max(widths) // tp * torch.tensor([], dtype=dtype).element_size()


def test_a_configured_budget_is_kept_on_any_device() -> None:
    for device in (CPU, CUDA):
        assert step_token_budget(48, device, QWEN3_8B, torch.float32, 1, 256) == 48
        assert step_token_budget(100_000, device, QWEN3_06B, torch.float32, 1, 256) == 100_000


def test_gpu_default_is_8192() -> None:
    assert step_token_budget(None, CUDA, QWEN3_06B, torch.bfloat16, 1, 256) == GPU_STEP_TOKENS == 8192


@pytest.mark.parametrize("spec", [QWEN3_06B, QWEN3_8B], ids=["0.6b", "8b"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_cpu_default_is_the_largest_power_of_two_within_the_ceiling(spec: Qwen3Spec, dtype: torch.dtype,
                                                                    tp: int) -> None:
    budget = step_token_budget(None, CPU, spec, dtype, tp, max_num_seqs=1)
    row = widest_row_bytes(spec, dtype, tp)
    assert budget & (budget - 1) == 0 and 1 <= budget <= GPU_STEP_TOKENS
    assert budget * row <= CPU_RECYCLED_BYTES
    assert budget == GPU_STEP_TOKENS or 2 * budget * row > CPU_RECYCLED_BYTES  # the largest that fits


def test_cpu_default_examples_and_floors() -> None:
    # Qwen3-0.6B fp32: gate_up is 24 KiB per token, so 1024 tokens (24 MiB) fit and 2048 (48 MiB) do not.
    assert step_token_budget(None, CPU, QWEN3_06B, torch.float32, 1, 1) == 1024
    assert step_token_budget(None, CPU, QWEN3_06B, torch.bfloat16, 1, 1) == 2048  # half the bytes
    assert step_token_budget(None, CPU, QWEN3_06B, torch.float32, 2, 1) == 2048  # half the columns per rank
    # never below max_num_seqs (every running sequence decodes in each step), nor above 8192 for it
    assert step_token_budget(None, CPU, QWEN3_8B, torch.float32, 1, 512) == 512
    assert step_token_budget(None, CPU, QWEN3_8B, torch.float32, 1, 100_000) == GPU_STEP_TOKENS


def test_moe_experts_count_when_wider() -> None:
    moe = Qwen3MoeSpec(**dataclasses.asdict(QWEN3_06B) | dict(intermediate_size=512),
                       num_experts=64, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                       sparse_layers=tuple(range(28)))
    budget = step_token_budget(None, CPU, moe, torch.float32, 1, 1)
    assert budget * widest_row_bytes(moe, torch.float32, 1) <= CPU_RECYCLED_BYTES
    assert budget < step_token_budget(None, CPU, dataclasses.replace(QWEN3_06B, intermediate_size=512),
                                      torch.float32, 1, 1)  # the routed tokens' gate/up is the widest


def test_the_engine_schedules_with_the_runners_budget() -> None:
    model_dir = default_model_dir()
    for configured in (None, 40):
        config = RtpConfig(model=ModelConfig(dtype="float32"), parallel=ParallelConfig(device="cpu"),
                           scheduler=SchedulerConfig(max_num_batched_tokens=configured, max_num_seqs=8))
        runner = ModelRunner(ParallelState.single("cpu"), model_dir, config)
        expected = step_token_budget(configured, CPU, runner.spec, torch.float32, 1, 8)
        assert runner.max_num_batched_tokens == expected
        assert Engine(config, runner, model_dir).scheduler.config.max_num_batched_tokens == expected
