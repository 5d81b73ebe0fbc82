"""Mixture-of-experts layers: the router and the tensor- (or expert-) parallel experts.

Tensor parallelism (the default): every rank holds every expert, each one's
gate/up projections column-sharded (``moe_intermediate_size / tp`` rows) and its
down projection row-sharded, exactly like a dense MLP. Each rank's output is a
partial sum; one all-reduce per MoE layer completes it.

Expert parallelism (``expert_parallel=True``): rank r holds whole experts
``[r * E / tp, (r + 1) * E / tp)``. The router is replicated, so every rank
knows every token's experts; each computes the contributions of its own experts
and the same single all-reduce adds them up. Useful when experts far outnumber
ranks and the per-expert slices of TP would be too thin for good GEMMs.
"""

from __future__ import annotations

import torch
from torch import nn

from rtp.distributed.parallel import ParallelState
from rtp.kernels.fused_moe import Fp8Experts, fused_moe, fused_moe_fp8
from rtp.model.linear import PLAIN, LinearBase, _copy, divide, frozen_param, load_full
from rtp.model.quant.base import QuantFormat, dequantize_experts, expert_buffers, pack_experts
from rtp.model.quant.fp8 import Fp8Packed


class MoERouter(LinearBase):
    """The gate: a replicated ``[num_experts, hidden]`` linear, softmax, top-k (HF Qwen3-MoE semantics)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.method = PLAIN
        self.full_shapes = {None: (num_experts, hidden)}
        self.method.create_weights(self, num_experts, hidden, load_full)  # loaded in full on every rank
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [T, H] -> weights [T, k] (x's dtype), expert ids [T, k] (int64)
        logits = self.matmul(x)  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # softmax in fp32, as HF does
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids


class FusedMoE(nn.Module):
    """Stacked expert weights of one layer and their forward (torch path on CPU, Triton on CUDA).

    ``w13_weight [E_local, 2 * I_local, H]`` holds each local expert's gate rows then up rows;
    ``w2_weight [E_local, H, I_local]`` its down projection. TP: ``E_local = E``,
    ``I_local = I / tp``. EP: ``E_local = E / tp``, ``I_local = I``.

    ``quant``: a quantized checkpoint's format. Its tensors (``w13_weight_scale_inv``, ``w2_qweight``,
    ...) load into stacks of the same shapes through dense views, sliced like the plain weights,
    and become ``w13_weight``/``w2_weight`` in :meth:`process_weights_after_loading`. FP8 experts on
    CUDA stay FP8 instead (``fp8``: :class:`~rtp.kernels.fused_moe.Fp8Experts`, the fused kernels'
    FP8 path); other packed formats have no expert kernel and are dequantized.
    """

    fp8: Fp8Experts | None = None
    packed = False  # whether the quantized experts load to stay packed (set with quant)

    def __init__(
        self, num_experts: int, hidden: int, inter: int, ps: ParallelState, expert_parallel: bool = False,
        quant: QuantFormat | None = None,
    ) -> None:
        super().__init__()
        self.ps, self.num_experts, self.expert_parallel = ps, num_experts, expert_parallel
        if expert_parallel:
            self.num_local = divide(num_experts, ps.tp_size, "num_experts")
            self.inter_local = inter
            self.expert_start = ps.tp_rank * self.num_local
        else:
            self.num_local = num_experts
            self.inter_local = divide(inter, ps.tp_size, "moe_intermediate_size")
            self.expert_start = 0
        e, i = self.num_local, self.inter_local
        self.quant, self.compute_dtype = quant, torch.get_default_dtype()
        if quant is None:
            self.w13_weight = frozen_param(torch.empty(e, 2 * i, hidden), self.weight_loader)
            self.w2_weight = frozen_param(torch.empty(e, hidden, i), self.weight_loader)
            return
        quant.check_shape("expert gate/up projection", inter, hidden)
        quant.check_shape("expert down projection", hidden, inter)
        self.packed = quant.packs_on(torch.get_default_device())
        # Full [N, K] of the checkpoint projection behind a shard id (expert, 0 gate | 1 up | None down).
        expert_buffers(self, quant, "w13", (e, 2 * i, hidden), self.weight_loader, lambda shard: (inter, hidden),
                       self.packed)
        expert_buffers(self, quant, "w2", (e, hidden, i), self.weight_loader, lambda shard: (hidden, inter),
                       self.packed)

    def process_weights_after_loading(self) -> None:
        """A quantized checkpoint's stacks dequantized into ``w13_weight``/``w2_weight``, or kept FP8 (``fp8``)."""
        quant, dtype = self.quant, self.compute_dtype
        if quant is None:
            return
        self.quant = None
        if self.packed:
            w13, w2 = pack_experts(self, quant, "w13", dtype), pack_experts(self, quant, "w2", dtype)
            if isinstance(w13, Fp8Packed) and isinstance(w2, Fp8Packed):
                self.fp8 = Fp8Experts(w13.weight, w13.scale, w2.weight, w2.scale, w2.k_offset, w2.w8a8)
                return
            if not (isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor)):
                raise TypeError(f"{quant.name} experts packed without an expert kernel")
        else:
            w13, w2 = dequantize_experts(self, quant, "w13", dtype), dequantize_experts(self, quant, "w2", dtype)
        self.w13_weight = frozen_param(w13, self.weight_loader)
        self.w2_weight = frozen_param(w2, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, source, shard_id: tuple[int, int | None]) -> None:  # noqa: ANN001
        """Copy this rank's part of one expert's projection; ``shard_id = (expert, 0 gate | 1 up | None down)``."""
        expert, half = shard_id
        local = expert - self.expert_start
        if not 0 <= local < self.num_local:
            return  # EP: another rank's expert; nothing of it is read here
        i = self.inter_local
        # EP keeps whole experts (start 0); TP takes rank r's rows/columns of the intermediate dim.
        start = 0 if self.expert_parallel else self.ps.tp_rank * i
        if half is None:  # down_proj [H, I]: columns
            _copy(param.data[local], source[:, start : start + i])
        else:  # gate_proj / up_proj [I, H]: rows, into the gate or the up half
            _copy(param.data[local, half * i : (half + 1) * i], source[start : start + i])

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        # x: [T, H]; topk_*: [T, k] -> [T, H], summed over the ranks
        if self.expert_parallel:
            local = topk_ids - self.expert_start
            # Experts of other ranks become id E_local, which the kernels skip.
            topk_ids = torch.where((local >= 0) & (local < self.num_local), local, self.num_local)
        if self.fp8 is not None:
            out = fused_moe_fp8(x, self.fp8, topk_weights, topk_ids)
        else:
            out = fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        return self.ps.all_reduce(out)


class SparseMoeBlock(nn.Module):
    """Router + experts: the feed-forward of a Qwen3-MoE sparse layer (``mlp.gate``, ``mlp.experts``)."""

    def __init__(
        self,
        hidden: int,
        inter: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        ps: ParallelState,
        expert_parallel: bool = False,
        quant: QuantFormat | None = None,
    ) -> None:
        super().__init__()
        self.gate = MoERouter(hidden, num_experts, top_k, norm_topk_prob)  # plain in quantized checkpoints too
        self.experts = FusedMoE(num_experts, hidden, inter, ps, expert_parallel, quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)  # [T, k] each
        return self.experts(x, weights, ids)
