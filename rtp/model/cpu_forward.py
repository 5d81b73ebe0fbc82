"""The model's forward on CPU as the layers' C++ kernels called directly: the CPU's counterpart of CUDA graphs.

Through the modules, a dense Qwen3 layer on CPU is ten C++ kernel calls with Python between them: nine
``nn.Module`` calls, attribute lookups, each op's dispatch checks, the linear method's and the attention
backend's branches. Inside a real ``generate()`` (the kernels keep the caches busy, so that Python runs cold)
this came to ~60 us a layer: run step by step alternately with and without the bound calls in one
``generate()``, the model's decode forward took 1.16x as long through the modules on the 40M benchmark model
(24 requests, fp32) and 1.09x at Qwen3-0.6B's dimensions (8 requests, bf16). Steps of a few tokens per
sequence (speculative verification, a draft's catch-up) pay the same per layer; prompt steps hardly notice.

:class:`CpuForward` binds every layer's kernels, weights and shapes once; a step is then those calls alone (the
decode attention kernel for one token per sequence, the varlen one otherwise), on the arguments the modules
would pass, so the hidden states are the modules' bit for bit. It serves only where the modules would run
exactly these kernels (:func:`unsupported` says why not elsewhere): the C++ layer ops and attention built, the
C++ attention backend (a cache in the compute dtype), dense layers whose linears are unbiased and have a bound
kernel call (:meth:`rtp.model.linear.LinearMethod.bound`: rtp's panel GEMM, oneDNN's packed linear, the int8
weight-only kernels), norm weights in the compute dtype, no pipeline stages. Tensor parallelism takes the same
all-reduces as the row-parallel layers.
"""

from __future__ import annotations

from typing import Any

import torch

from rtp.distributed.parallel import ParallelState
from rtp.kernels import cpu_attention, cpu_ops
from rtp.log import get_logger
from rtp.model.attention import AttnMetadata
from rtp.model.linear import LinearBase
from rtp.model.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM, Qwen3MLP

logger = get_logger(__name__)


def unsupported(model: Qwen3ForCausalLM, ps: ParallelState) -> str | None:
    """Why ``model``'s forward cannot run as bound kernel calls here, or None when it can."""
    if ps.device.type != "cpu" or ps.pp_size > 1:
        return "not a CPU model without pipeline stages"
    if cpu_ops.load() is None or cpu_attention.load() is None:
        return "the C++ CPU kernels did not build"
    inner = model.model
    if inner.embed_tokens is None or inner.norm is None:
        return "the model is a pipeline stage"
    dtype = inner.embed_tokens.weight.dtype
    for layer in inner.layers:
        if not isinstance(layer, Qwen3DecoderLayer) or not isinstance(layer.mlp, Qwen3MLP):
            return "a layer is not a dense Qwen3 layer"
        a = layer.self_attn
        gate_up = layer.mlp.gate_up_proj
        linears: tuple[LinearBase, ...] = (a.qkv_proj, a.o_proj, layer.mlp.down_proj)
        bound = {lin: lin.method.bound(lin) for lin in linears}
        bound[gate_up] = gate_up.method.bound_silu_mul(gate_up)
        if any(lin.bias is not None for lin in bound):
            return "a linear has a bias"
        unbound = [type(lin.method).__name__ for lin, call in bound.items() if call is None]
        if unbound:
            return f"a linear's method has no bound kernel call ({unbound[0]})"
        if a.attn.backend != "cpu" or a.attn.k_cache.dtype != dtype:
            return "the attention is not the C++ backend over a cache in the compute dtype"
        norms = (layer.input_layernorm, layer.post_attention_layernorm, a.q_norm, a.k_norm)
        if any(n.weight.dtype != dtype for n in norms):
            return "a norm's weight is not in the compute dtype"
        if a.q_norm.eps != a.k_norm.eps:
            return "the q and k norms have different epsilons"
        if a.rotary.cos.dtype != torch.float32:
            return "the rotary tables are not float32"
    return None


def bind_cpu_forward(model: Qwen3ForCausalLM, ps: ParallelState, what: str) -> CpuForward | None:
    """``model``'s :class:`CpuForward` where it serves; else None (on CPU rank 0 logs why, naming ``what``)."""
    if ps.device.type != "cpu":
        return None
    why_not = unsupported(model, ps)
    if why_not is None:
        return CpuForward(model, ps)
    if ps.rank == 0:
        logger.info("%s run through the modules: %s", what, why_not)
    return None


class CpuForward:
    """A model's forward as bound C++ kernel calls (build only where :func:`unsupported` is None)."""

    def __init__(self, model: Qwen3ForCausalLM, ps: ParallelState) -> None:
        inner = model.model
        assert inner.embed_tokens is not None and inner.norm is not None, "checked by unsupported()"
        self.embed, self.norm, self.reduce = inner.embed_tokens, inner.norm, ps.all_reduce
        ops, attention = cpu_ops.load(), cpu_attention.load()
        assert ops is not None and attention is not None, "checked by unsupported()"
        self.ops = ops
        self.decode, self.varlen = attention.paged_decode, attention.paged_prefill
        layers = [layer for layer in inner.layers if isinstance(layer, Qwen3DecoderLayer)]
        self.layers = [self._bind(layer) for layer in layers]
        self.varlen_decode = any(layer.self_attn.attn.varlen_decode for layer in layers)  # see PagedAttention

    @staticmethod
    def _bind(layer: Qwen3DecoderLayer) -> tuple[Any, ...]:
        a, mlp = layer.self_attn, layer.mlp
        assert isinstance(mlp, Qwen3MLP), "checked by unsupported()"
        d, hq, hk = a.head_dim, a.num_heads, a.num_kv_heads
        qkv, o, gate_up, down = a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj
        return (layer.input_layernorm.weight, layer.post_attention_layernorm.weight, layer.input_layernorm.eps,
                qkv.method.bound(qkv), [hq * d, hk * d, hk * d], hq, hk, d,
                a.q_norm.weight, a.k_norm.weight, a.q_norm.eps, a.rotary.cos, a.rotary.sin, a.attn,
                o.method.bound(o), gate_up.method.bound_silu_mul(gate_up), down.method.bound(down))

    def run(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` of a step's tokens ``ids [T]`` at positions ``pos [T]``, as the
        model's forward computes them (the step's keys and values stored in the cache)."""
        ops, reduce = self.ops, self.reduce
        slots, tables, lens, t = meta.slot_mapping, meta.block_tables, meta.context_lens, ids.shape[0]
        # varlen attention unless one token a sequence (and the decode kernel allowed)
        cu_q = None if meta.decode_only and not self.varlen_decode else meta.cu_seqlens_q
        decode, varlen = self.decode, self.varlen
        x = self.embed(ids)  # [T, hidden]
        residual = None
        for (w_in, w_post, eps, qkv, sizes, hq, hk, d, qw, kw, qk_eps, cos, sin, attn,
             o_proj, silu_gate_up, down) in self.layers:
            # The decoder layer's forward (rtp.model.qwen3), each module's C++ kernel called directly.
            if residual is None:
                h, residual = ops.rms_norm(x, w_in, eps), x
            else:
                h, residual = ops.add_rms_norm(x, residual, w_in, eps)
            q, k, v = qkv(h).split_with_sizes(sizes, -1)
            q, k = ops.qk_norm_rope(q.view(t, hq, d), k.view(t, hk, d), qw, kw, cos, sin, pos, qk_eps)
            ops.store_kv(k, v.view(t, hk, d), attn.k_cache, attn.v_cache, slots)
            if cu_q is None:
                o = decode(q, attn.k_cache, attn.v_cache, tables, lens, attn.scale)  # [T, Hq, D]
            else:
                o = varlen(q, attn.k_cache, attn.v_cache, tables, cu_q, lens, attn.scale)
            o = reduce(o_proj(o.flatten(1)))  # [T, hidden]
            h, residual = ops.add_rms_norm(o, residual, w_post, eps)
            x = reduce(down(silu_gate_up(h)))
        return ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[0]
