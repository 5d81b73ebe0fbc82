"""Triton GEMMs over quantized weights kept packed on the GPU: FP8 128-blocks and AutoAWQ int4.

Every kernel computes ``y [M, N] = x [M, K] @ Wᵀ`` for a weight of ``N`` output rows held as

- FP8 blocks: ``weight`` ``float8_e4m3fn [N, K]`` and ``scale`` fp32 ``[N, G]``, with
  ``W[n, k] = weight[n, k] * scale[n, (k + k_offset) // 128]``. The scale has one row per output
  row (each row's 128-block scale repeated over the block's rows), so a shard whose rows start
  inside a block, or a merged gate/up or q/k/v stack, needs nothing special; ``k_offset`` (< 128)
  is where the shard's first input column sits inside its 128-block (a row-parallel shard of 192
  columns on rank 1 starts at column 64 of block 1), and ``G = ceil((K + k_offset) / 128)``.
- AWQ: ``qweight`` int32 ``[K, N/8]``, ``qzeros`` int32 ``[G, N/8]`` (AutoAWQ's GEMM packing,
  nibble ``i`` of an int32 holding column ``[0, 2, 4, 6, 1, 3, 5, 7][i]`` of its eight) and
  ``scales`` fp16 ``[G, N]``, with ``W[n, k] = (q[k, n] - z[g, n]) * s[g, n]``,
  ``g = (k + k_offset) // 128``.

FP8 has two kernels. :func:`fp8_w8a8_linear` (sm89+, where the tensor cores multiply FP8)
quantizes the activations per token and per 128-group of inputs (:func:`quantize_fp8_groups`:
``scale = amax / 448``, groups aligned with the weight's blocks, so a product of two blocks is
one FP8 dot scaled by two numbers). :func:`fp8_w8a16_linear` (any GPU) reads the weight's bytes
and decodes e4m3 with integer operations (an e4m3 value's bits shifted into a float16 are that
value times 2⁻⁸), so it needs no FP8 support from the GPU; activations stay bf16/fp16/fp32.

On CUDA each entry point goes through a torch custom op (``rtp::fp8_block_linear``,
``rtp::awq_linear``) whose fake implementation checks the arguments and returns an empty output,
so the CUDA path traces with fake tensors (:mod:`rtp.fake_cuda`). On CPU the functions launch the
kernels directly, which runs them under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch

from rtp.kernels.op_checks import FLOAT_DTYPES, KernelArgError, check_device, check_dim, check_dtype, check_shape

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency, but keep import-safe
    triton = None

FP8_MAX = 448.0  # largest finite float8_e4m3fn
GROUP = 128  # FP8 scale blocks and AWQ groups, along K
_EPS = 1e-10  # an all-zero activation group gets this amax (any scale is exact for zeros)


def num_groups(k: int, k_offset: int) -> int:
    """Scale groups covering ``k`` inputs whose first one sits at ``k_offset`` inside its group."""
    return -(-(k + k_offset) // GROUP)


if triton is not None:

    @triton.jit
    def _quant_groups_kernel(
        x_ptr, q_ptr, s_ptr, K, k_offset, stride_xm, stride_qm, stride_sm, GROUP_K: tl.constexpr,
    ):
        # Program (m, g): token m, input group g (local columns g*128 - k_offset ..).
        m, g = tl.program_id(0).to(tl.int64), tl.program_id(1)
        ks = g * GROUP_K - k_offset + tl.arange(0, GROUP_K)
        ok = (ks >= 0) & (ks < K)
        x = tl.load(x_ptr + m * stride_xm + ks, mask=ok, other=0.0).to(tl.float32)
        # correctly rounded divisions (a GPU's default fp32 division may be 2 ulp off): the torch reference's bits
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), 1e-10), 448.0)
        q = tl.clamp(tl.math.div_rn(x, scale), -448.0, 448.0)
        # Rounded to the e4m3 grid in fp32 first (v + c - c with c = 1.5 * 2^23 * step rounds v to a multiple
        # of step, to nearest even), so the cast below is exact: the same values on a GPU and in triton's
        # interpreter, whose fp32 -> e4m3 cast is wrong when rounding carries into the exponent.
        biased = tl.maximum((q.to(tl.int32, bitcast=True) >> 23) & 0xFF, 127 - 6)  # e4m3 subnormals below 2^-6
        c = ((biased + 20) << 23 | 0x400000).to(tl.float32, bitcast=True)  # 1.5 * 2^(e - 3 + 23)
        q = (q + c) - c
        tl.store(q_ptr + m * stride_qm + ks, q.to(q_ptr.dtype.element_ty), mask=ok)
        tl.store(s_ptr + m * stride_sm + g, scale)

    @triton.jit
    def _w8a8_kernel(
        a_ptr, as_ptr, w_ptr, ws_ptr, c_ptr, M, N, K, k_offset,
        stride_am, stride_asm, stride_wn, stride_wsn, stride_cm,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        # Program (m, n): rows m*BLOCK_M.. of x, output columns n*BLOCK_N..; K in steps of one 128-block.
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        row_ok, col_ok = rows < M, cols < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for g in range(0, tl.cdiv(K + k_offset, BLOCK_K)):
            ks = g * BLOCK_K - k_offset + tl.arange(0, BLOCK_K)
            k_ok = (ks >= 0) & (ks < K)
            a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK] fp8
            w = tl.load(w_ptr + cols[None, :] * stride_wn + ks[:, None],
                        mask=col_ok[None, :] & k_ok[:, None], other=0.0)  # [BK, BN] fp8
            sa = tl.load(as_ptr + rows * stride_asm + g, mask=row_ok, other=0.0)  # [BM]
            sw = tl.load(ws_ptr + cols * stride_wsn + g, mask=col_ok, other=0.0)  # [BN]
            acc += tl.dot(a, w) * sa[:, None] * sw[None, :]
        tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _w8a16_kernel(
        x_ptr, w_ptr, ws_ptr, c_ptr, M, N, K, k_offset,
        stride_xm, stride_wn, stride_wsn, stride_cm,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    ):
        # As _w8a8_kernel, with x in its float dtype and the weight's e4m3 bytes (uint8) decoded here.
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        row_ok, col_ok = rows < M, cols < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for g in range(0, tl.cdiv(K + k_offset, BLOCK_K)):
            ks = g * BLOCK_K - k_offset + tl.arange(0, BLOCK_K)
            k_ok = (ks >= 0) & (ks < K)
            x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
            b = tl.load(w_ptr + cols[None, :] * stride_wn + ks[:, None],
                        mask=col_ok[None, :] & k_ok[:, None], other=0).to(tl.int32)  # [BK, BN] e4m3 bits
            # sign to bit 15, exponent and mantissa to bits 7..14: the float16 of value * 2^-8
            half = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.uint16).to(tl.float16, bitcast=True)
            w = (half.to(tl.float32) * 256.0).to(x.dtype)  # exact in bf16, fp16 and fp32
            sw = tl.load(ws_ptr + cols * stride_wsn + g, mask=col_ok, other=0.0)  # [BN]
            if IEEE:
                acc += tl.dot(x, w, input_precision="ieee") * sw[None, :]
            else:
                acc += tl.dot(x, w) * sw[None, :]
        tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _awq_kernel(
        x_ptr, qw_ptr, qz_ptr, s_ptr, c_ptr, M, N, K, k_offset,
        stride_xm, stride_qwk, stride_qzg, stride_sg, stride_cm,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    ):
        # Program (m, n) as _w8a16_kernel; the weight tile unpacked from int32 nibbles, minus zeros, times scales.
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        row_ok, col_ok = rows < M, cols < N
        j = cols % 8
        shift = ((j % 2) * 4 + j // 2) * 4  # nibble of column j: the inverse of AutoAWQ's [0, 2, 4, 6, 1, 3, 5, 7]
        packed_cols = cols // 8
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for g in range(0, tl.cdiv(K + k_offset, BLOCK_K)):
            ks = (g * BLOCK_K - k_offset + tl.arange(0, BLOCK_K)).to(tl.int64)
            k_ok = (ks >= 0) & (ks < K)
            x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
            qw = tl.load(qw_ptr + ks[:, None] * stride_qwk + packed_cols[None, :],
                         mask=k_ok[:, None] & col_ok[None, :], other=0)  # [BK, BN] int32, 8 columns each
            q = (qw >> shift[None, :]) & 0xF
            z = (tl.load(qz_ptr + g * stride_qzg + packed_cols, mask=col_ok, other=0) >> shift) & 0xF  # [BN]
            s = tl.load(s_ptr + g * stride_sg + cols, mask=col_ok, other=0.0).to(tl.float32)  # [BN]
            w = ((q - z[None, :]).to(tl.float32) * s[None, :]).to(x.dtype)  # [BK, BN]
            if IEEE:
                acc += tl.dot(x, w, input_precision="ieee")
            else:
                acc += tl.dot(x, w)
        tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


def _block_m(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64


def _need_triton() -> None:
    if triton is None:
        raise RuntimeError("the quantized GPU GEMMs need triton, which is not installed")


def quantize_fp8_groups(x: torch.Tensor, k_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (``float8_e4m3fn [M, K]``, fp32 scales ``[M, G]``): per token, per 128-group of inputs.

    Group ``g`` holds local columns ``g * 128 - k_offset ..`` (the first one partial when
    ``k_offset > 0``, matching the weight's blocks); ``scale = amax / 448``, ``x ~ q * scale``.
    """
    _need_triton()
    m, k = x.shape
    groups = num_groups(k, k_offset)
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m:
        _quant_groups_kernel[(m, groups)](x, q, s, k, k_offset, x.stride(0), q.stride(0), s.stride(0), GROUP_K=GROUP)
    return q, s


def quantize_fp8_groups_reference(x: torch.Tensor, k_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch version of :func:`quantize_fp8_groups`."""
    m, k = x.shape
    groups = num_groups(k, k_offset)
    padded = torch.zeros(m, groups * GROUP, dtype=torch.float32, device=x.device)
    padded[:, k_offset : k_offset + k] = x.float()
    blocks = padded.view(m, groups, GROUP)
    s = blocks.abs().amax(dim=2).clamp(min=_EPS) / FP8_MAX  # [M, G]
    q = (blocks / s[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(m, -1)[:, k_offset : k_offset + k].contiguous(), s


def _fp8_launch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, k_offset: int, w8a8: bool) -> torch.Tensor:
    _need_triton()
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m, block_n = _block_m(m), 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    if w8a8:
        xq, xs = quantize_fp8_groups(x, k_offset)
        _w8a8_kernel[grid](xq, xs, weight, scale, out, m, n, k, k_offset,
                           xq.stride(0), xs.stride(0), weight.stride(0), scale.stride(0), out.stride(0),
                           BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=GROUP)
    else:
        _w8a16_kernel[grid](x, weight.view(torch.uint8), scale, out, m, n, k, k_offset,
                            x.stride(0), weight.stride(0), scale.stride(0), out.stride(0),
                            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=GROUP, IEEE=x.dtype == torch.float32)
    return out


def _awq_launch(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                k_offset: int) -> torch.Tensor:
    _need_triton()
    m, k = x.shape
    n = scales.shape[1]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m, block_n = _block_m(m), 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _awq_kernel[grid](x, qweight, qzeros, scales, out, m, n, k, k_offset,
                      x.stride(0), qweight.stride(0), qzeros.stride(0), scales.stride(0), out.stride(0),
                      BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=GROUP, IEEE=x.dtype == torch.float32)
    return out


def check_fp8_args(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, k_offset: int) -> None:
    """Raise :class:`KernelArgError` unless the arguments of ``rtp::fp8_block_linear`` fit."""
    op = "rtp::fp8_block_linear"
    check_dim(op, "x", x, 2, "[M, K]")
    check_dim(op, "weight", weight, 2, "[N, K]")
    n, k = weight.shape
    check_shape(op, "x", x, (x.shape[0], k), "[M, K] with weight's K")
    if not 0 <= k_offset < GROUP:
        raise KernelArgError(f"{op}: k_offset={k_offset} must be in [0, {GROUP})")
    check_shape(op, "scale", scale, (n, num_groups(k, k_offset)), "[N, ceil((K + k_offset) / 128)]")
    check_device(op, x=x, weight=weight, scale=scale)
    check_dtype(op, FLOAT_DTYPES, x=x)
    check_dtype(op, (torch.float8_e4m3fn,), weight=weight)
    check_dtype(op, (torch.float32,), scale=scale)
    if x.stride(-1) != 1 or not weight.is_contiguous() or scale.stride(-1) != 1:
        raise KernelArgError(f"{op}: x needs contiguous rows, the weight must be contiguous")


def check_awq_args(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   k_offset: int) -> None:
    """Raise :class:`KernelArgError` unless the arguments of ``rtp::awq_linear`` fit."""
    op = "rtp::awq_linear"
    check_dim(op, "x", x, 2, "[M, K]")
    check_dim(op, "scales", scales, 2, "[G, N]")
    k, n = x.shape[1], scales.shape[1]
    if n % 8 or not 0 <= k_offset < GROUP:
        raise KernelArgError(f"{op}: N={n} must be a multiple of 8 and k_offset={k_offset} in [0, {GROUP})")
    g = num_groups(k, k_offset)
    check_shape(op, "qweight", qweight, (k, n // 8), "[K, N/8]")
    check_shape(op, "qzeros", qzeros, (g, n // 8), "[G, N/8]")
    check_shape(op, "scales", scales, (g, n), "[G, N]")
    check_device(op, x=x, qweight=qweight, qzeros=qzeros, scales=scales)
    check_dtype(op, FLOAT_DTYPES, x=x)
    check_dtype(op, (torch.int32,), qweight=qweight, qzeros=qzeros)
    check_dtype(op, (torch.float16,), scales=scales)
    if x.stride(-1) != 1 or not (qweight.is_contiguous() and qzeros.is_contiguous() and scales.is_contiguous()):
        raise KernelArgError(f"{op}: x needs contiguous rows, the packed tensors must be contiguous")


@torch.library.custom_op("rtp::fp8_block_linear", mutates_args=())
def _fp8_op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, k_offset: int, w8a8: bool) -> torch.Tensor:
    check_fp8_args(x, weight, scale, k_offset)
    return _fp8_launch(x, weight, scale, k_offset, w8a8)


@_fp8_op.register_fake
def _fp8_fake(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, k_offset: int, w8a8: bool) -> torch.Tensor:
    check_fp8_args(x, weight, scale, k_offset)
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op("rtp::awq_linear", mutates_args=())
def _awq_op(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
            k_offset: int) -> torch.Tensor:
    check_awq_args(x, qweight, qzeros, scales, k_offset)
    return _awq_launch(x, qweight, qzeros, scales, k_offset)


@_awq_op.register_fake
def _awq_fake(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
              k_offset: int) -> torch.Tensor:
    check_awq_args(x, qweight, qzeros, scales, k_offset)
    return x.new_empty(x.shape[0], scales.shape[1])


def _flat(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, k_offset: int = 0,
                     w8a8: bool = True) -> torch.Tensor:
    """``x [..., K] @ Wᵀ`` for an FP8 block weight (see the module docstring): FP8 products (``w8a8``,
    sm89+) or the weight decoded next to bf16/fp16 activations; ``[..., N]`` in x's dtype."""
    x2 = _flat(x)
    if x.is_cuda:
        y = torch.ops.rtp.fp8_block_linear(x2, weight, scale, k_offset, w8a8)
    else:
        check_fp8_args(x2, weight, scale, k_offset)
        y = _fp8_launch(x2, weight, scale, k_offset, w8a8)
    return y.view(*x.shape[:-1], weight.shape[0])


def fp8_w8a8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, k_offset: int = 0) -> torch.Tensor:
    """:func:`fp8_block_linear` with FP8 activations (per-token-group quantized)."""
    return fp8_block_linear(x, weight, scale, k_offset, w8a8=True)


def fp8_w8a16_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, k_offset: int = 0) -> torch.Tensor:
    """:func:`fp8_block_linear` with the activations in their own dtype (GPUs without FP8 products)."""
    return fp8_block_linear(x, weight, scale, k_offset, w8a8=False)


def awq_linear(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               k_offset: int = 0) -> torch.Tensor:
    """``x [..., K] @ Wᵀ`` for an AutoAWQ GEMM weight (see the module docstring); ``[..., N]`` in x's dtype."""
    x2 = _flat(x)
    if x.is_cuda:
        y = torch.ops.rtp.awq_linear(x2, qweight, qzeros, scales, k_offset)
    else:
        check_awq_args(x2, qweight, qzeros, scales, k_offset)
        y = _awq_launch(x2, qweight, qzeros, scales, k_offset)
    return y.view(*x.shape[:-1], scales.shape[1])


def fp8_w8a8_supported(device: torch.device) -> bool:
    """True on a CUDA GPU whose tensor cores multiply FP8 (compute capability 8.9 or later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
