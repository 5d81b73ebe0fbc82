"""Qwen's FP8 block format: ``float8_e4m3fn`` weights with one scale per 128 x 128 block.

Checkpoint tensors of a projection of shape ``[N, K]`` (``quant_method: fp8``,
``weight_block_size: [128, 128]``): ``weight`` in ``float8_e4m3fn`` ``[N, K]`` and
``weight_scale_inv`` ``[ceil(N/128), ceil(K/128)]`` in bf16 (or fp32), with
``W[n, k] = weight[n, k] * weight_scale_inv[n // 128, k // 128]``.

A TP shard need not be a multiple of 128: the scale is read through an expanded view
(:class:`rtp.model.quant.views.BlockScaleView`), so a block cut by a shard boundary gives both
ranks its one scale, unchanged. Both tensors are multiplied into the weight as they load (it
starts at one): an e4m3 value is exact in bf16 and fp32, and the product with the scale is
rounded once, to the compute dtype. (With fp32 scales, a bf16 compute dtype and a scale read
before its weight, the scale is rounded to bf16 first: one more rounding. Qwen's scales are bf16.)

On CUDA the weight stays ``float8_e4m3fn`` (1 byte per element) and is multiplied by
:func:`rtp.kernels.quant_gemm.fp8_block_linear`: FP8 products with per-token-group activation
scales on compute capability 8.9+, else the weight decoded in the kernel next to bf16/fp16
activations. Its scales are loaded as one row of block scales per output row
(:class:`~rtp.model.quant.views.BlockRowScaleView`), then cut to the blocks of the rank's input
columns: a shard boundary inside a block costs nothing on either side.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rtp.kernels import quant_gemm
from rtp.model.quant.base import PackedQuant, QuantFormat, QuantTensor
from rtp.model.quant.views import BlockRowScaleView, BlockScaleView, Fp8WeightView


@dataclass
class Fp8Packed(PackedQuant):
    """``weight`` fp8 ``[..., N, K]``, ``scale`` fp32 ``[..., N, G]`` and ``k_offset`` as
    :mod:`rtp.kernels.quant_gemm` takes them; ``w8a8``: FP8 products (else the W8A16 kernel)."""

    weight: torch.Tensor
    scale: torch.Tensor
    k_offset: int
    w8a8: bool

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return quant_gemm.fp8_block_linear(x, self.weight, self.scale, self.k_offset, self.w8a8)


class Fp8BlockFormat(QuantFormat):
    """FP8 e4m3 weights with ``block = (rows, cols)`` scale blocks (128 x 128 in every Qwen release)."""

    name = "fp8"
    multiplicative = True

    def __init__(self, block: tuple[int, int] = (128, 128)) -> None:
        self.block = block
        bn, bk = block
        self.tensors = (
            QuantTensor("weight", torch.float8_e4m3fn, lambda n, k: [n, k], Fp8WeightView),
            QuantTensor("weight_scale_inv", torch.float32, lambda n, k: [-(-n // bn), -(-k // bk)],
                        lambda source, full: BlockScaleView(source, full, block)),
        )
        self.packed_tensors = (
            self.tensors[0],
            QuantTensor("weight_scale_inv", torch.float32, self.tensors[1].shape,
                        lambda source, full: BlockRowScaleView(source, full, block),
                        cols=lambda k_local, k: -(-k // bk)),
        )

    def packs_on(self, device: torch.device) -> bool:
        return device.type == "cuda" and quant_gemm.triton is not None and self.block[1] == quant_gemm.GROUP

    def load_tensors(self, packed: bool) -> tuple[QuantTensor, ...]:
        return self.packed_tensors if packed else self.tensors

    def pack(self, buffers: dict[str, torch.Tensor], col_start: int) -> Fp8Packed:
        weight = buffers["weight"]  # [..., N, K_local] fp8
        k_offset = col_start % quant_gemm.GROUP
        first = col_start // quant_gemm.GROUP
        blocks = quant_gemm.num_groups(weight.shape[-1], k_offset)
        scale = buffers["weight_scale_inv"][..., first : first + blocks].contiguous()  # [..., N, G]
        return Fp8Packed(weight, scale, k_offset, quant_gemm.fp8_w8a8_supported(weight.device))

