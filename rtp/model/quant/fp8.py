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
"""

from __future__ import annotations

import torch

from rtp.model.quant.base import QuantFormat, QuantTensor
from rtp.model.quant.views import BlockScaleView, Fp8WeightView


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

