"""Decode steps on CPU as bound kernel calls (rtp.model.cpu_decode): the modules' numbers, where they serve.

Against HF transformers the bound path is checked by every test that decodes on CPU (tests/model/test_tp_vs_hf.py
at TP = 1, 2, 4, the engine and server tests); here against the modules it replaces, bit for bit.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from rtp.config import CacheConfig, ModelConfig, RtpConfig
from rtp.core.step import CachedSeq, NewSeq, StepPlan
from rtp.distributed.parallel import ParallelState
from rtp.runtime.model_runner import ModelRunner
from rtp.testing import TinyQwen3MoeSpec, TinyQwen3Spec, make_tiny_qwen3

BLOCK = 16
SPEC = TinyQwen3Spec(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32)


def _runner(model_dir: Path, dtype: str, kv_cache_dtype: str = "auto") -> ModelRunner:
    config = RtpConfig(model=ModelConfig(dtype=dtype, enforce_eager=True),
                       cache=CacheConfig(block_size=BLOCK, num_kv_blocks=64, kv_cache_dtype=kv_cache_dtype))  # type: ignore[arg-type]
    return ModelRunner(ParallelState.single("cpu"), model_dir, config)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bound_decode_steps_equal_the_modules_bit_for_bit(tmp_path, dtype):
    model_dir = make_tiny_qwen3(tmp_path / "m", SPEC)
    bound, modules = _runner(model_dir, dtype), _runner(model_dir, dtype)
    assert bound.cpu_decode is not None, "the bound calls serve a dense model on CPU"
    modules.cpu_decode = None  # this one decodes through the modules
    calls = []
    run = bound.cpu_decode.run
    bound.cpu_decode.run = lambda *a: calls.append(1) or run(*a)  # type: ignore[method-assign]

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, SPEC.vocab_size, (n,), generator=g).tolist() for n in (5, 17, 33, 1)]
    steps = 24
    # Each sequence's blocks, enough for its decode steps; in reverse order, so no table is the identity.
    tables, free = [], list(range(63, -1, -1))
    for p in prompts:
        n = -(-(len(p) + steps) // BLOCK)
        tables.append(free[:n])
        free = free[n:]
    plan = StepPlan(new_seqs=[NewSeq(i, p, tables[i], 0, len(p)) for i, p in enumerate(prompts)])
    for step in range(steps + 1):
        got, want = bound.execute(plan).sample_logits, modules.execute(plan).sample_logits
        assert got is not None and want is not None
        assert torch.equal(got, want), f"step {step}: max |diff| {(got - want).abs().max()}"
        tokens = got.argmax(-1).tolist()
        plan = StepPlan(cached_seqs=[CachedSeq(i, 1, [t], []) for i, t in enumerate(tokens)])
    assert len(calls) == steps  # every decode step ran the bound calls (the prompt step the modules)
    for a, b in zip(bound.model.attention_layers(), modules.model.attention_layers(), strict=True):
        assert torch.equal(a.k_cache, b.k_cache) and torch.equal(a.v_cache, b.v_cache)


def test_decode_goes_through_the_modules_where_the_bound_calls_would_differ(tmp_path, caplog):
    dense = make_tiny_qwen3(tmp_path / "dense", SPEC)
    # an FP8 cache: the torch attention path quantizes and dequantizes, the C++ kernels read the compute dtype
    with caplog.at_level(logging.INFO, logger="rtp"):
        assert _runner(dense, "float32", "fp8_e4m3").cpu_decode is None
    assert "decode steps run through the modules: the attention is not the C++ backend" in caplog.text
    # a sparse MoE block: not the dense MLP the bound calls run
    assert _runner(make_tiny_qwen3(tmp_path / "moe", TinyQwen3MoeSpec()), "float32").cpu_decode is None
    # EAGLE-3's auxiliary hidden states come from the modules
    runner = _runner(dense, "float32")
    assert runner.cpu_decode is not None
    runner.request_aux_hidden((1,))
    assert runner.cpu_decode is None
