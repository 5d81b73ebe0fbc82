"""Paged attention in Triton: decode (one query per sequence) and prefill/mixed (varlen, causal).

Both kernels read K/V from the paged cache ``[num_blocks, block_size, num_kv_heads, head_dim]``
through ``block_tables [B, max_blocks] int32`` and ``context_lens [B] int32`` (keys per sequence).
Sequence i has ``q_lens[i]`` query tokens at the end of its ``k_lens[i]`` keys: query j sits at
absolute position ``k_len - q_len + j`` and sees the keys at positions <= it. Every key, the new
tokens' included, is already in the cache (the layer stores them first).

Query head h reads KV head ``h // (Hq // Hkv)`` (GQA; MHA when the two are equal). Softmax runs
online in fp32 (exp2 with the scale folded into log2 units). ``head_dim`` is padded to a power of
two with masks; a KV tile of ``BLOCK_N`` positions may span several cache blocks or part of one,
each position looking up its own block, so any ``block_size`` works.

Neither kernel syncs with the host and both grids depend only on tensor shapes, not on the
context lengths, so both can be captured in CUDA graphs.

The torch references below are also the runtime's CPU path (``PagedAttention._torch``).

An FP8 cache (:mod:`rtp.kernels.fp8_kv`) comes with the layer's ``k_scale`` and ``v_scale``: the references
dequantize the gathered blocks to the queries' dtype; the kernels convert each tile and fold the scales into
the scores and the output.

:func:`paged_decode_attention` and :func:`paged_prefill_attention` go through the torch custom ops
``rtp::paged_decode_attention`` and ``rtp::paged_prefill_attention``: the real implementations launch
the Triton kernels (the torch references where triton is missing); the fake ones check shapes,
dtypes and devices and return an empty ``[T, Hq, D]``, so the CUDA path can be traced with fake
CUDA tensors on a machine without a GPU (:mod:`rtp.fake_cuda`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rtp.kernels.fp8_kv import check_cache_dtypes, from_cache
from rtp.kernels.op_checks import KernelArgError, check_device, check_dim, check_dtype, check_shape
from rtp.kernels.paged_attention_triton import decode_triton, default_num_splits, prefill_triton

try:
    import triton
except ImportError:  # pragma: no cover - triton is a dependency, but keep import-safe
    triton = None


def triton_available() -> bool:
    """True when triton imported."""
    return triton is not None


# --------------------------------------------------------------------------------------------
# Torch references (and the CPU path)
# --------------------------------------------------------------------------------------------


def _gather(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    # cache: [num_blocks, block_size, Hkv, D]; table: [max_blocks] -> [length, Hkv, D]
    n = -(-length // cache.shape[1])
    # index_select copies whole blocks (memcpy per block); advanced indexing goes element by element.
    # Entries past the context may be padding (-1 or 0): clamp so index_select accepts them; never read.
    return cache.index_select(0, table[:n].long().clamp_min(0)).flatten(0, 1)[:length]


def paged_prefill_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_lens: list[int],
    k_lens: list[int],
    scale: float,
    block_tables: torch.Tensor | None = None,
    skip: set[int] | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal varlen attention, one sequence at a time (torch reference for every case).

    ``q``: ``[T, Hq, D]``, sequence i's queries at offset ``sum(q_lens[:i])``. With
    ``block_tables`` ``[B, max_blocks]``, ``k``/``v`` are the paged caches and sequence i's keys
    are its first ``k_lens[i]`` cached positions. Without (no cache: the profiling run), ``k``/``v``
    are the step's own ``[T, Hkv, D]`` keys and values, laid out like ``q``. Returns ``[T, Hq, D]``;
    the rows of sequences in ``skip`` are left unset (the caller computes them another way).
    An FP8 cache is dequantized with ``k_scale`` / ``v_scale`` as it is gathered.
    """
    rep = q.shape[1] // k.shape[-2]
    out = q.new_empty(q.shape)  # contiguous [*, Hq, D]
    start = 0  # offset of sequence i's queries in the flat batch
    for i, (q_len, k_len) in enumerate(zip(q_lens, k_lens)):
        if skip and i in skip:
            start += q_len
            continue
        qi = q[start : start + q_len]  # [q_len, Hq, D]
        if block_tables is not None:
            ki = from_cache(_gather(k, block_tables[i], k_len), q.dtype, k_scale)  # [k_len, Hkv, D]
            vi = from_cache(_gather(v, block_tables[i], k_len), q.dtype, v_scale)
        else:
            ki, vi = k[start : start + q_len], v[start : start + q_len]
        mask = None
        if q_len != k_len:  # (q_len == k_len: plain causal, which lets SDPA pick a fused kernel)
            # Query j sits at absolute position k_len - q_len + j and sees keys <= it.
            q_pos = torch.arange(k_len - q_len, k_len, device=q.device).unsqueeze(1)
            mask = torch.arange(k_len, device=q.device).unsqueeze(0) <= q_pos  # [q_len, k_len]
        o = F.scaled_dot_product_attention(
            qi.transpose(0, 1),  # [Hq, q_len, D]
            ki.transpose(0, 1),  # [Hkv, k_len, D]: query head h reads KV head h // rep
            vi.transpose(0, 1),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=rep > 1,
        )
        out[start : start + q_len] = o.transpose(0, 1)
        start += q_len
    return out


def paged_decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    max_seqlen_k: int,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence (torch reference): gather every sequence's blocks at once, mask by length.

    ``q``: ``[B, Hq, D]``; ``max_seqlen_k`` bounds the blocks gathered. Returns ``[B, Hq, D]``. An FP8
    cache is dequantized with ``k_scale`` / ``v_scale`` once gathered.
    """
    rep = q.shape[1] // k_cache.shape[2]
    n_blocks = -(-max_seqlen_k // k_cache.shape[1])
    b = q.shape[0]
    table = block_tables[:, :n_blocks].long().clamp_min(0).flatten()  # [B * n_blocks]; padding masked below
    k = from_cache(k_cache.index_select(0, table).view(b, -1, *k_cache.shape[2:]), q.dtype, k_scale)  # [B, L, Hkv, D]
    v = from_cache(v_cache.index_select(0, table).view(b, -1, *v_cache.shape[2:]), q.dtype, v_scale)
    pos = torch.arange(k.shape[1], device=q.device)
    mask = (pos.unsqueeze(0) < context_lens.unsqueeze(1)).unsqueeze(1).unsqueeze(1)  # [B, 1, 1, L]
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [B, Hq, 1, D]
        k.transpose(1, 2),  # [B, Hkv, L, D]
        v.transpose(1, 2),
        attn_mask=mask,
        scale=scale,
        enable_gqa=rep > 1,
    )
    return o.squeeze(2)


def check_paged_attention_args(
    op: str,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Raise :class:`~rtp.kernels.op_checks.KernelArgError` unless the arguments of a paged-attention op fit.

    Decode (``cu_seqlens_q`` None): ``q [B, Hq, D]``. Prefill: ``q [T, Hq, D]`` and ``cu_seqlens_q [B + 1]``.
    The caches share ``q``'s dtype, or are FP8 with both scales.
    """
    check_dim(op, "q", q, 3, "[T, Hq, D]")
    check_dim(op, "k_cache", k_cache, 4, "[num_blocks, block_size, Hkv, D]")
    check_shape(op, "v_cache", v_cache, tuple(k_cache.shape), "k_cache's shape")
    if q.shape[1] % k_cache.shape[2] or q.shape[2] != k_cache.shape[3]:
        raise KernelArgError(f"{op}: query heads/dim {list(q.shape[1:])} do not fit a cache of shape "
                             f"{list(k_cache.shape)} (Hq must be a multiple of Hkv, and D equal)")
    check_dim(op, "context_lens", context_lens, 1, "[B]")
    batch = context_lens.shape[0]
    check_dim(op, "block_tables", block_tables, 2, "[B, max_blocks]")
    check_shape(op, "block_tables", block_tables, (batch, block_tables.shape[1]), "[B, max_blocks]")
    index = {"block_tables": block_tables, "context_lens": context_lens}
    if cu_seqlens_q is None:
        check_shape(op, "q", q, (batch, *q.shape[1:]), "[B, Hq, D] (one query per sequence)")
    else:
        check_shape(op, "cu_seqlens_q", cu_seqlens_q, (batch + 1,), "[B + 1]")
        index["cu_seqlens_q"] = cu_seqlens_q
    check_device(op, q=q, k_cache=k_cache, v_cache=v_cache, **index)
    check_cache_dtypes(op, "q", q, k_cache, v_cache, k_scale, v_scale)
    check_dtype(op, (torch.int32,), **index)


@torch.library.custom_op("rtp::paged_decode_attention", mutates_args=())
def _decode_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    block_n: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    op = "rtp::paged_decode_attention"
    check_paged_attention_args(op, q, k_cache, v_cache, block_tables, context_lens, None, k_scale, v_scale)
    if triton is None:  # every block of the table is gathered; positions past a context are masked
        max_len = block_tables.shape[1] * k_cache.shape[1]
        out = paged_decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, max_len, scale,
                                               k_scale, v_scale)
        return out.contiguous()
    return decode_triton(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits, block_n, k_scale, v_scale)


@_decode_op.register_fake
def _decode_fake(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    block_n: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    check_paged_attention_args("rtp::paged_decode_attention", q, k_cache, v_cache, block_tables, context_lens, None,
                               k_scale, v_scale)
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise KernelArgError(f"rtp::paged_decode_attention: num_splits={num_splits} must be a power of two")
    return q.new_empty(q.shape)  # contiguous [B, Hq, D]


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    block_n: int = 32,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention, one query per sequence: ``q [B, Hq, D]`` -> ``[B, Hq, D]`` (Triton).

    ``context_lens [B]`` counts each sequence's keys, the current token's included. ``num_splits``
    (a power of two) splits each context into that many parts, merged by a second kernel
    (flash-decoding); by default it is chosen from the batch shape and the GPU's SM count.
    An FP8 cache needs the layer's ``k_scale`` and ``v_scale``. Runs as the ``rtp::paged_decode_attention`` op.
    """
    if num_splits is None:
        num_splits = default_num_splits(q.shape[0], k_cache.shape[2], q.device) if triton is not None else 1
    return torch.ops.rtp.paged_decode_attention(
        q, k_cache, v_cache, block_tables, context_lens, float(scale), num_splits, block_n, k_scale, v_scale
    )


@torch.library.custom_op("rtp::paged_prefill_attention", mutates_args=())
def _prefill_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    block_m: int,
    block_n: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    op = "rtp::paged_prefill_attention"
    check_paged_attention_args(op, q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, k_scale, v_scale)
    if triton is None:  # the reference needs the lengths on the host (a sync: this path is never captured)
        q_lens, k_lens = cu_seqlens_q.diff().tolist(), context_lens.tolist()
        return paged_prefill_attention_reference(q, k_cache, v_cache, q_lens, k_lens, scale, block_tables, None,
                                                 k_scale, v_scale)
    return prefill_triton(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, block_m, block_n,
                          k_scale, v_scale)


@_prefill_op.register_fake
def _prefill_fake(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    block_m: int,
    block_n: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    op = "rtp::paged_prefill_attention"
    check_paged_attention_args(op, q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, k_scale, v_scale)
    return q.new_empty(q.shape)  # contiguous [T, Hq, D]


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal varlen attention over the paged cache: ``q [T, Hq, D]`` -> ``[T, Hq, D]`` (Triton).

    Sequence i's queries are rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` of ``q``, the last of its
    ``context_lens[i]`` keys; decode rows (one query) and prefill chunks may share a batch.
    ``block_m`` x ``block_n`` is the (queries x keys) tile: 64 x 64 by default, 32 x 32 past head_dim 128.
    An FP8 cache needs the layer's ``k_scale`` and ``v_scale``. Runs as the ``rtp::paged_prefill_attention`` op.
    """
    return torch.ops.rtp.paged_prefill_attention(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, float(scale), block_m or 0, block_n or 0,
        k_scale, v_scale,
    )
