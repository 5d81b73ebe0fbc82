"""Checkpoint tensors of a quantized projection, seen as dense ``[N, K]`` sources.

A projection's weight is ``[N, K]`` (out x in); the layers' weight loaders slice it by rows
(column-parallel, merged gate/up and qkv, KV-head replication, experts) or by columns
(row-parallel). A quantized format stores other shapes: FP8 block scales ``[ceil(N/bn),
ceil(K/bk)]``, AWQ's packed ``qweight [K, N/8]``, ``qzeros [K/g, N/8]``, ``scales [K/g, N]``.
Each view here answers ``get_shape()`` with ``[N, K]`` and a ``[rows, cols]`` slice with the
values those rows and columns of the weight need (a scale block expanded over its rows and
columns, a nibble unpacked), reading only the part of the checkpoint tensor that covers
them. So the unchanged loaders slice every tensor of a format together with the weight, and
a scale block that straddles two ranks' shards is read, whole and unchanged, by both.
"""

from __future__ import annotations

from typing import Any

import torch

from rtp.errors import CheckpointError

# AutoAWQ's GEMM packing: nibble i (bits 4i..4i+3) of an int32 holds column ORDER[i] of its 8.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Where column j of the 8 sits: the inverse permutation of AWQ_PACK_ORDER.
AWQ_NIBBLE_OF_COLUMN = tuple(AWQ_PACK_ORDER.index(j) for j in range(8))


def _bounds(idx: Any, shape: tuple[int, int]) -> tuple[int, int, int, int]:
    """(r0, r1, c0, c1) of a ``source[idx]`` that the loaders take: ``[:]``, ``[a:b]`` or ``[a:b, c:d]``."""
    parts = idx if isinstance(idx, tuple) else (idx,)
    if len(parts) > 2 or not all(isinstance(p, slice) and p.step in (None, 1) for p in parts):
        raise TypeError(f"unsupported slice {idx!r} of a dense view")
    rows = parts[0].indices(shape[0])
    cols = (parts[1] if len(parts) == 2 else slice(None)).indices(shape[1])
    return rows[0], rows[1], cols[0], cols[1]


def _check_dtype(source: Any, name: str, allowed: tuple[str, ...]) -> None:
    dtype = source.get_dtype() if hasattr(source, "get_dtype") else None
    if dtype is not None and dtype not in allowed:
        raise CheckpointError(f"{name} has dtype {dtype}, expected {' or '.join(allowed)}")


class _View:
    """Base of the dense views: the full ``[N, K]`` shape and the wrapped checkpoint slice handle.

    ``col_start``: the first column of the last slice taken (None before any), which a packed layer
    keeps to find its input columns' 128-blocks.
    """

    def __init__(self, source: Any, full: tuple[int, int]) -> None:
        self.source, self.full = source, full
        self.col_start: int | None = None

    def get_shape(self) -> list[int]:
        return list(self.full)

    def _cut(self, idx: Any) -> tuple[int, int, int, int]:
        bounds = _bounds(idx, self.full)
        self.col_start = bounds[2]
        return bounds


class Fp8WeightView(_View):
    """An FP8 weight ``[N, K]`` as stored (``float8_e4m3fn``); its dtype is checked before any read."""

    def __init__(self, source: Any, full: tuple[int, int]) -> None:
        super().__init__(source, full)
        _check_dtype(source, "the FP8 weight", ("F8_E4M3",))

    def __getitem__(self, idx: Any) -> torch.Tensor:
        self._cut(idx)
        return self.source[idx]


class BlockScaleView(_View):
    """``weight_scale_inv [ceil(N/bn), ceil(K/bk)]`` expanded to one fp32 scale per weight element."""

    def __init__(self, source: Any, full: tuple[int, int], block: tuple[int, int]) -> None:
        super().__init__(source, full)
        _check_dtype(source, "the block scale", ("BF16", "F32", "F16"))
        self.block = block

    def __getitem__(self, idx: Any) -> torch.Tensor:
        r0, r1, c0, c1 = self._cut(idx)
        bn, bk = self.block
        br0, bc0 = r0 // bn, c0 // bk
        s = self.source[br0 : -(-r1 // bn), bc0 : -(-c1 // bk)].float()  # the blocks covering the slice
        s = s.repeat_interleave(bn, 0)[r0 - br0 * bn : r1 - br0 * bn]
        return s.repeat_interleave(bk, 1)[:, c0 - bc0 * bk : c1 - bc0 * bk]  # [r1 - r0, c1 - c0]


class BlockRowScaleView(_View):
    """``weight_scale_inv [ceil(N/bn), ceil(K/bk)]`` with its rows expanded: a slice of rows ``r0:r1`` (and any
    columns) is ``[r1 - r0, ceil(K/bk)]`` fp32, each row its block's scales over every column block.

    What a packed FP8 layer loads (:mod:`rtp.kernels.quant_gemm` takes one row of block scales per output
    row); it keeps the columns' start (``col_start``) and picks the blocks of its columns after loading.
    """

    def __init__(self, source: Any, full: tuple[int, int], block: tuple[int, int]) -> None:
        super().__init__(source, full)
        _check_dtype(source, "the block scale", ("BF16", "F32", "F16"))
        self.block = block

    def __getitem__(self, idx: Any) -> torch.Tensor:
        r0, r1, _, _ = self._cut(idx)
        bn = self.block[0]
        s = self.source[r0 // bn : -(-r1 // bn)].float()  # [blocks covering the rows, ceil(K/bk)]
        return s.repeat_interleave(bn, 0)[r0 - (r0 // bn) * bn : r1 - (r0 // bn) * bn]


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """uint8 ``[R, C]`` of 4-bit values -> int32 ``[R, C/8]`` in AutoAWQ's order (undoes :func:`unpack_awq`)."""
    r, c = values.shape
    v = values.to(torch.int32).view(r, c // 8, 8)  # column 8p + j
    packed = torch.zeros(r, c // 8, dtype=torch.int32, device=values.device)
    for j in range(8):  # bits 28..31 wrap into the sign of the int32, as the checkpoint stores them
        packed |= v[:, :, j] << (4 * AWQ_NIBBLE_OF_COLUMN[j])
    return packed


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[R, C/8]`` in AutoAWQ's nibble order -> uint8 ``[R, C]`` of 4-bit values."""
    shifts = torch.tensor(AWQ_NIBBLE_OF_COLUMN, dtype=torch.int32, device=packed.device) * 4  # [8]
    vals = (packed.unsqueeze(-1) >> shifts) & 0xF  # [R, C/8, 8]: column 8c + j of nibble NIBBLE_OF_COLUMN[j]
    return vals.flatten(-2).to(torch.uint8)


class AwqPackedView(_View):
    """``qweight [K, N/8]`` (``group`` = 1) or ``qzeros [K/g, N/8]`` (``group`` = g) as uint8 ``[N, K]``."""

    def __init__(self, source: Any, full: tuple[int, int], group: int, name: str) -> None:
        super().__init__(source, full)
        _check_dtype(source, f"AWQ {name}", ("I32",))
        self.group = group

    def __getitem__(self, idx: Any) -> torch.Tensor:
        r0, r1, c0, c1 = self._cut(idx)
        g, p0 = self.group, r0 // 8
        q = unpack_awq(self.source[c0 // g : -(-c1 // g), p0 : -(-r1 // 8)])  # [K rows or groups, cols]
        q = q[:, r0 - 8 * p0 : r1 - 8 * p0].t()  # [r1 - r0, K rows or groups]
        return q.repeat_interleave(g, 1)[:, c0 - (c0 // g) * g : c1 - (c0 // g) * g] if g > 1 else q


class GroupScaleView(_View):
    """AWQ ``scales [K/g, N]`` (fp16) as ``[N, K]``: each group's scale repeated over its ``g`` columns."""

    def __init__(self, source: Any, full: tuple[int, int], group: int) -> None:
        super().__init__(source, full)
        _check_dtype(source, "AWQ scales", ("F16", "BF16", "F32"))
        self.group = group

    def __getitem__(self, idx: Any) -> torch.Tensor:
        r0, r1, c0, c1 = self._cut(idx)
        g = self.group
        s = self.source[c0 // g : -(-c1 // g), r0:r1].t()  # [r1 - r0, groups]
        return s.repeat_interleave(g, 1)[:, c0 - (c0 // g) * g : c1 - (c0 // g) * g]
