"""int8 weights quantized at load (``quantization: int8``) for CPU decode: W8A8 on VNNI CPUs, else W8A16.

Decode reads every weight once per step and is bound by memory bandwidth: int8 weights are a
quarter of fp32's bytes and half of bf16's. Each attention and MLP projection (after sharding, so
a rank's scales cover its own slice) gets symmetric per-output-channel scales,
``scale[n] = max_k |W[n, k]| / 127`` and ``q = round(W / scale)`` in [-127, 127]; the product is
``y = (x qᵀ) * scale`` with activations in the compute dtype.

On CPUs with AVX-512 VNNI the product is computed in int8 (:mod:`rtp.kernels.cpu_int8_gemm`: the
activations quantized per row and group of 128 inputs as they arrive, then AMX tiles or
``vpdpbusd``), for fp32 and bf16 activations alike: at Qwen3-0.6B's shapes it is 1.9x oneDNN's
bf16 product at 8 rows and 2.4x at one (it streams half of bf16's bytes), 1.6x at 32 rows, and
slower for long prompt steps (0.76x at 256 rows, against oneDNN's bf16 AMX kernel).

Elsewhere on CPU, with fp32 activations, the product is rtp's panel GEMM over int8 panels (the weight widened
in registers, the scale applied once per output: it streams a quarter of fp32's bytes; torch's
``_weight_int8pack_mm`` computes fp32 at 1-3 GB/s of weight, 10-40x slower at M = 1-32 on an
AVX-512 CPU). With bf16 activations it is ``_weight_int8pack_mm`` (x in bf16, int8 ``[N, K]``,
scale ``[N]``), which measured faster than the panels there. That bf16 kernel crashes the process
when K is not a multiple of 8 (torch 2.13), so those shapes, other dtypes and other devices (CUDA:
W8A16 dequantize-then-matmul) take ``F.linear(x, q.to(x.dtype)) * scale``. The LM head is int8
too; the MoE router and the experts stay as they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rtp.kernels import cpu_gemm, cpu_int8_gemm
from rtp.model.embedding import ParallelLMHead
from rtp.model.linear import PLAIN, Bound, ColumnParallelLinear, LinearBase, PlainLinearMethod, RowParallelLinear


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` -> (int8 ``[N, K]``, fp32 scale ``[N]``) with ``weight ~ q * scale[:, None]``."""
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127.0  # [N]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: any scale is exact
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def int8_kernel_supported(device: torch.device, dtype: torch.dtype, in_features: int) -> bool:
    """True where ``torch._weight_int8pack_mm`` computes this product (see the module docstring)."""
    if device.type != "cpu" or not hasattr(torch, "_weight_int8pack_mm"):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and in_features % 8 == 0)


class Int8WeightOnlyMethod(PlainLinearMethod):
    """Loads the plain weight, then holds ``int8_scale [N]`` and the int8 values in its place: as VNNI panels
    only (``int8_panels``, ``int8_vnni``) where the CPU has AVX-512 VNNI, else as ``int8_weight [N, K]``, with
    (for fp32 where rtp's GEMM builds) the same values as its panels beside it."""

    name = "int8"

    def process_weights_after_loading(self, layer: LinearBase, keep_plain: bool = False) -> None:
        w = layer.weight.data  # [N, K] in the compute dtype
        layer.out_features = w.shape[0]
        layer.int8_kernel = int8_kernel_supported(w.device, w.dtype, w.shape[1])
        layer.int8_panels, layer.int8_vnni = None, False
        if w.device.type == "cpu" and cpu_int8_gemm.available():
            # Every product runs on these panels: the int8 values are kept there only (quantized and packed
            # in one pass: the same values and scales as quantize_per_channel).
            layer.int8_panels, scale = cpu_int8_gemm.quantize_pack(w)  # [ceil(N / 16), Kp / 4, 16, 4]
            layer.int8_weight, layer.int8_scale, layer.int8_vnni = None, scale.to(w.dtype), True
        else:
            q, scale = quantize_per_channel(w)
            layer.int8_weight, layer.int8_scale = q, scale.to(w.dtype)
            if w.device.type == "cpu" and w.dtype == torch.float32 and cpu_gemm.available():
                layer.int8_panels = cpu_gemm.pack(q)  # [ceil(N / NR), K, NR]
        if not keep_plain:
            layer.weight.data = torch.empty(0, dtype=w.dtype, device=w.device)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # x [T, K] -> [T, N]
        q, scale, panels = layer.int8_weight, layer.int8_scale, layer.int8_panels
        assert scale is not None, "int8 weights are set after loading"
        if panels is not None and layer.int8_vnni:
            return cpu_int8_gemm.linear(x, panels, layer.out_features, scale, bias)
        assert q is not None, "the int8 weight is kept wherever the VNNI panels are not"
        if panels is not None and x.dtype == torch.float32:
            return cpu_gemm.linear(x, panels, layer.out_features, bias, scale)
        if layer.int8_kernel and x.dtype == scale.dtype:
            y = torch._weight_int8pack_mm(x.contiguous(), q, scale)
        else:
            y = F.linear(x, q.to(x.dtype)) * scale.to(x.dtype)
        return y + bias if bias is not None else y

    def bound(self, layer: LinearBase) -> Bound | None:
        panels, scale = layer.int8_panels, layer.int8_scale
        if panels is None or scale is None:
            return None
        if layer.int8_vnni:
            return cpu_int8_gemm.bound(panels, layer.out_features, scale)
        # the fp32 panels serve fp32 activations, the compute dtype (the scales') here
        return cpu_gemm.bound(panels, layer.out_features, scale) if scale.dtype == torch.float32 else None


INT8 = Int8WeightOnlyMethod()


def quantize_int8(model: nn.Module) -> int:
    """Switch every attention and MLP projection of ``model`` (loaded, plain) and its LM head to int8;
    returns how many layers.

    At Qwen3's 151,936-token vocabulary the head is a quarter of a 0.6B model's weight bytes, read
    at every decode step. A tied head keeps the plain weight the embedding reads. The MoE router and
    the experts stay as they are.
    """
    layers = [m for m in model.modules()
              if isinstance(m, ColumnParallelLinear | RowParallelLinear | ParallelLMHead) and m.method is PLAIN]
    shared = {id(p) for m in model.modules() if not isinstance(m, LinearBase) for p in m.parameters(recurse=False)}
    for m in layers:
        m.method = INT8
        INT8.process_weights_after_loading(m, keep_plain=id(m.weight) in shared)
    return len(layers)
