"""Steps on CPU as bound kernel calls (rtp.model.cpu_forward): the modules' numbers, where they serve.

Against HF transformers the bound path is checked by every test that runs a model on CPU (tests/model/test_tp_vs_hf.py
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
from rtp.kernels import cpu_gemm, cpu_int8_gemm
from rtp.model.linear import onednn_packing_supported
from rtp.model.quant import int8
from rtp.runtime import model_runner
from rtp.runtime.model_runner import ModelRunner
from rtp.testing import TinyQwen3MoeSpec, TinyQwen3Spec, make_tiny_qwen3

BLOCK = 16
SPEC = TinyQwen3Spec(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32)


def _runner(model_dir: Path, dtype: str, kv_cache_dtype: str = "auto", quantization: str | None = None) -> ModelRunner:
    config = RtpConfig(model=ModelConfig(dtype=dtype, enforce_eager=True, quantization=quantization),
                       cache=CacheConfig(block_size=BLOCK, num_kv_blocks=64, kv_cache_dtype=kv_cache_dtype))  # type: ignore[arg-type]
    return ModelRunner(ParallelState.single("cpu"), model_dir, config)


# How the linears multiply: rtp's panel GEMM, oneDNN's packed linear (each forced, whatever this CPU picks), int8
# weight-only on the VNNI kernel where this CPU has it, and on the panel GEMM's int8 panels.
LINEARS = ["gemm", "onednn", "int8", "int8-panels"]


def _linears(monkeypatch, linears: str) -> str | None:
    """Make the runners built next multiply their linears as ``linears`` says; returns their quantization."""
    if linears == "gemm":
        if not cpu_gemm.available():
            pytest.skip("rtp's panel GEMM did not build on this machine")
        monkeypatch.setattr(model_runner, "cpu_linear_method", lambda device, dtype: "gemm")
    if linears == "onednn":
        if not onednn_packing_supported(torch.device("cpu"), torch.bfloat16):
            pytest.skip("oneDNN's packed bf16 linear does not run on this CPU")
        monkeypatch.setattr(model_runner, "cpu_linear_method", lambda device, dtype: "onednn")
    if linears == "int8" and not cpu_int8_gemm.available():
        pytest.skip("no int8 VNNI kernel on this CPU")
    if linears == "int8-panels":
        monkeypatch.setattr(int8.cpu_int8_gemm, "available", lambda: False)
    return "int8" if linears.startswith("int8") else None


# int8 panels serve fp32 activations (bf16 ones without VNNI take torch's int8 matmul, through the modules)
CASES = [(dtype, linears) for dtype in ("float32", "bfloat16") for linears in LINEARS
         if (dtype, linears) != ("bfloat16", "int8-panels")]


@pytest.mark.parametrize(("dtype", "linears"), CASES)
def test_bound_steps_equal_the_modules_bit_for_bit(tmp_path, monkeypatch, dtype, linears):
    model_dir = make_tiny_qwen3(tmp_path / "m", SPEC)
    quantization = _linears(monkeypatch, linears)
    bound, modules = (_runner(model_dir, dtype, quantization=quantization) for _ in range(2))
    assert bound.cpu_forward is not None, "the bound calls serve a dense model on CPU"
    proj = bound.model.model.layers[0].mlp.down_proj
    assert type(proj.method).__name__ == {"gemm": "CpuGemmLinearMethod", "onednn": "OneDNNPackedLinearMethod"}.get(
        linears, "Int8WeightOnlyMethod")
    assert proj.int8_vnni == (linears == "int8")
    modules.cpu_forward = None  # this one runs through the modules
    calls = []
    run = bound.cpu_forward.run
    bound.cpu_forward.run = lambda *a: calls.append(1) or run(*a)  # type: ignore[method-assign]

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, SPEC.vocab_size, (n,), generator=g).tolist() for n in (5, 17, 33, 1)]
    steps = 24
    # Each sequence's blocks, enough for its decode steps; in reverse order, so no table is the identity.
    tables, free = [], list(range(63, -1, -1))
    for p in prompts:
        n = -(-(len(p) + steps + 4) // BLOCK)
        tables.append(free[:n])
        free = free[n:]
    # A prompt step (prompt 2 in two chunks), then its last chunk beside the others' first decodes (a mixed
    # step), decode steps, and one step of three tokens for sequence 0 beside one for the others (as a
    # speculative verification computes).
    first = [NewSeq(i, p, tables[i], 0, len(p) - (20 if i == 2 else 0)) for i, p in enumerate(prompts)]
    plans = [StepPlan(new_seqs=first)]
    got_tokens: list[list[int]] = []

    def step(plan: StepPlan) -> list[int]:
        got, want = bound.execute(plan).sample_logits, modules.execute(plan).sample_logits
        assert got is not None and want is not None
        assert torch.equal(got, want), f"step {len(got_tokens)}: max |diff| {(got - want).abs().max()}"
        got_tokens.append(got.argmax(-1).tolist())
        return got_tokens[-1]

    tokens = step(plans[0])  # rows: prompts 0, 1, 3 (prompt 2's first chunk samples nothing)
    last = {0: tokens[0], 1: tokens[1], 3: tokens[2]}
    mixed = [CachedSeq(2, 20, [], [])] + [CachedSeq(i, 1, [last[i]], []) for i in (0, 1, 3)]
    tokens = step(StepPlan(cached_seqs=mixed))
    last = dict(zip((2, 0, 1, 3), tokens, strict=True))
    for _ in range(steps):
        tokens = step(StepPlan(cached_seqs=[CachedSeq(i, 1, [last[i]], []) for i in range(4)]))
        last = dict(enumerate(tokens))
    three = [CachedSeq(0, 3, [last[0], 7, 9], [])] + [CachedSeq(i, 1, [last[i]], []) for i in (1, 2, 3)]
    step(StepPlan(cached_seqs=three))
    assert len(calls) == steps + 3  # every step ran the bound calls
    for a, b in zip(bound.model.attention_layers(), modules.model.attention_layers(), strict=True):
        assert torch.equal(a.k_cache, b.k_cache) and torch.equal(a.v_cache, b.v_cache)


def test_decode_goes_through_the_modules_where_the_bound_calls_would_differ(tmp_path, monkeypatch, caplog):
    dense = make_tiny_qwen3(tmp_path / "dense", SPEC)
    # an FP8 cache: the torch attention path quantizes and dequantizes, the C++ kernels read the compute dtype
    with caplog.at_level(logging.INFO, logger="rtp"):
        assert _runner(dense, "float32", "fp8_e4m3").cpu_forward is None
    assert "steps run through the modules: the attention is not the C++ backend" in caplog.text
    # int8 weights with bf16 activations and no VNNI kernel: torch's int8 matmul, no bound call
    _linears(monkeypatch, "int8-panels")
    with caplog.at_level(logging.INFO, logger="rtp"):
        assert _runner(dense, "bfloat16", quantization="int8").cpu_forward is None
    assert "a linear's method has no bound kernel call (Int8WeightOnlyMethod)" in caplog.text
    monkeypatch.undo()
    # a sparse MoE block: not the dense MLP the bound calls run
    assert _runner(make_tiny_qwen3(tmp_path / "moe", TinyQwen3MoeSpec()), "float32").cpu_forward is None
    # EAGLE-3's auxiliary hidden states come from the modules
    runner = _runner(dense, "float32")
    assert runner.cpu_forward is not None
    runner.request_aux_hidden((1,))
    assert runner.cpu_forward is None
