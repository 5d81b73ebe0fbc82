"""The Triton kernels of paged attention and their launchers (see :mod:`rtp.kernels.paged_attention`).

Called through the ``rtp::paged_decode_attention`` / ``rtp::paged_prefill_attention`` custom ops of
:mod:`rtp.kernels.paged_attention`, never directly by the runtime.

With an FP8 cache (``KV_FP8``) each K/V tile is converted to the queries' dtype (exact: every e4m3 value
is a bf16/fp16/fp32 value), ``k_scale`` is folded into the score scale and ``v_scale`` into the output,
so the dots run as for a bf16 cache, on half the bytes read.
"""

from __future__ import annotations

import functools

import torch

from rtp.kernels.fp8_kv import is_fp8

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency, but keep import-safe
    triton = None

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 16  # decode: most KV splits per (sequence, KV head)

# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _attend_tile(
        q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row, kv_head, n0, kv_end, q_pos,
        stride_kb, stride_kt, stride_kh, scale_log2e,
        HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr,
        CAUSAL: tl.constexpr,
    ):
        # One online-softmax step over keys [n0, n0 + BLOCK_N) of one sequence and one KV head.
        # q: [M, D_PAD]; acc: [M, D_PAD] fp32; m_i, l_i: [M] fp32 (running max, in log2 units, and sum)
        # q_pos: [M] absolute query positions (causal only). Returns the updated (acc, m_i, l_i).
        # An FP8 cache's tiles are converted to q's dtype here; its scales are applied by the caller.
        pos = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        dims = tl.arange(0, D_PAD)
        valid = pos < kv_end
        block = tl.load(table_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)  # cache block per key
        kv_off = block * stride_kb + (pos % BLOCK_SIZE) * stride_kt + kv_head * stride_kh  # [BLOCK_N] int64
        kv_mask = valid[:, None] & (dims[None, :] < HEAD_DIM)
        k = tl.load(k_cache_ptr + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, D_PAD]
        k = k.to(q.dtype)  # (a no-op unless the cache is FP8)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2e  # [M, BLOCK_N]
        see = valid[None, :]
        if CAUSAL:
            see = see & (pos[None, :] <= q_pos[:, None])
        s = tl.where(see, s, float("-inf"))
        # A program's first tile starts at a key every row sees (key 0 in prefill; a split's first key in
        # decode), so m_i is finite from then on and no row ever computes -inf - -inf.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)  # rescales what was accumulated under the old max
        p = tl.exp2(s - m_new[:, None])  # [M, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        return acc, m_new, l_i

    @triton.jit
    def _decode_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
        out_ptr, part_out_ptr, part_lse_ptr, scale_log2e, k_scale_ptr, v_scale_ptr,
        stride_qb, stride_qh, stride_ob, stride_oh, stride_kb, stride_kt, stride_kh, stride_bt,
        NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, REP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, REP_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
        KV_FP8: tl.constexpr,
    ):
        # Grid (B, Hkv, NUM_SPLITS). A program attends the REP query heads of one KV head (rows of a
        # [REP_PAD, D_PAD] tile, so each K/V tile is loaded once per group) over its split's share
        # of the context, in BLOCK_N-position tiles up to the sequence's own length.
        seq = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        ctx = tl.load(context_lens_ptr + seq)
        tiles_per_split = tl.cdiv(tl.cdiv(ctx, BLOCK_N), NUM_SPLITS)
        start = split * tiles_per_split * BLOCK_N
        end = tl.minimum(start + tiles_per_split * BLOCK_N, ctx)  # empty (end <= start) for late splits

        rows = tl.arange(0, REP_PAD)
        dims = tl.arange(0, D_PAD)
        heads = kv_head * REP + rows  # [REP_PAD] query heads of this group (rows >= REP are padding)
        q_mask = (rows < REP)[:, None] & (dims < HEAD_DIM)[None, :]
        q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :], mask=q_mask, other=0.0)
        v_scale = 1.0
        if KV_FP8:  # s = q . (k8 * k_scale) = (q . k8) * k_scale; sum p (v8 * v_scale) = (sum p v8) * v_scale
            scale_log2e = scale_log2e * tl.load(k_scale_ptr)
            v_scale = tl.load(v_scale_ptr)

        acc = tl.zeros([REP_PAD, D_PAD], dtype=tl.float32)
        m_i = tl.full([REP_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([REP_PAD], dtype=tl.float32)
        table_row = block_tables_ptr + seq * stride_bt
        for n0 in range(start, end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row, kv_head, n0, end, rows,
                stride_kb, stride_kt, stride_kh, scale_log2e, HEAD_DIM, BLOCK_SIZE, BLOCK_N, D_PAD, False,
            )
        o = acc * v_scale / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty split leaves zeros
        if NUM_SPLITS == 1:
            o_ptrs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :]
            tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=q_mask)
        else:
            # Partials: out [B, Hq, NUM_SPLITS, D_PAD] fp32 normalised per split; lse [B, Hq, NUM_SPLITS]
            # = m + log2(l) in log2 units, -inf for an empty split.
            part = (seq * NUM_Q_HEADS + heads) * NUM_SPLITS + split  # [REP_PAD]
            tl.store(part_out_ptr + part[:, None] * D_PAD + dims[None, :], o, mask=(rows < REP)[:, None])
            lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
            tl.store(part_lse_ptr + part, lse, mask=rows < REP)

    @triton.jit
    def _decode_reduce_kernel(
        part_out_ptr, part_lse_ptr, out_ptr, stride_ob, stride_oh,
        NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
    ):
        # Grid (B, Hq): merge the NUM_SPLITS partial softmaxes of one (sequence, query head).
        seq = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        splits = tl.arange(0, NUM_SPLITS)
        dims = tl.arange(0, D_PAD)
        part = (seq * NUM_Q_HEADS + head) * NUM_SPLITS + splits  # [NUM_SPLITS]
        lse = tl.load(part_lse_ptr + part)
        lse_max = tl.max(lse, 0)
        lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # all empty (no keys): zeros out
        w = tl.exp2(lse - lse_max)  # [NUM_SPLITS], 0 for empty splits
        o = tl.load(part_out_ptr + part[:, None] * D_PAD + dims[None, :])  # [NUM_SPLITS, D_PAD]
        den = tl.sum(w, 0)
        o = tl.sum(w[:, None] * o, 0) / tl.where(den > 0, den, 1.0)  # [D_PAD]
        tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims, o.to(out_ptr.dtype.element_ty),
                 mask=dims < HEAD_DIM)

    @triton.jit
    def _prefill_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr,
        scale_log2e, k_scale_ptr, v_scale_ptr, num_seqs,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_kt, stride_kh, stride_bt,
        HEAD_DIM: tl.constexpr, REP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, KV_FP8: tl.constexpr,
    ):
        # Grid (T // BLOCK_M + B, Hq): program p is query block p - start(s) of the sequence s with the
        # largest start(s) = cu_seqlens_q[s] // BLOCK_M + s <= p. start() grows by at least
        # cdiv(q_len, BLOCK_M) per sequence, so every query block has a program; the rest exit.
        pid = tl.program_id(0)
        head = tl.program_id(1)
        lo: tl.int32 = 0  # binary search for s over [0, num_seqs)
        hi: tl.int32 = num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            if tl.load(cu_seqlens_q_ptr + mid) // BLOCK_M + mid <= pid:
                lo = mid + 1
            else:
                hi = mid
        seq = lo - 1
        q_start = tl.load(cu_seqlens_q_ptr + seq)
        q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
        m0 = (pid - (q_start // BLOCK_M + seq)) * BLOCK_M  # first query of this block, within the sequence
        if m0 >= q_len:
            return
        k_len = tl.load(context_lens_ptr + seq)

        rows = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M] query index within the sequence
        dims = tl.arange(0, D_PAD)
        q_mask = (rows < q_len)[:, None] & (dims < HEAD_DIM)[None, :]
        tok = (q_start + rows).to(tl.int64)  # [BLOCK_M] row in the flat batch
        q = tl.load(q_ptr + tok[:, None] * stride_qt + head * stride_qh + dims[None, :], mask=q_mask, other=0.0)
        v_scale = 1.0
        if KV_FP8:  # the scales folded in, as in the decode kernel
            scale_log2e = scale_log2e * tl.load(k_scale_ptr)
            v_scale = tl.load(v_scale_ptr)
        q_pos = k_len - q_len + rows  # absolute positions; padding rows (>= q_len) see all keys harmlessly
        # Keys past this block's last query are masked for every row: stop there.
        kv_end = k_len - q_len + tl.minimum(m0 + BLOCK_M, q_len)

        acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
        for n0 in range(0, kv_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row, head // REP, n0, kv_end, q_pos,
                stride_kb, stride_kt, stride_kh, scale_log2e, HEAD_DIM, BLOCK_SIZE, BLOCK_N, D_PAD, True,
            )
        o = acc * v_scale / l_i[:, None]
        tl.store(out_ptr + tok[:, None] * stride_ot + head * stride_oh + dims[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=q_mask)


def _check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                 v_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Check the cache's layout; return the scale pointers to pass (any tensor when unused) and whether it is FP8."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    fp8 = is_fp8(k_cache)
    if fp8 and (k_scale is None or v_scale is None):
        raise ValueError("paged attention: an fp8 cache needs k_scale and v_scale")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("paged attention needs K and V caches of one layout, contiguous in head_dim")
    if q.shape[1] % k_cache.shape[2] or q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"query heads/dim {tuple(q.shape[1:])} do not fit a cache of shape {tuple(k_cache.shape)}")
    if fp8:
        assert k_scale is not None and v_scale is not None
        return k_scale, v_scale, True
    return q, q, False  # (not read)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def default_num_splits(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """KV splits for decode: enough (sequence, KV head, split) programs to fill the GPU, a power of two.

    Depends only on the batch shape, never on context lengths, so a CUDA graph stays valid.
    """
    programs = batch * num_kv_heads
    want = -(-2 * _num_sms(device) // programs)  # about two programs per SM
    return min(_MAX_SPLITS, triton.next_power_of_2(want)) if want > 1 else 1


def decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    splits: int,
    block_n: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    k_scale, v_scale, fp8 = _check_cache(q, k_cache, v_cache, k_scale, v_scale)
    if q.stride(-1) != 1:
        q = q.contiguous()
    batch, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    rep = num_heads // num_kv_heads
    if splits & (splits - 1):
        raise ValueError(f"num_splits={splits} must be a power of two")
    d_pad = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs dims >= 16
    out = q.new_empty(q.shape)  # contiguous [*, Hq, D]
    part_out = part_lse = out  # unused (NUM_SPLITS == 1) but must be tensors
    if splits > 1:
        part_out = torch.empty(batch, num_heads, splits, d_pad, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=q.device)
    _decode_kernel[(batch, num_kv_heads, splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse, scale * _LOG2E, k_scale, v_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        NUM_Q_HEADS=num_heads, HEAD_DIM=head_dim, REP=rep, BLOCK_SIZE=block_size, BLOCK_N=block_n,
        D_PAD=d_pad, REP_PAD=max(16, triton.next_power_of_2(rep)), NUM_SPLITS=splits, KV_FP8=fp8,
        num_warps=4 if d_pad <= 128 else 8,  # sm_90, head_dim 128: ~210 registers, no spills
    )
    if splits > 1:
        _decode_reduce_kernel[(batch, num_heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1),
            NUM_Q_HEADS=num_heads, HEAD_DIM=head_dim, D_PAD=d_pad, NUM_SPLITS=splits,
        )
    return out


def prefill_triton(
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
    # block_m / block_n of 0: the defaults (see paged_prefill_attention)
    k_scale, v_scale, fp8 = _check_cache(q, k_cache, v_cache, k_scale, v_scale)
    if q.stride(-1) != 1:
        q = q.contiguous()
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = context_lens.shape[0]
    d_pad = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs dims >= 16
    block_m = block_m or (64 if d_pad <= 128 else 32)  # (smaller tiles keep wide heads in registers)
    block_n = block_n or (64 if d_pad <= 128 else 32)
    out = q.new_empty(q.shape)  # contiguous [*, Hq, D]
    grid = (num_tokens // block_m + num_seqs, num_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, cu_seqlens_q, context_lens, scale * _LOG2E, k_scale, v_scale,
        num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        HEAD_DIM=head_dim, REP=num_heads // k_cache.shape[2], BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=block_m, BLOCK_N=block_n, D_PAD=d_pad, KV_FP8=fp8,
        num_warps=8,  # the gathered K/V addresses take registers: 4 warps spill at 64 x 64 x 128 on sm_90
    )
    return out
