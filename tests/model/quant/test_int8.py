"""int8 weights against references: the quantization, each compute path of a layer, whole models at TP 1 and 2."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from rtp.assets import trained_model_dir
from rtp.distributed.parallel import ParallelState
from rtp.kernels import cpu_gemm, cpu_int8_gemm
from rtp.model.linear import ColumnParallelLinear, RowParallelLinear
from rtp.model.quant.int8 import INT8, int8_kernel_supported, quantize_int8, quantize_per_channel
from rtp.runtime.model_runner import load_model
from rtp.testing import TinyQwen3Spec, make_tiny_qwen3
from tests.utils import WORKERS, torchrun
from tests.workers.model_tp import run_model

ONE = ParallelState(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def test_per_channel_quantization_is_within_half_a_step():
    w = torch.randn(40, 96) * torch.logspace(-2, 1, 40)[:, None]  # rows of very different ranges
    w[3] = 0.0  # an all-zero row
    q, scale = quantize_per_channel(w)
    assert q.dtype == torch.int8 and q.abs().max() == 127
    err = (q.double() * scale.double()[:, None] - w.double()).abs()
    assert (err <= scale.double()[:, None] / 2 + 1e-7).all()
    assert (q[3] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", [(24, 96), (40, 100), (64, 256)])
@pytest.mark.parametrize("path", ["int8_gemm", "panels", "torch", "fallback"])
def test_int8_linear_matches_dequantized_reference(dtype, n, k, path):
    g = torch.Generator().manual_seed(n * k)
    layer = ColumnParallelLinear(k, n, ONE, bias=True)
    layer.weight.data = torch.randn(n, k, generator=g).to(dtype)
    layer.bias.data = torch.randn(n, generator=g).to(dtype)
    layer.method = INT8
    q, _ = quantize_per_channel(layer.weight.data)
    INT8.process_weights_after_loading(layer)
    assert layer.int8_kernel == int8_kernel_supported(torch.device("cpu"), dtype, k)
    assert (layer.int8_weight is None) == cpu_int8_gemm.available()  # the VNNI panels hold the only copy
    # On CPU: the int8 x int8 GEMM where the CPU has VNNI, else rtp's int8 panels for fp32 where they build
    assert layer.int8_vnni == cpu_int8_gemm.available()
    assert (layer.int8_panels is not None) == (cpu_int8_gemm.available() or
                                               (dtype == torch.float32 and cpu_gemm.available()))
    layer.int8_weight = q
    if path == "int8_gemm" and not cpu_int8_gemm.available():
        pytest.skip("the CPU has no AVX-512 VNNI")
    if path == "panels" and (dtype != torch.float32 or not cpu_gemm.available()):
        pytest.skip("rtp's int8 panels take fp32 activations")
    if path == "torch" and not layer.int8_kernel:
        pytest.skip("torch's int8 kernel does not compute this shape")
    layer.int8_panels, layer.int8_vnni = {
        "int8_gemm": (cpu_int8_gemm.pack(q) if path == "int8_gemm" else None, True),
        "panels": (cpu_gemm.pack(q) if path == "panels" else None, False),
    }.get(path, (None, False))
    layer.int8_kernel = path == "torch"
    x = torch.randn(7, k, generator=g).to(dtype)
    want = x.double() @ (q.double() * layer.int8_scale.double()[:, None]).T + layer.bias.double()
    got = layer(x)
    assert got.dtype == dtype and got.shape == (7, n)
    rel = ((got.double() - want).norm() / want.norm()).item()
    # int8 activations (groups of 128 inputs, 1/254 of their range per step) cost about 0.5% here
    bound = 2e-2 if path == "int8_gemm" or dtype == torch.bfloat16 else 1e-6
    assert rel < bound, rel


def test_int8_model_quantizes_every_projection_from_its_float_weight(tmp_path):
    path = make_tiny_qwen3(tmp_path / "m", TinyQwen3Spec(num_hidden_layers=1))
    ref, _ = load_model(path, ONE, torch.float32)
    model, _ = load_model(path, ONE, torch.float32, quantization="int8")
    projections = [m for m in model.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)]
    projections.append(model.lm_head)
    assert projections and all(m.method is INT8 for m in projections)
    assert model.lm_head.method is INT8  # the head too: at Qwen3's vocabulary it is a large share of the bytes
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.lm_head.weight.numel() > 0  # tied: kept
    # Every projection's int8 weight times its scales is its fp32 weight to within half a step.
    for name, m in model.named_modules():
        if m in projections:
            spec = model.spec
            k = {"o_proj": spec.num_heads * spec.head_dim,
                 "down_proj": spec.intermediate_size}.get(name.rsplit(".", 1)[-1], spec.hidden_size)
            plain = dict(ref.named_modules())[name].matmul(torch.eye(k)).t()  # [N, K] from the packed fp32 layer
            # The int8 layer's own product with the identity: q * scale (one-hot rows quantize exactly).
            dequant = m.matmul(torch.eye(k)).t()
            err = (dequant - plain).abs()
            assert (err <= m.int8_scale[:, None] / 2 + 1e-5 * plain.abs().max()).all(), name
    assert quantize_int8(model) == 0  # nothing plain is left to quantize


def _relative(logits: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest per-row relative L2 distance of ``logits [rows, vocab]`` from ``ref``."""
    return ((logits.float() - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()


@pytest.mark.timeout(300)
def test_int8_model_at_tp_1_and_2_stays_close_to_fp32(tmp_path):
    """int8 weights (and, on VNNI CPUs, int8 activations) through the paged runner at TP = 1 and 2, the
    row-parallel layers' scales computed per rank: final-token logits against HF's fp32 ones. Measured
    on the trained model: 0.007 relative with int8 activations (HF's own bf16 run: 0.002); a shard
    quantized with the wrong rows or scales would be off by ~1."""
    path = trained_model_dir()
    prompts = [list(range(5, 5 + n)) for n in (9, 1, 23)]
    hf32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.stack([hf32(torch.tensor([p])).logits[0, -1] for p in prompts])
    one = run_model(ParallelState.single(), str(path), prompts, 4, quantization="int8")
    out = tmp_path / "out.pt"
    torchrun(WORKERS / "model_tp.py", 2, "--out", str(out), "--prompts", json.dumps(prompts), "--steps", "4",
             "--quantization", "int8", str(path))
    two = torch.load(out)[str(path)]
    for tp, got in ((1, one), (2, two)):
        err = _relative(got["logits"], ref)
        assert err < 0.03, f"TP={tp}: int8 logits {err:.4f} (relative) from fp32"
    assert _relative(two["logits"], one["logits"].float()) < 0.03
