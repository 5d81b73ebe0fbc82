"""AutoAWQ's GEMM format: 4-bit weights with a zero point and an fp16 scale per group of 128 inputs.

Checkpoint tensors of a projection of shape ``[N, K]`` (``quant_method: awq``, ``bits: 4``,
``group_size: 128``, ``zero_point: true``, ``version: gemm``): ``qweight`` int32 ``[K, N/8]``,
``qzeros`` int32 ``[K/128, N/8]`` (eight 4-bit values per int32, nibble ``i`` holding column
``[0, 2, 4, 6, 1, 3, 5, 7][i]`` of its eight) and ``scales`` fp16 ``[K/128, N]``, with
``W[n, k] = (q[k, n] - z[k // 128, n]) * s[k // 128, n]``.

Each tensor is read through a dense ``[N, K]`` view (:mod:`rtp.model.quant.views`), so column
shards split N and row shards split K with any boundary. Dequantized in fp32, where it is exact
(a 4-bit difference times an fp16 scale), then cast to the compute dtype.

On CUDA the loaded values are packed back after loading, for this rank's slice, into AutoAWQ's
layout (``qweight [K_local, N_local/8]``, ``qzeros``/``scales`` of the groups the slice covers,
its first column ``k_offset`` into its group) and multiplied by
:func:`rtp.kernels.quant_gemm.awq_linear`; a slice of fewer than a multiple of 8 rows has no
kernel and is dequantized as on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rtp.errors import ModelShapeError
from rtp.kernels import quant_gemm
from rtp.model.quant.base import PackedQuant, QuantFormat, QuantTensor
from rtp.model.quant.views import AwqPackedView, GroupScaleView, pack_awq


@dataclass
class AwqPacked(PackedQuant):
    """One projection as :func:`rtp.kernels.quant_gemm.awq_linear` takes it."""

    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    k_offset: int

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return quant_gemm.awq_linear(x, self.qweight, self.qzeros, self.scales, self.k_offset)


class AwqFormat(QuantFormat):
    """AutoAWQ GEMM, 4 bits, zero point, ``group`` inputs per scale."""

    name = "awq"

    def __init__(self, group: int = 128) -> None:
        self.group = group
        g = group
        self.tensors = (
            QuantTensor("qweight", torch.uint8, lambda n, k: [k, n // 8],
                        lambda source, full: AwqPackedView(source, full, 1, "qweight")),
            QuantTensor("qzeros", torch.uint8, lambda n, k: [k // g, n // 8],
                        lambda source, full: AwqPackedView(source, full, g, "qzeros")),
            QuantTensor("scales", torch.float16, lambda n, k: [k // g, n],
                        lambda source, full: GroupScaleView(source, full, g)),
        )

    def check_shape(self, what: str, out_features: int, in_features: int) -> None:
        if out_features % 8 or in_features % self.group:
            raise ModelShapeError(
                f"AWQ {what} of shape [{out_features}, {in_features}]: the output size must be a multiple of 8 "
                f"and the input size a multiple of group_size={self.group}"
            )

    def packs_on(self, device: torch.device) -> bool:
        return device.type == "cuda" and quant_gemm.triton is not None and self.group == quant_gemm.GROUP

    def pack(self, buffers: dict[str, torch.Tensor], col_start: int) -> AwqPacked | None:
        q = buffers["qweight"]  # [N, K_local] uint8 values; qzeros and scales expanded the same way
        n, k = q.shape[-2:]
        if q.dim() != 2 or n % 8:
            return None  # expert stacks and row counts off the packing's 8 stay dequantized
        k_offset = col_start % self.group
        groups = quant_gemm.num_groups(k, k_offset)
        firsts = (torch.arange(groups, device=q.device) * self.group - k_offset).clamp(min=0)  # a column per group
        return AwqPacked(pack_awq(q.t().contiguous()), pack_awq(buffers["qzeros"][:, firsts].t().contiguous()),
                         buffers["scales"][:, firsts].t().contiguous(), k_offset)

    def dequantize(self, buffers: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        # [..., N, K] uint8 values and zeros, fp16 scales (expanded per element) -> [..., N, K] dtype
        q = buffers["qweight"].float() - buffers["qzeros"].float()
        return (q * buffers["scales"].float()).to(dtype)
