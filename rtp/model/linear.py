"""Tensor-parallel linear layers.

Each parameter carries a ``weight_loader(param, source, shard_id=None)`` that
copies this rank's slice from a checkpoint tensor. ``source`` is anything with
``get_shape()`` and slicing (a safetensors ``get_slice`` handle), so a rank
reads only its slice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rtp.dist.parallel import ParallelState
from rtp.errors import CheckpointError, ModelShapeError


def divide(numerator: int, denominator: int, what: str) -> int:
    """Exact division, or a ModelShapeError naming the numbers."""
    if numerator % denominator != 0:
        raise ModelShapeError(
            f"{what}={numerator} is not divisible by the tensor-parallel size {denominator}; "
            f"choose a TP size that divides {numerator}"
        )
    return numerator // denominator


def _copy(param: torch.Tensor, value: torch.Tensor) -> None:
    if list(param.shape) != list(value.shape):
        raise CheckpointError(f"slice of shape {list(value.shape)} does not fit parameter {list(param.shape)}")
    param.data.copy_(value)


def load_full(param: nn.Parameter, source, shard_id=None) -> None:  # noqa: ANN001
    """Default loader: the parameter is replicated on every rank."""
    _copy(param, source[:])


class ColumnParallelLinear(nn.Module):
    """``y = x Wᵀ`` with W split by output rows: each rank produces a slice of y."""

    def __init__(self, in_features: int, out_features: int, ps: ParallelState, bias: bool = False) -> None:
        super().__init__()
        self.ps = ps
        self.out_local = divide(out_features, ps.tp_size, "output features")
        self.weight = nn.Parameter(torch.empty(self.out_local, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_local), requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, source, shard_id=None) -> None:  # noqa: ANN001
        start = self.ps.tp_rank * param.shape[0]
        _copy(param, source[start : start + param.shape[0]])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused into one matmul (gate ‖ up)."""

    def __init__(self, in_features: int, out_sizes: list[int], ps: ParallelState) -> None:
        super().__init__(in_features, sum(out_sizes), ps)
        self.local_sizes = [divide(s, ps.tp_size, "intermediate size") for s in out_sizes]

    def weight_loader(self, param: nn.Parameter, source, shard_id=None) -> None:  # noqa: ANN001
        size = self.local_sizes[shard_id]
        offset = sum(self.local_sizes[:shard_id])
        start = self.ps.tp_rank * size
        _copy(param.data[offset : offset + size], source[start : start + size])


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection with KV-head replication.

    Query heads are split evenly. When the TP size exceeds the number of KV
    heads, each KV head is held by ``tp_size // num_kv_heads`` ranks, so every
    rank still owns exactly one KV head (as vLLM does).
    """

    def __init__(
        self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, ps: ParallelState, bias: bool = False
    ) -> None:
        tp = ps.tp_size
        self.num_heads = divide(num_heads, tp, "num_attention_heads")
        if num_kv_heads >= tp:
            self.num_kv_heads = divide(num_kv_heads, tp, "num_key_value_heads")
            self.kv_head_start = ps.tp_rank * self.num_kv_heads
        else:
            if tp % num_kv_heads != 0:
                raise ModelShapeError(
                    f"tensor-parallel size {tp} exceeds num_key_value_heads={num_kv_heads} but is not a "
                    f"multiple of it; choose a TP size that divides or is a multiple of {num_kv_heads}"
                )
            self.num_kv_heads = 1
            self.kv_head_start = ps.tp_rank // (tp // num_kv_heads)
        self.head_dim = head_dim
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        # Build as a replicated-size layer of the local width, then fix the bookkeeping.
        super().__init__(hidden, out * tp, ps, bias)

    def weight_loader(self, param: nn.Parameter, source, shard_id=None) -> None:  # noqa: ANN001
        d = self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        if shard_id == "q":
            offset, size, start = 0, q_size, self.ps.tp_rank * q_size
        elif shard_id == "k":
            offset, size, start = q_size, kv_size, self.kv_head_start * d
        else:
            offset, size, start = q_size + kv_size, kv_size, self.kv_head_start * d
        _copy(param.data[offset : offset + size], source[start : start + size])


class RowParallelLinear(nn.Module):
    """``y = x Wᵀ`` with W split by input columns; partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, ps: ParallelState, bias: bool = False) -> None:
        super().__init__()
        self.ps = ps
        self.in_local = divide(in_features, ps.tp_size, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_local), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            # The bias is added once, after the reduction.
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = load_full

    def weight_loader(self, param: nn.Parameter, source, shard_id=None) -> None:  # noqa: ANN001
        start = self.ps.tp_rank * self.in_local
        _copy(param, source[:, start : start + self.in_local])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ps.all_reduce(F.linear(x, self.weight))
        return y + self.bias if self.bias is not None else y
