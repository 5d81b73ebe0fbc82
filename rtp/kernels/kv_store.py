"""Write the new tokens' K and V into the paged KV cache.

Cache layout (flash-attn's paged layout): ``[num_blocks, block_size, num_kv_heads, head_dim]``.
Token t goes to flat slot ``slot_mapping[t] = block_id * block_size + offset``;
a slot of -1 means "do not store" (padding rows of a CUDA graph batch).

On CUDA, :func:`store_kv` goes through the torch custom op ``rtp::store_kv``: its real
implementation launches the Triton kernel (the torch reference where triton is missing), its fake
implementation checks the arguments and writes nothing, so the CUDA path can be traced with fake
CUDA tensors on a machine without a GPU (:mod:`rtp.fake_cuda`).
"""

from __future__ import annotations

import torch

from rtp.kernels import cpu_ops
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
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Torch reference: ``cache.flat[slot] = kv`` for every slot >= 0."""
    # key/value: [T, H, D]; caches: [B, S, H, D] viewed as [B*S, H, D]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key[valid]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value[valid]


if triton is not None:

    @triton.jit
    def _store_kv_kernel(
        key_ptr, key_stride, value_ptr, value_stride, k_cache_ptr, v_cache_ptr, slot_ptr,
        WIDTH: tl.constexpr, BLOCK: tl.constexpr,
    ):
        # One program per token; WIDTH = num_kv_heads * head_dim contiguous elements,
        # BLOCK = WIDTH rounded up to a power of two (tl.arange needs one), masked.
        t = tl.program_id(0).to(tl.int64)  # 64-bit offsets: t * stride can pass 2**31
        slot = tl.load(slot_ptr + t)
        if slot >= 0:
            cols = tl.arange(0, BLOCK)
            mask = cols < WIDTH
            k = tl.load(key_ptr + t * key_stride + cols, mask=mask)
            v = tl.load(value_ptr + t * value_stride + cols, mask=mask)
            tl.store(k_cache_ptr + slot * WIDTH + cols, k, mask=mask)
            tl.store(v_cache_ptr + slot * WIDTH + cols, v, mask=mask)


def store_kv_triton(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Triton version of :func:`store_kv_reference` (GPU, or CPU under TRITON_INTERPRET=1)."""
    num_tokens, num_heads, head_dim = key.shape
    width = num_heads * head_dim
    # The kernel reads each token's heads as one contiguous row and needs a power-of-two width.
    if key.stride(-1) != 1 or key.stride(1) != head_dim or value.stride(-1) != 1 or value.stride(1) != head_dim:
        raise ValueError("store_kv_triton needs [T, H, D] tensors contiguous in their last two dims")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("store_kv_triton needs contiguous caches")
    _store_kv_kernel[(num_tokens,)](
        key, key.stride(0), value, value.stride(0), k_cache, v_cache, slot_mapping,
        WIDTH=width, BLOCK=triton.next_power_of_2(width),
    )


def check_store_kv_args(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
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
    check_same_dtype(op, k_cache=k_cache, key=key, value=value, v_cache=v_cache)
    if key.dtype not in FLOAT_DTYPES or slot_mapping.dtype not in INDEX_DTYPES:
        raise KernelArgError(f"{op}: key is {key.dtype} and slot_mapping {slot_mapping.dtype}; expected a float "
                         "cache dtype and int32/int64 slots")


@torch.library.custom_op("rtp::store_kv", mutates_args=("k_cache", "v_cache"))
def _store_kv_op(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    check_store_kv_args(key, value, k_cache, v_cache, slot_mapping)
    if triton is not None:
        store_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        store_kv_reference(key, value, k_cache, v_cache, slot_mapping)


@_store_kv_op.register_fake
def _store_kv_fake(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    check_store_kv_args(key, value, k_cache, v_cache, slot_mapping)


def store_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store K/V into the paged cache: the ``rtp::store_kv`` op on CUDA (graph-capturable), C++ on CPU."""
    if key.is_cuda:
        torch.ops.rtp.store_kv(key, value, k_cache, v_cache, slot_mapping)
    elif _fits_cpu_kernel(key, value, k_cache, v_cache):
        cpu_ops.store_kv(key, value, k_cache, v_cache, slot_mapping)
    else:
        store_kv_reference(key, value, k_cache, v_cache, slot_mapping)


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
