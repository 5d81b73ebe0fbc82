"""Paged attention: flash-attn on CUDA when importable, a torch path otherwise.

Every step flattens its sequences into one token batch: sequence i
contributes ``q_lens[i]`` query tokens at the end of its ``k_lens[i]`` keys
(the keys before them are already in the paged cache: a cached prefix, earlier
prefill chunks, or earlier decode steps). The torch path covers every case the
flash-attn path covers: mixed prefill/decode, chunked prefill, cached prefixes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rtp.kernels.kv_store import store_kv

try:  # optional extra "gpu"
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
except ImportError:
    flash_attn_varlen_func = flash_attn_with_kvcache = None


FLASH_DTYPES = (torch.float16, torch.bfloat16)


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


class PagedAttention(nn.Module):
    """Causal attention over this rank's heads, reading keys/values from the paged cache."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        # Bound by the KV-cache allocator: [num_blocks, block_size, num_kv_heads, head_dim]
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.use_flash = False  # set by the runner, from use_flash_attn(), once for every layer

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D] -> [T, Hq, D]
        has_cache = meta.block_tables is not None and self.k_cache.numel() > 0
        if has_cache:
            store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        if self.use_flash:
            return self._flash(q, k, v, meta, has_cache)
        return self._torch(q, k, v, meta, has_cache)

    def _flash(self, q, k, v, meta: AttnMetadata, has_cache: bool) -> torch.Tensor:  # noqa: ANN001
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

    def _gather(self, cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
        # table: [num_blocks_of_seq] -> [length, Hkv, D]
        block_size = cache.shape[1]
        n = -(-length // block_size)
        return cache[table[:n].long()].flatten(0, 1)[:length]

    def _torch(self, q, k, v, meta: AttnMetadata, has_cache: bool) -> torch.Tensor:  # noqa: ANN001
        rep = self.num_heads // self.num_kv_heads
        if has_cache and meta.decode_only:
            return self._torch_decode(q, meta, rep)
        out = torch.empty_like(q)
        start = 0  # offset of sequence i's queries in the flat batch
        for i, (q_len, k_len) in enumerate(zip(meta.q_lens, meta.k_lens)):
            qi = q[start : start + q_len]  # [q_len, Hq, D]
            if has_cache:
                ki = self._gather(self.k_cache, meta.block_tables[i], k_len)
                vi = self._gather(self.v_cache, meta.block_tables[i], k_len)
            else:
                ki, vi = k[start : start + q_len], v[start : start + q_len]
            # Query j sits at absolute position k_len - q_len + j and sees keys <= it.
            q_pos = torch.arange(k_len - q_len, k_len, device=q.device).unsqueeze(1)
            mask = torch.arange(k_len, device=q.device).unsqueeze(0) <= q_pos  # [q_len, k_len]
            o = F.scaled_dot_product_attention(
                qi.transpose(0, 1),  # [Hq, q_len, D]
                ki.transpose(0, 1),  # [Hkv, k_len, D]: query head h reads KV head h // rep
                vi.transpose(0, 1),
                attn_mask=mask,
                scale=self.scale,
                enable_gqa=rep > 1,
            )
            out[start : start + q_len] = o.transpose(0, 1)
            start += q_len
        return out

    def _torch_decode(self, q: torch.Tensor, meta: AttnMetadata, rep: int) -> torch.Tensor:
        # One query per sequence: gather every sequence's blocks at once and mask by length.
        block_size = self.k_cache.shape[1]
        n_blocks = -(-meta.max_seqlen_k // block_size)
        table = meta.block_tables[:, :n_blocks].long()  # [B, n_blocks]
        k = self.k_cache[table].flatten(1, 2)  # [B, L, Hkv, D]
        v = self.v_cache[table].flatten(1, 2)
        pos = torch.arange(k.shape[1], device=q.device)
        mask = (pos.unsqueeze(0) < meta.context_lens.unsqueeze(1)).unsqueeze(1).unsqueeze(1)  # [B, 1, 1, L]
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [B, Hq, 1, D]
            k.transpose(1, 2),  # [B, Hkv, L, D]
            v.transpose(1, 2),
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=rep > 1,
        )
        return o.squeeze(2)
