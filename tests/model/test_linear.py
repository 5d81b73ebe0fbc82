"""Packed linears equal F.linear (a SwiGLU gate ‖ up fused with its activation too), and packing keeps exactly
the weights other modules read."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rtp.distributed.parallel import ParallelState
from rtp.kernels import cpu_gemm
from rtp.model import linear as linear_module
from rtp.model.linear import (
    ColumnParallelLinear,
    GateUpParallelLinear,
    RowParallelLinear,
    cpu_linear_method,
    onednn_packing_supported,
    pack_linear_weights,
    pack_weight,
    packed_linear,
)
from rtp.model.ops import SiluAndMul

pytestmark = pytest.mark.skipif(
    not onednn_packing_supported(torch.device("cpu"), torch.float32), reason="torch built without oneDNN"
)


@pytest.mark.parametrize("rows", [0, 1, 3, 17, 64, 300])
@pytest.mark.parametrize("in_f, out_f", [(32, 48), (96, 7), (64, 1000)])
def test_packed_linear_matches_f_linear(rows: int, in_f: int, out_f: int) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + out_f)
    w = torch.randn(out_f, in_f, generator=g)
    b = torch.randn(out_f, generator=g)
    x = torch.randn(rows, in_f, generator=g)
    packed = pack_weight(w)
    torch.testing.assert_close(packed_linear(x, packed), F.linear(x, w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed_linear(x, packed, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    # A strided view (a q/k/v split) is a valid input too.
    wide = torch.randn(rows, 2 * in_f, generator=g)[:, :in_f]
    torch.testing.assert_close(packed_linear(wide, packed), F.linear(wide, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["onednn", "gemm"])
def test_layers_give_the_same_output_after_packing(method: str) -> None:
    if method == "gemm" and not cpu_gemm.available():
        pytest.skip("no C++ compiler: the CPU GEMM cannot be built")
    ps = ParallelState.single()
    torch.manual_seed(0)
    col, row = ColumnParallelLinear(24, 40, ps, bias=True), RowParallelLinear(40, 24, ps, bias=True)
    for p in (col.weight, col.bias, row.weight, row.bias):
        p.data.normal_()
    x = torch.randn(5, 24)
    before = row(col(x))
    assert pack_linear_weights(torch.nn.Sequential(col, row), method) == 2  # type: ignore[arg-type]
    assert col.packed is not None and col.weight.numel() == 0  # the plain copy is dropped
    assert col.packed_method == method
    torch.testing.assert_close(row(col(x)), before, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["onednn", "gemm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_up_silu_mul_is_silu_and_mul_of_the_product(method: str, dtype: torch.dtype) -> None:
    """A SwiGLU's gate ‖ up layer gives the activated product before packing, and after: fused into the panel
    GEMM (gate ‖ up panels), or the product then silu_and_mul (oneDNN); its plain product is unchanged."""
    if method == "gemm" and not cpu_gemm.available():
        pytest.skip("no C++ compiler: the CPU GEMM cannot be built")
    if method == "onednn" and not onednn_packing_supported(torch.device("cpu"), dtype):
        pytest.skip("oneDNN cannot pack this dtype here")
    torch.manual_seed(0)
    layer = GateUpParallelLinear(48, 40, ParallelState.single())
    layer.weight.data = torch.randn(80, 48).div(48**0.5).to(dtype)
    x = torch.randn(9, 48).to(dtype)
    product = layer(x)
    ref = SiluAndMul.reference(product.double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(layer.silu_mul(x).double(), ref, rtol=tol, atol=tol)
    pack_linear_weights(layer, method)  # type: ignore[arg-type]
    torch.testing.assert_close(layer(x), product, rtol=tol, atol=tol)
    got = layer.silu_mul(x)
    assert got.shape == (9, 40) and got.dtype == dtype
    torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol)
    if method == "gemm":  # the fused epilogue: the same numbers as the product then silu_and_mul
        torch.testing.assert_close(got, SiluAndMul()(layer(x)), rtol=2e-6, atol=2e-6)


def test_cpu_linear_method_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert cpu_linear_method(torch.device("meta"), torch.float32) is None
    assert cpu_linear_method(cpu, torch.float16) is None
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(cpu_gemm, "bf16_dot", lambda: False)  # no AVX-512 BF16 on an AVX2 CPU
    monkeypatch.setattr(cpu_gemm, "available", lambda: True)
    assert cpu_linear_method(cpu, torch.float32) == "gemm"  # AVX2: oneDNN's fp32 is slow at decode shapes
    monkeypatch.setattr(cpu_gemm, "available", lambda: False)
    assert cpu_linear_method(cpu, torch.float32) == "onednn"  # no compiler: oneDNN still beats F.linear
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(cpu_gemm, "available", lambda: True)
    monkeypatch.setattr(cpu_gemm, "bf16_dot", lambda: False)
    assert cpu_linear_method(cpu, torch.float32) == "onednn"
    if onednn_packing_supported(cpu, torch.bfloat16):
        # bf16: oneDNN only with native bf16 dot products; emulated, the panel GEMM reads half the bytes
        monkeypatch.setattr(linear_module, "native_bf16", lambda: True)
        assert cpu_linear_method(cpu, torch.bfloat16) == "onednn"
        monkeypatch.setattr(linear_module, "native_bf16", lambda: False)
        assert cpu_linear_method(cpu, torch.bfloat16) == "gemm"
    # AVX-512 BF16: the panel GEMM's bf16 pairs, on AMX tiles where the CPU has them; oneDNN where Linux refuses
    # the tiles
    monkeypatch.setattr(cpu_gemm, "bf16_dot", lambda: True)
    monkeypatch.setattr(cpu_gemm, "has_amx", lambda: False)
    monkeypatch.setattr(linear_module, "native_bf16", lambda: True)
    monkeypatch.setattr(linear_module, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    assert cpu_linear_method(cpu, torch.bfloat16) == "gemm"
    assert cpu_linear_method(cpu, torch.float32) == "gemm"  # Zen 4: the panel GEMM for fp32 as well
    monkeypatch.setattr(linear_module, "cpu_flags", lambda: frozenset({"avx512_bf16", "amx_bf16"}))
    assert cpu_linear_method(cpu, torch.float32) == "onednn"
    if onednn_packing_supported(cpu, torch.bfloat16):
        assert cpu_linear_method(cpu, torch.bfloat16) == "onednn"
    monkeypatch.setattr(cpu_gemm, "has_amx", lambda: True)
    assert cpu_linear_method(cpu, torch.bfloat16) == "gemm"
    assert cpu_linear_method(cpu, torch.float32) == "gemm"


def test_tied_lm_head_keeps_the_embedding_weight(tmp_path) -> None:  # noqa: ANN001
    from rtp.runtime.model_runner import load_model
    from rtp.testing import TinyQwen3Spec, make_tiny_qwen3

    for tied in (True, False):
        path = make_tiny_qwen3(tmp_path / str(tied), TinyQwen3Spec(tie_word_embeddings=tied))
        model, _ = load_model(path, ParallelState.single(), torch.float32)
        assert model.lm_head.packed is not None
        assert model.model.embed_tokens.weight.numel() > 0  # the embedding lookup still has its rows
        assert (model.lm_head.weight.numel() > 0) == tied  # an untied head drops its plain copy
        assert model.model.layers[0].mlp.gate_up_proj.weight.numel() == 0


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("tied", [True, False])
def test_checkpoint_shapes_are_the_tensors_of_hf_transformers(tmp_path, moe: bool, tied: bool) -> None:  # noqa: ANN001
    """The names and full shapes the linears' methods declare (plus norms and embeddings) are exactly HF's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rtp.runtime.model_runner import load_model
    from rtp.testing import TinyQwen3MoeSpec, TinyQwen3Spec, make_tiny_qwen3

    spec = TinyQwen3MoeSpec(tie_word_embeddings=tied) if moe else TinyQwen3Spec(tie_word_embeddings=tied)
    path = make_tiny_qwen3(tmp_path, spec)
    model, _ = load_model(path, ParallelState.single(), torch.float32)
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    expected: dict[str, list[int]] = {}
    for name, t in hf.state_dict().items():
        stem, _, leaf = name.rpartition(".experts.")
        if leaf not in ("gate_up_proj", "down_proj"):  # (older transformers name every expert's tensors)
            expected[name] = list(t.shape)
            continue
        # transformers 5 stacks the experts in memory; checkpoints (and rtp) hold one tensor per expert.
        for e in range(t.shape[0]):
            if leaf == "gate_up_proj":  # [E, 2 * I, H]
                half = [t.shape[1] // 2, t.shape[2]]
                expected[f"{stem}.experts.{e}.gate_proj.weight"] = expected[f"{stem}.experts.{e}.up_proj.weight"] = half
            else:  # down_proj [E, H, I]
                expected[f"{stem}.experts.{e}.{leaf}.weight"] = list(t.shape[1:])
    if tied:
        del expected["lm_head.weight"]  # the embedding, again
    assert model.checkpoint_shapes() == expected


def test_a_linear_method_declares_its_own_checkpoint_tensors() -> None:
    """The seam a quantized format plugs into: its parameters, its tensors, its matmul."""
    from rtp.model.linear import PlainLinearMethod, frozen_param

    class ScaledMethod(PlainLinearMethod):  # a weight plus one scale per output row
        def create_weights(self, layer, out_local, in_local, weight_loader) -> None:  # noqa: ANN001
            super().create_weights(layer, out_local, in_local, weight_loader)
            layer.weight_scale = frozen_param(torch.ones(out_local, 1), weight_loader)

        def checkpoint_tensors(self, prefix: str, out_features: int, in_features: int) -> dict[str, list[int]]:
            return super().checkpoint_tensors(prefix, out_features, in_features) | {
                prefix + ".weight_scale": [out_features, 1]}

        def apply(self, layer, x, bias):  # noqa: ANN001, ANN201
            return F.linear(x, layer.weight * layer.weight_scale, bias)

    from rtp.model.linear import MergedColumnParallelLinear

    ps = ParallelState.single()
    layer = MergedColumnParallelLinear(8, [6, 6], ps, method=ScaledMethod())
    assert layer.checkpoint_tensors({0: "mlp.gate_proj", 1: "mlp.up_proj"}) == {
        "mlp.gate_proj.weight": [6, 8], "mlp.gate_proj.weight_scale": [6, 1],
        "mlp.up_proj.weight": [6, 8], "mlp.up_proj.weight_scale": [6, 1]}
    layer.weight.data.normal_()
    layer.weight_scale.data.fill_(2.0)
    x = torch.randn(3, 8)
    torch.testing.assert_close(layer(x), F.linear(x, 2.0 * layer.weight))
