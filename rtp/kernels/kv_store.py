"""Write the new tokens' K and V into the paged KV cache.

Cache layout (flash-attn's paged layout): ``[num_blocks, block_size, num_kv_heads, head_dim]``.
Token t goes to flat slot ``slot_mapping[t] = block_id * block_size + offset``;
a slot of -1 means "do not store" (padding rows of a CUDA graph batch). An FP8 cache
(:mod:`rtp.kernels.fp8_kv`) stores ``x / scale`` in e4m3 with the layer's ``k_scale`` / ``v_scale``.

On CUDA, :func:`store_kv` goes through the torch custom op ``rtp::store_kv``: its real
implementation launches the Triton kernel (the torch reference where triton is missing), its fake
implementation checks the arguments and writes nothing, so the CUDA path can be traced with fake
CUDA tensors on a machine without a GPU (:mod:`rtp.fake_cuda`).
"""

from __future__ import annotations

import torch

from rtp.kernels import cpu_ops
from rtp.kernels.fp8_kv import FP8_MAX, check_cache_dtypes, is_fp8, to_cache
from rtp.kernels.op_checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    KernelArgError,
    check_device,
    check_dim,
    check_same_dtype,
    check_shape,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency, but keep import-safe
    triton = None


def store_kv_reference(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    """Torch reference: ``cache.flat[slot] = kv`` for every slot >= 0 (``kv / scale`` in e4m3 for an FP8 cache)."""
    # key/value: [T, H, D]; caches: [B, S, H, D] viewed as [B*S, H, D]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = to_cache(key[valid], k_cache.dtype, k_scale)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = to_cache(value[valid], v_cache.dtype, v_scale)


if triton is not None:

    @triton.jit
    def _round_to_e4m3(y):
        # y: fp32 within +-448. Rounds to e4m3's grid (3 mantissa bits; below 2**-6 the subnormal step 2**-9),
        # to nearest even, in fp32: adding 2**(e + 20) for |y| in [2**e, 2**(e+1)) leaves a sum whose last bit
        # is worth 2**(e - 3), so the fp32 add rounds there; subtracting it back is exact. The cast to e4m3 that
        # follows then drops only zero bits: no result depends on how a conversion rounds (the interpreter's
        # fp32 -> e4m3 conversion loses the carry into the exponent, 125.6 -> 64, and rounds ties away).
        a = tl.abs(y)
        binade = (a.to(tl.uint32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)  # 2**floor(log2 a)
        magic = tl.maximum(binade, 0.015625) * 1048576.0  # 2**-6 (the subnormal grid) at least; * 2**20
        r = (a + magic) - magic  # >= +0
        # y's sign bit put back with an OR: a negation compiles to 0 - r on a GPU, which turns -0.0 into +0.0
        sign = y.to(tl.uint32, bitcast=True) & 0x80000000
        return (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)

    @triton.jit
    def _store_kv_kernel(
        key_ptr, key_stride, value_ptr, value_stride, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
        WIDTH: tl.constexpr, BLOCK: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr,
    ):
        # One program per token; WIDTH = num_kv_heads * head_dim contiguous elements,
        # BLOCK = WIDTH rounded up to a power of two (tl.arange needs one), masked.
        # FP8: store x / scale (an exactly rounded division, as the reference), saturated, in the cache's dtype.
        t = tl.program_id(0).to(tl.int64)  # 64-bit offsets: t * stride can pass 2**31
        slot = tl.load(slot_ptr + t)
        if slot >= 0:
            cols = tl.arange(0, BLOCK)
            mask = cols < WIDTH
            k = tl.load(key_ptr + t * key_stride + cols, mask=mask)
            v = tl.load(value_ptr + t * value_stride + cols, mask=mask)
            if FP8:
                k = _round_to_e4m3(tl.clamp(tl.div_rn(k.to(tl.float32), tl.load(k_scale_ptr)), -FP8_MAX, FP8_MAX))
                v = _round_to_e4m3(tl.clamp(tl.div_rn(v.to(tl.float32), tl.load(v_scale_ptr)), -FP8_MAX, FP8_MAX))
            tl.store(k_cache_ptr + slot * WIDTH + cols, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(v_cache_ptr + slot * WIDTH + cols, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    """Triton version of :func:`store_kv_reference` (GPU, or CPU under TRITON_INTERPRET=1)."""
    num_tokens, num_heads, head_dim = key.shape
    width = num_heads * head_dim
    # The kernel reads each token's heads as one contiguous row and needs a power-of-two width.
    if key.stride(-1) != 1 or key.stride(1) != head_dim or value.stride(-1) != 1 or value.stride(1) != head_dim:
        raise ValueError("store_kv_triton needs [T, H, D] tensors contiguous in their last two dims")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("store_kv_triton needs contiguous caches")
    fp8 = is_fp8(k_cache)
    if fp8 and (k_scale is None or v_scale is None):
        raise ValueError("store_kv_triton: an fp8 cache needs k_scale and v_scale")
    _store_kv_kernel[(num_tokens,)](
        key, key.stride(0), value, value.stride(0), k_cache, v_cache, slot_mapping,
        k_scale if fp8 else slot_mapping, v_scale if fp8 else slot_mapping,  # (not read without FP8)
        WIDTH=width, BLOCK=triton.next_power_of_2(width), FP8=fp8, FP8_MAX=FP8_MAX,
    )


def check_store_kv_args(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    """Raise :class:`~rtp.kernels.op_checks.KernelArgError` unless the arguments fit one another."""
    op = "rtp::store_kv"
    check_dim(op, "key", key, 3, "[T, Hkv, D]")
    check_shape(op, "value", value, tuple(key.shape), "key's [T, Hkv, D]")
    check_dim(op, "k_cache", k_cache, 4, "[num_blocks, block_size, Hkv, D]")
    check_shape(op, "v_cache", v_cache, tuple(k_cache.shape), "k_cache's shape")
    check_shape(op, "key", key, (key.shape[0], *k_cache.shape[2:]), "[T, Hkv, D] of the cache's heads")
    check_shape(op, "slot_mapping", slot_mapping, (key.shape[0],), "[T]")
    check_device(op, key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    check_same_dtype(op, key=key, value=value)
    check_cache_dtypes(op, "key", key, k_cache, v_cache, k_scale, v_scale)
    if key.dtype not in FLOAT_DTYPES or slot_mapping.dtype not in INDEX_DTYPES:
        raise KernelArgError(f"{op}: key is {key.dtype} and slot_mapping {slot_mapping.dtype}; expected "
                             "float32/bfloat16/float16 keys and int32/int64 slots")


@torch.library.custom_op("rtp::store_kv", mutates_args=("k_cache", "v_cache"))
def _store_kv_op(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    check_store_kv_args(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if triton is not None:
        store_kv_triton(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    else:
        store_kv_reference(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


@_store_kv_op.register_fake
def _store_kv_fake(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    check_store_kv_args(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def store_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    """Store K/V into the paged cache: the ``rtp::store_kv`` op on CUDA (graph-capturable), C++ on CPU.

    An FP8 cache takes the layer's scales; on CPU it is written by the torch reference (the C++ copy
    moves bytes of one dtype, it does not quantize).
    """
    if key.is_cuda:
        torch.ops.rtp.store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    elif _fits_cpu_kernel(key, value, k_cache, v_cache):
        cpu_ops.store_kv(key, value, k_cache, v_cache, slot_mapping)
    else:
        if is_fp8(k_cache):
            check_store_kv_args(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        store_kv_reference(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def _fits_cpu_kernel(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the C++ copy serves these: CPU tensors of one dtype, shapes that fit, contiguous heads and caches.

    Anything else takes the reference, which raises its own error for arguments that do not fit. The kernel
    checks each slot against the cache's size.
    """
    if key.device.type != "cpu" or key.dim() != 3 or k_cache.dim() != 4 or not cpu_ops.available():
        return False
    head_dim = key.shape[-1]
    return (value.shape == key.shape and key.shape[1:] == k_cache.shape[2:] and v_cache.shape == k_cache.shape
            and key.dtype == value.dtype == k_cache.dtype == v_cache.dtype
            and all(t.stride(-1) == 1 and t.stride(1) == head_dim for t in (key, value))
            and k_cache.is_contiguous() and v_cache.is_contiguous())
