"""Qwen3MoeForCausalLM: dense Qwen3 with sparse mixture-of-experts feed-forward layers.

Attention, norms, embeddings, the LM head and the loader are dense Qwen3's. A
layer is sparse unless it is listed in ``mlp_only_layers`` or
``(layer + 1) % decoder_sparse_step != 0`` (HF's rule); dense layers use a plain
Qwen3 MLP of ``intermediate_size``.

The checkpoint stores one tensor per expert
(``model.layers.L.mlp.experts.E.gate_proj.weight``, ...); the loader slices each
for this rank and packs it into the layer's stacked ``w13_weight``/``w2_weight``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from rtp.distributed.parallel import ParallelState
from rtp.errors import ModelShapeError
from rtp.model.linear import divide
from rtp.model.moe import SparseMoeBlock
from rtp.model.quant import QuantFormat
from rtp.model.qwen3 import Qwen3ForCausalLM, Qwen3MLP, Qwen3Spec, check_architecture

# model.layers.L.mlp.experts.E.{gate,up,down}_proj.{weight, or a quantized format's weight_scale_inv, qweight, ...}
_EXPERT = re.compile(
    r"^(?P<prefix>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.(?P<suffix>[a-z_]+)$"
)


@dataclass(frozen=True)
class Qwen3MoeSpec(Qwen3Spec):
    """The shape of a Qwen3-MoE checkpoint, read from its HF config."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]  # layer indices with a MoE block; the others are dense

    @classmethod
    def from_hf(cls, cfg) -> Qwen3MoeSpec:  # noqa: ANN001 - a transformers PretrainedConfig
        model_type = getattr(cfg, "model_type", None)
        if model_type != "qwen3_moe":
            raise ModelShapeError(f"model_type={model_type!r} is not Qwen3-MoE (expected 'qwen3_moe')")
        check_architecture(cfg, "Qwen3MoeForCausalLM")
        # Published checkpoints say num_experts; current transformers stores num_local_experts.
        num_experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
        if not num_experts:
            raise ModelShapeError("the Qwen3-MoE config has neither num_experts nor num_local_experts")
        top_k = cfg.num_experts_per_tok
        if not 1 <= top_k <= num_experts:
            raise ModelShapeError(f"num_experts_per_tok={top_k} must be between 1 and num_experts={num_experts}")
        step = getattr(cfg, "decoder_sparse_step", 1) or 1
        dense = set(getattr(cfg, "mlp_only_layers", None) or [])
        sparse = tuple(i for i in range(cfg.num_hidden_layers) if i not in dense and (i + 1) % step == 0)
        return cls(
            **cls.common_fields(cfg),
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=cfg.moe_intermediate_size,
            norm_topk_prob=bool(getattr(cfg, "norm_topk_prob", False)),
            sparse_layers=sparse,
        )

    @property
    def has_dense_layers(self) -> bool:
        return len(self.sparse_layers) < self.num_layers

    def check_tp(self, tp: int, expert_parallel: bool = False) -> None:
        """Raise ModelShapeError, naming the numbers, if this model cannot be split ``tp`` ways."""
        self.check_attention_tp(tp)
        if self.has_dense_layers:
            divide(self.intermediate_size, tp, "intermediate_size")
        if expert_parallel:
            divide(self.num_experts, tp, "num_experts")
        else:
            divide(self.moe_intermediate_size, tp, "moe_intermediate_size")


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Each rank's slice of Qwen3-MoE; experts tensor-parallel, or expert-parallel on request."""

    def __init__(
        self,
        spec: Qwen3MoeSpec,
        ps: ParallelState,
        hf_config,  # noqa: ANN001
        max_positions: int,
        expert_parallel: bool = False,
        quant: QuantFormat | None = None,
        layers: range | None = None,
    ) -> None:
        spec.check_tp(ps.tp_size, expert_parallel)
        self.moe_spec = spec  # the base class keeps it as ``spec`` with the dense type
        self.expert_parallel = expert_parallel  # read by make_mlp during the base constructor
        super().__init__(spec, ps, hf_config, max_positions, quant, layers)

    def make_mlp(self, layer: int, ps: ParallelState) -> nn.Module:
        s = self.moe_spec
        if layer not in s.sparse_layers:
            return Qwen3MLP(s, ps, self.linear_method)
        return SparseMoeBlock(
            s.hidden_size, s.moe_intermediate_size, s.num_experts, s.num_experts_per_tok, s.norm_topk_prob,
            ps, self.expert_parallel, self.quant,
        )

    def checkpoint_shapes(self) -> dict[str, list[int]]:
        """Full (unsharded) shape of every tensor the checkpoint must hold."""
        s = self.moe_spec
        shapes = super().checkpoint_shapes()
        h, mi = s.hidden_size, s.moe_intermediate_size
        for i in filter(self.owns_layer, s.sparse_layers):  # the router (gate) is a linear: listed by the base
            p = f"model.layers.{i}.mlp."
            for e in range(s.num_experts):
                q = f"{p}experts.{e}."
                # The projections' tensors as the linear method names them (weight, or a format's tensors).
                for proj, n, k in (("gate_proj", mi, h), ("up_proj", mi, h), ("down_proj", h, mi)):
                    shapes |= self.linear_method.checkpoint_tensors(q + proj, n, k)
        return shapes

    def param_for(self, name: str) -> tuple[str, object]:
        """Map a checkpoint tensor name to (parameter name, shard id); experts go to the stacked weights."""
        m = _EXPERT.match(name)
        if m is None:
            return super().param_for(name)
        expert, proj, suffix = int(m["expert"]), m["proj"], m["suffix"]
        if proj == "down":
            return f"{m['prefix']}.w2_{suffix}", (expert, None)
        return f"{m['prefix']}.w13_{suffix}", (expert, 0 if proj == "gate" else 1)
