"""Paged attention with three backends, chosen once per runner by :func:`choose_attn_backend`.

- ``"flash"``: flash-attn 2 (CUDA, fp16/bf16, Ampere or newer, block size a multiple of 256).
- ``"triton"``: the Triton paged-attention kernels of :mod:`rtp.kernels.paged_attention`
  (CUDA without flash-attn; any block size; the decode kernel is CUDA-graph capturable).
- ``"cpu"``: the C++ kernels of :mod:`rtp.kernels.cpu_attention` (decode, and varlen for prompt
  chunks and mixed steps; both read the paged cache once, no gather); chosen on CPU when they build.
- ``"torch"``: the torch references of :mod:`rtp.kernels.paged_attention` (a GPU with neither,
  or a CPU without a compiler).

Every step flattens its sequences into one token batch: sequence i
contributes ``q_lens[i]`` query tokens at the end of its ``k_lens[i]`` keys
(the keys before them are already in the paged cache: a cached prefix, earlier
prefill chunks, or earlier decode steps). Every backend covers every case:
mixed prefill/decode, chunked prefill, cached prefixes. Without a cache (the
profiling run) the triton backend takes the torch path.

An FP8 KV cache (``kv_cache_dtype: fp8_e4m3``, :mod:`rtp.kernels.fp8_kv`) is read by the triton and
torch backends only: flash-attn 2 and the C++ CPU kernels read caches in the compute dtype, so
:func:`choose_attn_backend` routes an FP8 cache to Triton on CUDA and to the torch path on CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from rtp.errors import CheckpointError
from rtp.kernels import cpu_attention
from rtp.kernels.fp8_kv import FP8_KV_DTYPE, is_fp8
from rtp.kernels.kv_store import store_kv
from rtp.kernels.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_reference,
    paged_prefill_attention,
    paged_prefill_attention_reference,
    triton_available,
)
from rtp.log import get_logger

try:  # optional extra "gpu"
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
except ImportError:
    flash_attn_varlen_func = flash_attn_with_kvcache = None


FLASH_DTYPES = (torch.float16, torch.bfloat16)

AttnBackend = Literal["flash", "triton", "cpu", "torch"]

logger = get_logger(__name__)


def flash_attn_available() -> bool:
    """True when the flash-attn package imported."""
    return flash_attn_varlen_func is not None


def use_flash_attn(device: torch.device, dtype: torch.dtype) -> bool:
    """flash-attn 2 serves fp16/bf16 on Ampere or newer; everything else takes the torch path."""
    return (
        device.type == "cuda"
        and flash_attn_available()
        and dtype in FLASH_DTYPES
        and torch.cuda.get_device_capability(device) >= (8, 0)
    )


def choose_attn_backend(device: torch.device, dtype: torch.dtype,
                        cache_dtype: torch.dtype | None = None) -> AttnBackend:
    """flash-attn where usable, else the Triton kernels on CUDA, else the torch path.

    ``cache_dtype`` (default: ``dtype``): an FP8 cache skips flash-attn and the C++ CPU kernels (see the
    module docstring).
    """
    fp8 = cache_dtype == FP8_KV_DTYPE
    if use_flash_attn(device, dtype):
        if not fp8:
            return "flash"
        logger.info("fp8 KV cache: flash-attn 2 reads %s caches only; using the Triton paged attention", dtype)
    if device.type == "cuda" and triton_available():
        return "triton"
    if device.type == "cpu" and cpu_attention.load() is not None:
        if not fp8:
            return "cpu"
        logger.info("fp8 KV cache: the C++ CPU attention kernels read fp32/bf16/fp16 caches only; using the "
                    "torch path (it dequantizes the gathered blocks)")
    return "torch"


@dataclass
class AttnMetadata:
    """Where this step's tokens sit in the batch and in the KV cache."""

    slot_mapping: torch.Tensor  # [T] int64: flat cache slot of each new token, -1 = skip
    cu_seqlens_q: torch.Tensor  # [B+1] int32: query offsets in the flat batch
    cu_seqlens_k: torch.Tensor  # [B+1] int32: key offsets (keys = cached + new)
    context_lens: torch.Tensor  # [B] int32: keys per sequence
    block_tables: torch.Tensor | None  # [B, max_blocks] int32; None = no cache (profiling run)
    max_seqlen_q: int
    max_seqlen_k: int
    q_lens: list[int]  # host copies, for the torch path
    k_lens: list[int]

    @property
    def decode_only(self) -> bool:
        return self.max_seqlen_q == 1


def load_kv_scale(scale: torch.Tensor, source, shard_id: object = None) -> None:  # noqa: ANN001
    """Loader of a KV scale: one float, stored as ``[]`` or ``[1]`` in any float dtype, the same on every rank."""
    if source.get_dtype() not in ("F32", "BF16", "F16", "F64"):
        raise CheckpointError(f"a KV scale must be a float, not {source.get_dtype()}")
    value = source[...]
    values = value.tolist()  # read directly (no tensor op: the fake-CUDA dry run loads under fake mode)
    values = values if isinstance(values, list) else [values]
    if not all(math.isfinite(v) and v > 0 for v in values):  # 0 or less: every key or value read as garbage
        raise CheckpointError(f"a KV scale must be a positive finite number, got {values}")
    scale.data.copy_(value)  # [] or [1] -> the buffer's [1], converted to float32


class PagedAttention(nn.Module):
    """Causal attention over this rank's heads, reading keys/values from the paged cache."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        # Bound by the KV-cache allocator: [num_blocks, block_size, num_kv_heads, head_dim]
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # Per-tensor scales of an FP8 cache (stored = x / scale): the checkpoint's self_attn.k_scale / v_scale,
        # else 1.0. Read only when the cache is FP8.
        self.k_scale: torch.Tensor
        self.v_scale: torch.Tensor
        self.register_buffer("k_scale", torch.ones(1, dtype=torch.float32))
        self.register_buffer("v_scale", torch.ones(1, dtype=torch.float32))
        for buf in (self.k_scale, self.v_scale):
            buf.weight_loader = load_kv_scale
        self.backend: AttnBackend = "torch"  # set by the runner, from choose_attn_backend(), for every layer
        # "cpu" backend: one-query rows take the varlen kernel too, so that a row's result does not depend on the
        # step it is in (model.batch_invariant; set by the runner).
        self.varlen_decode = False

    def cache_scales(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(k_scale, v_scale) for the kernels: the layer's scales with an FP8 cache, else (None, None)."""
        return (self.k_scale, self.v_scale) if is_fp8(self.k_cache) else (None, None)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D] -> [T, Hq, D]
        tables = meta.block_tables if self.k_cache.numel() > 0 else None  # None: no cache (profiling run)
        if tables is not None:
            store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping, *self.cache_scales())
        if self.backend == "flash":
            return self._flash(q, k, v, meta, tables is not None)
        if self.backend == "triton" and tables is not None:
            return self._triton(q, meta, tables)
        if self.backend == "cpu" and tables is not None:
            return self._cpu(q, k, v, meta, tables)
        return self._torch(q, k, v, meta, tables)

    def _flash(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttnMetadata, has_cache: bool
    ) -> torch.Tensor:
        if not has_cache:
            return flash_attn_varlen_func(
                q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_q, meta.max_seqlen_q, meta.max_seqlen_q,
                softmax_scale=self.scale, causal=True,
            )
        if meta.decode_only:
            out = flash_attn_with_kvcache(
                q.unsqueeze(1), self.k_cache, self.v_cache, cache_seqlens=meta.context_lens,
                block_table=meta.block_tables, softmax_scale=self.scale, causal=True,
            )  # [B, 1, Hq, D]
            return out.squeeze(1)
        return flash_attn_varlen_func(
            q, self.k_cache, self.v_cache, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q,
            meta.max_seqlen_k, softmax_scale=self.scale, causal=True, block_table=meta.block_tables,
        )

    def _triton(self, q: torch.Tensor, meta: AttnMetadata, tables: torch.Tensor) -> torch.Tensor:
        # q: [T, Hq, D] -> [T, Hq, D]; reads only device tensors (no host sync: graph-capturable decode)
        k_scale, v_scale = self.cache_scales()
        if meta.decode_only:
            return paged_decode_attention(q, self.k_cache, self.v_cache, tables, meta.context_lens, self.scale,
                                          k_scale=k_scale, v_scale=v_scale)
        return paged_prefill_attention(
            q, self.k_cache, self.v_cache, tables, meta.cu_seqlens_q, meta.context_lens, self.scale,
            k_scale=k_scale, v_scale=v_scale,
        )

    def _cpu(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttnMetadata, tables: torch.Tensor
    ) -> torch.Tensor:
        # q: [T, Hq, D] -> [T, Hq, D]; this step's k/v are already in the cache.
        if meta.decode_only and not self.varlen_decode:
            return cpu_attention.paged_decode_attention_cpu(
                q, self.k_cache, self.v_cache, tables, meta.context_lens, self.scale
            )
        return cpu_attention.paged_prefill_attention_cpu(
            q, self.k_cache, self.v_cache, tables, meta.cu_seqlens_q, meta.context_lens, self.scale
        )

    def _torch(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttnMetadata, tables: torch.Tensor | None
    ) -> torch.Tensor:
        k_scale, v_scale = self.cache_scales()
        if tables is None or (k_scale is None and list(meta.q_lens) == list(meta.k_lens)):
            # No cache, or every sequence is a whole prompt: this step's own k/v [T, Hkv, D] hold all its keys
            # (and equal what the cache holds, unless it is FP8: then attention reads the cache, as the kernels do).
            return paged_prefill_attention_reference(q, k, v, meta.q_lens, meta.q_lens, self.scale)
        if meta.decode_only:
            return paged_decode_attention_reference(
                q, self.k_cache, self.v_cache, tables, meta.context_lens, meta.max_seqlen_k, self.scale,
                k_scale, v_scale,
            )
        return paged_prefill_attention_reference(
            q, self.k_cache, self.v_cache, meta.q_lens, meta.k_lens, self.scale, tables, None, k_scale, v_scale
        )
