"""Mixture-of-experts feed-forward: a torch path and a fused Triton path.

Both compute, for tokens ``x [T, H]`` routed to ``top_k`` experts each,

    out[t] = sum_j  w[t, j] * down_e( silu(gate_e(x[t])) * up_e(x[t]) ),   e = ids[t, j]

from stacked expert weights ``w13 [E, 2 * I, H]`` (gate rows, then up rows) and
``w2 [E, H, I]``. An expert id equal to ``E`` means "not held here" (expert
parallelism: another rank owns it) and contributes nothing.

The Triton path sorts the ``T * top_k`` (token, slot) pairs by expert and pads
each expert's run to a multiple of the row block, so that every row block of
the grouped GEMM belongs to one expert. Two kernels follow: gate/up with
SiLU-and-mul into an intermediate buffer, then down with the routing weight
applied; the ``top_k`` rows of each token are summed at the end. The alignment
is pure tensor code (no host sync), so the path can be captured in a CUDA graph.

FP8 block-scaled experts (:class:`Fp8Experts`, Qwen's FP8 MoE checkpoints) run the same kernels
with the weight tiles read as fp8: FP8 products with per-token-group activation scales (sm89+,
the activations quantized by :func:`rtp.kernels.quant_gemm.quantize_fp8_groups`) or the weight
decoded next to the activations; each 128-block's scale multiplies its partial product.

On CUDA, :func:`fused_moe` goes through the torch custom op ``rtp::fused_moe``: its real
implementation launches the Triton kernels (the torch path where triton is missing); its fake one
checks shapes, dtypes and devices, traces the alignment (so a host sync there shows) and returns an
empty ``[T, H]``, so the CUDA path can be traced with fake CUDA tensors (:mod:`rtp.fake_cuda`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rtp.kernels.op_checks import FLOAT_DTYPES, check_device, check_dim, check_dtype, check_same_dtype, check_shape
from rtp.kernels.quant_gemm import num_groups, quantize_fp8_groups

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency, but keep import-safe
    triton = None


def fused_moe_reference(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """Torch path: tokens grouped by expert; one Python iteration per expert that got tokens.

    x: [T, H]; w13: [E, 2I, H]; w2: [E, H, I]; topk_weights/topk_ids: [T, k]. Returns [T, H].
    """
    num_experts, k = w13.shape[0], topk_ids.shape[1]
    out = torch.zeros_like(x)
    flat_ids = topk_ids.reshape(-1)  # [T*k]
    # Stable sort: within one expert, pairs stay in token order (as HF's loop visits them).
    order = torch.argsort(flat_ids, stable=True)  # [T*k] flat pair index, grouped by expert
    counts = torch.bincount(flat_ids, minlength=num_experts + 1)[:num_experts].tolist()  # one host sync
    flat_w = topk_weights.reshape(-1)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start : start + n]  # [n]
        start += n
        tokens = pairs // k  # [n]
        gate, up = F.linear(x[tokens], w13[e]).chunk(2, dim=-1)  # [n, I] each
        y = F.linear(F.silu(gate) * up, w2[e])  # [n, H]
        out.index_add_(0, tokens, y * flat_w[pairs, None].to(y.dtype))
    return out


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort (token, slot) pairs by expert, each expert's run padded to a multiple of ``block_m``.

    Returns ``sorted_pairs [L]`` (flat pair index ``t * k + j``, or ``T * k`` for padding),
    ``block_experts [L // block_m]`` (the expert of each row block; ``num_experts`` for
    blocks past the end) and ``num_padded [1]`` (rows in use). ``L`` is the worst case
    ``T * k + E * (block_m - 1)`` rounded up to ``block_m``, so no host sync is needed.
    """
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()  # [P], P = T*k; value num_experts = not held here
    p = flat.numel()
    length = -(-(p + num_experts * (block_m - 1)) // block_m) * block_m
    # scatter_add, not bincount: bincount on CUDA reads the max id back to the host (no graph capture).
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts = counts.scatter_add_(0, flat, torch.ones_like(flat))[:num_experts]  # [E]
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_end = torch.cumsum(padded, 0)  # [E]
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts  # [E] unpadded start of each expert in sorted order
    order = torch.argsort(flat, stable=True)  # [P]
    sorted_e = flat[order]  # [P]
    held = sorted_e < num_experts
    e_safe = sorted_e.clamp(max=num_experts - 1)
    rank_in_expert = torch.arange(p, device=device) - start[e_safe]
    # Pairs of experts not held here go to a dump slot past the end, then are cut off.
    dest = torch.where(held, padded_start[e_safe] + rank_in_expert, torch.full_like(sorted_e, length))
    sorted_pairs = torch.full((length + 1,), p, dtype=torch.int32, device=device)
    sorted_pairs[dest] = order.to(torch.int32)
    block_starts = torch.arange(0, length, block_m, device=device)  # [L / block_m]
    block_experts = torch.searchsorted(padded_end, block_starts, right=True).to(torch.int32)  # E past the end
    return sorted_pairs[:length], block_experts, padded_end[-1:].to(torch.int32)


if triton is not None:

    @triton.jit
    def _weight_tile(w_ptr, ws_ptr, rows, row_ok, ks, k_ok, g, stride_wn, stride_wsn, dtype, W_FP8: tl.constexpr,
                     A_FP8: tl.constexpr):
        # [BK, BN] tile of weight rows `rows` at inputs `ks`, and the rows' scales of 128-group g ([BN]; unused
        # unless W_FP8). A_FP8: the fp8 values as they are; else in `dtype` (fp8 decoded from its bytes).
        ptrs = w_ptr + rows[None, :] * stride_wn + ks[:, None]
        ok = row_ok[None, :] & k_ok[:, None]
        if W_FP8:
            sw = tl.load(ws_ptr + rows * stride_wsn + g, mask=row_ok, other=0.0)
            if A_FP8:
                w = tl.load(ptrs, mask=ok, other=0.0)
            else:
                b = tl.load(ptrs, mask=ok, other=0).to(tl.int32)
                # e4m3 bits shifted into a float16 are the value times 2^-8 (as in rtp.kernels.quant_gemm)
                half = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.uint16).to(tl.float16, bitcast=True)
                w = (half.to(tl.float32) * 256.0).to(dtype)
        else:
            sw = 1.0
            w = tl.load(ptrs, mask=ok, other=0.0)
        return w, sw

    @triton.jit
    def _gate_up_kernel(
        x_ptr, xs_ptr, w13_ptr, ws_ptr, h_ptr, pairs_ptr, block_experts_ptr,
        num_pairs, hidden, inter, top_k, num_experts,
        stride_xt, stride_xst, stride_we, stride_wn, stride_wse, stride_wsn, stride_ht,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
        W_FP8: tl.constexpr, A_FP8: tl.constexpr,
    ):
        # Program (m, n): rows m*BLOCK_M.. of the sorted pairs (one expert), columns n*BLOCK_N.. of I.
        # W_FP8: w13 holds FP8 128-blocks (ws: one row of block scales per weight row); A_FP8: x is fp8
        # too, with per-token scales of each 128-group (xs); BLOCK_K divides 128.
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
        if expert < num_experts:
            pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
            row_ok = pairs < num_pairs
            tokens = (pairs // top_k).to(tl.int64)
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] into I
            col_ok = cols < inter
            acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            w_base = w13_ptr + expert * stride_we
            ws_base = ws_ptr + expert * stride_wse
            for k0 in range(0, hidden, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_ok = ks < hidden
                g = k0 // 128
                a = tl.load(x_ptr + tokens[:, None] * stride_xt + ks[None, :],
                            mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
                wg, sg = _weight_tile(w_base, ws_base, cols, col_ok, ks, k_ok, g, stride_wn, stride_wsn, a.dtype,
                                      W_FP8, A_FP8)
                wu, su = _weight_tile(w_base, ws_base, inter + cols, col_ok, ks, k_ok, g, stride_wn, stride_wsn,
                                      a.dtype, W_FP8, A_FP8)
                if IEEE:
                    pg = tl.dot(a, wg, input_precision="ieee")
                    pu = tl.dot(a, wu, input_precision="ieee")
                else:
                    pg = tl.dot(a, wg)
                    pu = tl.dot(a, wu)
                if A_FP8:
                    sa = tl.load(xs_ptr + tokens * stride_xst + g, mask=row_ok, other=0.0)  # [BM]
                    pg, pu = pg * sa[:, None], pu * sa[:, None]
                if W_FP8:
                    pg, pu = pg * sg[None, :], pu * su[None, :]
                acc_g += pg
                acc_u += pu
            h = acc_g * tl.sigmoid(acc_g) * acc_u  # silu(gate) * up, in fp32
            tl.store(h_ptr + pairs.to(tl.int64)[:, None] * stride_ht + cols[None, :],
                     h.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _down_kernel(
        h_ptr, hs_ptr, w2_ptr, ws_ptr, y_ptr, pairs_ptr, block_experts_ptr, weights_ptr,
        num_pairs, hidden, inter, num_experts, k_offset,
        stride_ht, stride_hst, stride_we, stride_wn, stride_wse, stride_wsn, stride_yt,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
        W_FP8: tl.constexpr, A_FP8: tl.constexpr,
    ):
        # Program (m, n): rows m*BLOCK_M.. of the sorted pairs, output columns n*BLOCK_N.. of H. As
        # _gate_up_kernel; k_offset: where the first of the I inputs sits in its 128-block (a row shard).
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
        if expert < num_experts:
            pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BM]
            row_ok = pairs < num_pairs
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] into H
            col_ok = cols < hidden
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            w_base = w2_ptr + expert * stride_we
            ws_base = ws_ptr + expert * stride_wse
            for k0 in range(0, inter + k_offset, BLOCK_K):
                ks = k0 - k_offset + tl.arange(0, BLOCK_K)
                k_ok = (ks >= 0) & (ks < inter)
                g = k0 // 128
                a = tl.load(h_ptr + pairs[:, None] * stride_ht + ks[None, :],
                            mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
                w, sw = _weight_tile(w_base, ws_base, cols, col_ok, ks, k_ok, g, stride_wn, stride_wsn, a.dtype,
                                     W_FP8, A_FP8)
                if IEEE:
                    p = tl.dot(a, w, input_precision="ieee")
                else:
                    p = tl.dot(a, w)
                if A_FP8:
                    sa = tl.load(hs_ptr + pairs * stride_hst + g, mask=row_ok, other=0.0)  # [BM]
                    p = p * sa[:, None]
                if W_FP8:
                    p = p * sw[None, :]
                acc += p
            # The routing weight is applied in the dtype of the activations, as the torch path does.
            route_w = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)  # [BM]
            y = acc.to(y_ptr.dtype.element_ty) * route_w[:, None].to(y_ptr.dtype.element_ty)
            tl.store(y_ptr + pairs[:, None] * stride_yt + cols[None, :], y,
                     mask=row_ok[:, None] & col_ok[None, :])


def _block_sizes(num_pairs: int, hidden: int, inter: int) -> tuple[int, int, int]:
    # tl.dot needs every block dimension >= 16. Small batches (decode) waste less on padding
    # with 16-row blocks; large prefills reuse each expert's weight tile over more rows.
    # BLOCK_K divides 128, so that an FP8 weight's 128-block scales are constant over a tile.
    block_m = 16 if num_pairs <= 1024 else 64
    block_n = 64 if max(hidden, inter) >= 64 else 32
    return block_m, block_n, 64 if min(hidden, inter) >= 64 else 32


@dataclass(frozen=True)
class Fp8Experts:
    """FP8 block-scaled expert stacks as the fused kernels take them.

    ``w13 [E, 2I, H]`` and ``w2 [E, H, I]`` in ``float8_e4m3fn``; ``s13 [E, 2I, ceil(H/128)]`` and
    ``s2 [E, H, ceil((I + k_offset)/128)]`` fp32, one row of 128-block scales per weight row (as
    :mod:`rtp.kernels.quant_gemm`); ``k_offset``: where the first of this rank's I columns sits
    inside its block. ``w8a8``: FP8 products (sm89+), the activations quantized per token and per
    128-group; else the weights are decoded in the kernel next to the activations.
    """

    w13: torch.Tensor
    s13: torch.Tensor
    w2: torch.Tensor
    s2: torch.Tensor
    k_offset: int
    w8a8: bool


def fused_moe_triton(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    fp8: Fp8Experts | None = None,
) -> torch.Tensor:
    """Triton version of :func:`fused_moe_reference` (GPU, or CPU under TRITON_INTERPRET=1).

    ``fp8``: the experts in FP8 blocks (``w13``/``w2`` are then ``fp8.w13``/``fp8.w2``).
    """
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter, k = two_inter // 2, topk_ids.shape[1]
    if w2.shape != (num_experts, hidden, inter):
        raise ValueError(f"w2 has shape {list(w2.shape)}, expected {[num_experts, hidden, inter]}")
    if x.stride(-1) != 1 or not (w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError("fused_moe_triton needs rows of x contiguous and contiguous expert weights")
    num_pairs = num_tokens * k
    block_m, block_n, block_k = _block_sizes(num_pairs, hidden, inter)
    sorted_pairs, block_experts, _ = align_by_expert(topk_ids, num_experts, block_m)
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)  # [T*k, I]
    y = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)  # [T*k, H], one row per pair
    weights = topk_weights.reshape(-1).contiguous()  # [T*k]
    ieee = x.dtype == torch.float32  # fp32 models get fp32 products, not TF32
    num_blocks = block_experts.numel()
    w_fp8, a_fp8 = fp8 is not None, fp8 is not None and fp8.w8a8
    a, a_scale, s13, k_offset = x, x, w13, 0  # (unused scale pointers without fp8)
    if fp8 is not None:
        s13, k_offset = fp8.s13, fp8.k_offset
        if fp8.w8a8:
            a, a_scale = quantize_fp8_groups(x)
        else:
            w13, w2 = w13.view(torch.uint8), w2.view(torch.uint8)
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        a, a_scale, w13, s13, h, sorted_pairs, block_experts,
        num_pairs, hidden, inter, k, num_experts,
        a.stride(0), a_scale.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), h.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee, W_FP8=w_fp8, A_FP8=a_fp8,
    )
    hq, h_scale, s2 = h, h, w2
    if fp8 is not None:
        s2 = fp8.s2
        if fp8.w8a8:
            hq, h_scale = quantize_fp8_groups(h, k_offset)
    _down_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        hq, h_scale, w2, s2, y, sorted_pairs, block_experts, weights,
        num_pairs, hidden, inter, num_experts, k_offset,
        hq.stride(0), h_scale.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee, W_FP8=w_fp8, A_FP8=a_fp8,
    )
    # Pairs of experts not held here were never written: zero them before the sum over slots.
    y.masked_fill_((topk_ids.reshape(-1) >= num_experts)[:, None], 0)
    return y.view(num_tokens, k, hidden).sum(dim=1)  # [T, H]


def check_fused_moe_args(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> None:
    """Raise :class:`~rtp.kernels.op_checks.KernelArgError` unless the arguments of ``rtp::fused_moe`` fit."""
    op = "rtp::fused_moe"
    check_dim(op, "x", x, 2, "[T, H]")
    check_dim(op, "w13", w13, 3, "[E, 2I, H]")
    num_experts, two_inter, hidden = w13.shape
    check_shape(op, "x", x, (x.shape[0], hidden), "[T, H] with w13's H")
    check_shape(op, "w2", w2, (num_experts, hidden, two_inter // 2), "[E, H, I]")
    check_dim(op, "topk_ids", topk_ids, 2, "[T, k]")
    check_shape(op, "topk_ids", topk_ids, (x.shape[0], topk_ids.shape[1]), "[T, k]")
    check_shape(op, "topk_weights", topk_weights, tuple(topk_ids.shape), "topk_ids' [T, k]")
    check_device(op, x=x, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids)
    check_same_dtype(op, x=x, w13=w13, w2=w2, topk_weights=topk_weights)
    check_dtype(op, FLOAT_DTYPES, x=x)
    check_dtype(op, (torch.int32, torch.int64), topk_ids=topk_ids)


@torch.library.custom_op("rtp::fused_moe", mutates_args=())
def _fused_moe_op(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    check_fused_moe_args(x, w13, w2, topk_weights, topk_ids)
    if triton is not None:
        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids)
    return fused_moe_reference(x, w13, w2, topk_weights, topk_ids)


@_fused_moe_op.register_fake
def _fused_moe_fake(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    check_fused_moe_args(x, w13, w2, topk_weights, topk_ids)
    # The alignment is the op's only torch code besides the kernels: trace it (shapes depend on T, k, E only).
    block_m = _block_sizes(topk_ids.numel(), x.shape[1], w2.shape[2])[0]
    align_by_expert(topk_ids, w13.shape[0], block_m)
    return x.new_empty(x.shape)  # [T, H]


def check_fused_moe_fp8_args(x: torch.Tensor, fp8: Fp8Experts, topk_weights: torch.Tensor,
                            topk_ids: torch.Tensor) -> None:
    """Raise :class:`~rtp.kernels.op_checks.KernelArgError` unless the arguments of ``rtp::fused_moe_fp8`` fit."""
    op = "rtp::fused_moe_fp8"
    w13, w2 = fp8.w13, fp8.w2
    check_dim(op, "w13", w13, 3, "[E, 2I, H]")
    num_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    check_shape(op, "x", x, (x.shape[0], hidden), "[T, H] with w13's H")
    check_shape(op, "w2", w2, (num_experts, hidden, inter), "[E, H, I]")
    check_shape(op, "s13", fp8.s13, (num_experts, two_inter, num_groups(hidden, 0)), "[E, 2I, ceil(H/128)]")
    check_shape(op, "s2", fp8.s2, (num_experts, hidden, num_groups(inter, fp8.k_offset)),
                "[E, H, ceil((I + k_offset)/128)]")
    check_dim(op, "topk_ids", topk_ids, 2, "[T, k]")
    check_shape(op, "topk_ids", topk_ids, (x.shape[0], topk_ids.shape[1]), "[T, k]")
    check_shape(op, "topk_weights", topk_weights, tuple(topk_ids.shape), "topk_ids' [T, k]")
    check_device(op, x=x, w13=w13, s13=fp8.s13, w2=w2, s2=fp8.s2, topk_weights=topk_weights, topk_ids=topk_ids)
    check_same_dtype(op, x=x, topk_weights=topk_weights)
    check_dtype(op, FLOAT_DTYPES, x=x)
    check_dtype(op, (torch.float8_e4m3fn,), w13=w13, w2=w2)
    check_dtype(op, (torch.float32,), s13=fp8.s13, s2=fp8.s2)
    check_dtype(op, (torch.int32, torch.int64), topk_ids=topk_ids)


@torch.library.custom_op("rtp::fused_moe_fp8", mutates_args=())
def _fused_moe_fp8_op(
    x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, k_offset: int, w8a8: bool,
) -> torch.Tensor:
    fp8 = Fp8Experts(w13, s13, w2, s2, k_offset, w8a8)
    check_fused_moe_fp8_args(x, fp8, topk_weights, topk_ids)
    return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, fp8)


@_fused_moe_fp8_op.register_fake
def _fused_moe_fp8_fake(
    x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, k_offset: int, w8a8: bool,
) -> torch.Tensor:
    check_fused_moe_fp8_args(x, Fp8Experts(w13, s13, w2, s2, k_offset, w8a8), topk_weights, topk_ids)
    block_m = _block_sizes(topk_ids.numel(), x.shape[1], w2.shape[2])[0]
    align_by_expert(topk_ids, w13.shape[0], block_m)
    return x.new_empty(x.shape)  # [T, H]


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """Mixture-of-experts FFN: the ``rtp::fused_moe`` op (Triton kernels) on CUDA, the grouped torch path elsewhere."""
    if x.is_cuda:
        return torch.ops.rtp.fused_moe(x, w13, w2, topk_weights, topk_ids)
    return fused_moe_reference(x, w13, w2, topk_weights, topk_ids)


def fused_moe_fp8(x: torch.Tensor, fp8: Fp8Experts, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The MoE FFN over FP8 block-scaled experts: the ``rtp::fused_moe_fp8`` op on CUDA; elsewhere the Triton
    kernels directly (CPU under TRITON_INTERPRET=1)."""
    if x.is_cuda:
        return torch.ops.rtp.fused_moe_fp8(x, fp8.w13, fp8.s13, fp8.w2, fp8.s2, topk_weights, topk_ids,
                                           fp8.k_offset, fp8.w8a8)
    check_fused_moe_fp8_args(x, fp8, topk_weights, topk_ids)
    return fused_moe_triton(x, fp8.w13, fp8.w2, topk_weights, topk_ids, fp8)
