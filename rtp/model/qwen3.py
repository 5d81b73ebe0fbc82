"""Qwen3ForCausalLM built from the tensor-parallel layers."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from rtp.distributed.parallel import ParallelState
from rtp.errors import ModelShapeError
from rtp.model.attention import AttnMetadata, PagedAttention
from rtp.model.embedding import ParallelLMHead, VocabParallelEmbedding
from rtp.model.linear import (
    PLAIN,
    GateUpParallelLinear,
    LinearBase,
    LinearMethod,
    QKVParallelLinear,
    RowParallelLinear,
    divide,
)
from rtp.model.moe import FusedMoE
from rtp.model.ops import RMSNorm, RotaryEmbedding, qk_norm_rope, rope_inv_freq, rope_parameters
from rtp.model.quant import QuantFormat, QuantLinearMethod
from rtp.model.split import check_attention_split

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def check_architecture(cfg, causal_lm: str) -> None:  # noqa: ANN001 - a transformers PretrainedConfig
    """Refuse a checkpoint whose ``architectures`` name another head than ``causal_lm`` (a sequence classifier
    of the same model_type has no LM head to serve); a config without the field is taken as it is."""
    names = list(getattr(cfg, "architectures", None) or [])
    if names and causal_lm not in names:
        raise ModelShapeError(f"architectures={names} is not supported: rtp serves the causal LM ({causal_lm!r})")


@dataclass(frozen=True)
class Qwen3Spec:
    """The shape of a Qwen3 checkpoint, read from its HF config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    attention_bias: bool
    max_context: int | None = field(default=None, kw_only=True)
    """The longest context the positions cover, where a static RoPE scaling stretches them (linear: its factor
    times max_position_embeddings; yarn: times its original_max_position_embeddings); None: not stretched."""

    @classmethod
    def from_hf(cls, cfg) -> Qwen3Spec:  # noqa: ANN001 - a transformers PretrainedConfig
        model_type = getattr(cfg, "model_type", None)
        if model_type != "qwen3":
            raise ModelShapeError(
                f"model_type={model_type!r} is not supported; rtp serves model_type 'qwen3' and 'qwen3_moe'"
            )
        check_architecture(cfg, "Qwen3ForCausalLM")
        return cls(**cls.common_fields(cfg))

    @staticmethod
    def common_fields(cfg) -> dict:  # noqa: ANN001 - a transformers PretrainedConfig
        """The fields dense Qwen3 and Qwen3-MoE share, read from an HF config."""
        heads = cfg.num_attention_heads
        return dict(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            rms_norm_eps=cfg.rms_norm_eps,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            max_position_embeddings=cfg.max_position_embeddings,
            attention_bias=bool(getattr(cfg, "attention_bias", False)),
            max_context=_stretched_context(cfg),
        )

    @property
    def context_limit(self) -> int:
        """Most tokens (prompt + completion) a sequence may hold: max_model_len's upper bound."""
        return self.max_context or self.max_position_embeddings

    def check_tp(self, tp: int) -> None:
        """Raise ModelShapeError, naming the numbers, if this model cannot be split ``tp`` ways."""
        self.check_attention_tp(tp)
        divide(self.intermediate_size, tp, "intermediate_size")

    def check_attention_tp(self, tp: int) -> None:
        """The attention part of :meth:`check_tp` (query heads and KV heads)."""
        check_attention_split(self.num_heads, self.num_kv_heads, tp)


def _stretched_context(cfg) -> int | None:  # noqa: ANN001 - a transformers PretrainedConfig
    """The context a static RoPE scaling of ``cfg`` covers (as vLLM derives it), or None without one."""
    kind, params = rope_parameters(cfg)
    factor = params.get("factor")
    if kind not in ("linear", "yarn") or not factor:
        return None
    base = params.get("original_max_position_embeddings") if kind == "yarn" else None
    return int((base or cfg.max_position_embeddings) * factor)


class Qwen3Attention(nn.Module):
    def __init__(self, spec: Qwen3Spec, ps: ParallelState, rotary: RotaryEmbedding,
                 method: LinearMethod = PLAIN) -> None:
        super().__init__()
        d = spec.head_dim
        self.qkv_proj = QKVParallelLinear(
            spec.hidden_size, d, spec.num_heads, spec.num_kv_heads, ps, spec.attention_bias, method
        )
        self.num_heads, self.num_kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, d
        self.o_proj = RowParallelLinear(spec.num_heads * d, spec.hidden_size, ps, spec.attention_bias, method)
        self.q_norm = RMSNorm(d, spec.rms_norm_eps)  # per-head norms: Qwen3's addition over Qwen2
        self.k_norm = RMSNorm(d, spec.rms_norm_eps)
        self.rotary = rotary
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, d**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        t, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        q, k = qk_norm_rope(positions, q.view(t, self.num_heads, d), k.view(t, self.num_kv_heads, d),
                            self.q_norm, self.k_norm, self.rotary)  # [T, Hq, D], [T, Hkv, D]
        o = self.attn(q, k, v.view(t, self.num_kv_heads, d), meta)  # [T, Hq, D]
        return self.o_proj(o.flatten(1))


class Qwen3MLP(nn.Module):
    def __init__(self, spec: Qwen3Spec, ps: ParallelState, method: LinearMethod = PLAIN) -> None:
        super().__init__()
        self.gate_up_proj = GateUpParallelLinear(spec.hidden_size, spec.intermediate_size, ps, method)
        self.down_proj = RowParallelLinear(spec.intermediate_size, spec.hidden_size, ps, method=method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.silu_mul(x))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, spec: Qwen3Spec, ps: ParallelState, rotary: RotaryEmbedding, mlp: nn.Module,
                 method: LinearMethod = PLAIN) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Qwen3Attention(spec, ps, rotary, method)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = mlp  # Qwen3MLP, or a sparse MoE block in Qwen3-MoE

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttnMetadata,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, hidden]``: the previous layer's MLP output, to add to the residual stream ``residual`` (None:
        ``x`` is the stream itself, as entering the first layer). Returns this layer's MLP output and the stream
        it is still to be added to: the adds are fused into the next norms (:meth:`RMSNorm.add`)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add(x, residual)
        h, residual = self.post_attention_layernorm.add(self.self_attn(positions, h, meta), residual)
        return self.mlp(h), residual


class OtherStage(nn.Module):
    """Stands in for a decoder layer another pipeline stage holds: no parameters, never called."""


class Qwen3Model(nn.Module):
    """The decoder stack, or with pipeline parallelism one stage's contiguous range of it.

    ``layers`` is the range this stage holds (all by default; the others are :class:`OtherStage`
    placeholders, so parameter names keep their checkpoint index). The first stage embeds the
    tokens; the last applies the final norm. A later stage takes the previous stage's hidden states.
    """

    def __init__(
        self, spec: Qwen3Spec, ps: ParallelState, rotary: RotaryEmbedding, make_mlp: Callable[[int], nn.Module],
        method: LinearMethod = PLAIN, layers: range | None = None,
    ) -> None:
        super().__init__()
        self.layer_range = range(spec.num_layers) if layers is None else layers
        self.first = self.layer_range.start == 0
        self.last = self.layer_range.stop == spec.num_layers
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, ps) if self.first else None
        self.layers = nn.ModuleList(Qwen3DecoderLayer(spec, ps, rotary, make_mlp(i), method)
                                    if i in self.layer_range else OtherStage() for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps) if self.last else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        # input_ids: [T]; hidden: [T, hidden] from the previous stage (later stages only)
        return self.run(input_ids, positions, meta, hidden)[0]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
            hidden: torch.Tensor | None = None,
            aux_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The final hidden states [T, hidden], and the residual stream entering each decoder layer of
        ``aux_layers`` ([T, hidden] each, in that order; Hugging Face's ``hidden_states[i]`` for layer i)."""
        if self.embed_tokens is not None:
            x = self.embed_tokens(input_ids)  # [T, hidden]
        else:
            assert hidden is not None, "a later pipeline stage needs the previous stage's hidden states"
            x = hidden
        layers = self.layers
        taken: dict[int, torch.Tensor] = {}
        residual = None  # the residual stream is residual + x (x alone before the first layer)
        for i in self.layer_range:
            if i in aux_layers:
                taken[i] = x if residual is None else residual + x
            x, residual = layers[i](positions, x, meta, residual)
        assert residual is not None, "a stage holds at least one layer"
        out = self.norm.add(x, residual)[0] if self.norm is not None else residual + x
        return out, [taken[i] for i in aux_layers]


class Qwen3ForCausalLM(nn.Module):
    """Each rank's slice of Qwen3. ``forward`` gives hidden states; ``compute_logits`` gathers on rank 0.

    ``layers``: with pipeline parallelism, the decoder layers this rank's stage holds (all by default);
    rank 0 alone then has the LM head, whole: it samples, from the last stage's final hidden states.

    ``quant``: the format of a quantized checkpoint (:mod:`rtp.model.quant`); the attention and
    MLP projections (and the experts) load its tensors and are dequantized once after loading (on CUDA: kept
    packed for the format's Triton GEMMs).
    Embeddings, the LM head, the norms and the MoE router are always plain.
    """

    # checkpoint name fragment -> (parameter name fragment, shard id)
    stacked = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, spec: Qwen3Spec, ps: ParallelState, hf_config, max_positions: int,  # noqa: ANN001
                 quant: QuantFormat | None = None, layers: range | None = None) -> None:
        super().__init__()
        spec.check_tp(ps.tp_size)
        self.spec = spec
        self.quant = quant
        self.linear_method: LinearMethod = PLAIN if quant is None else QuantLinearMethod(quant)
        inv_freq, scale = rope_inv_freq(hf_config, spec.head_dim)
        rotary = RotaryEmbedding(spec.head_dim, max_positions, inv_freq, scale)
        self.model = Qwen3Model(spec, ps, rotary, lambda i: self.make_mlp(i, ps), self.linear_method, layers)
        self.ps = ps
        self.lm_head: ParallelLMHead | None = None
        tied = spec.tie_word_embeddings
        if ps.pp_size == 1:
            self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, ps, tied=tied)
        elif ps.rank == 0:
            # Pipeline stages: rank 0 samples, so it holds the whole head (unsharded) and the last stage sends
            # it final hidden states, not logits. Tied, it is the embedding (gathered after loading if sharded).
            self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, ParallelState.single(ps.device),
                                          tied=tied)
        if self.lm_head is not None and tied and (ps.pp_size == 1 or ps.tp_size == 1):
            # The same vocab rows on this rank (without stages: the same shard; rank 0's whole head at TP=1).
            assert self.model.embed_tokens is not None, "the LM head is on the first stage"
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_mlp(self, layer: int, ps: ParallelState) -> nn.Module:
        """The feed-forward block of layer ``layer`` (Qwen3-MoE overrides this)."""
        return Qwen3MLP(self.spec, ps, self.linear_method)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, meta, hidden)

    def forward_aux(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
                    aux_layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """Final hidden states [T, hidden] and the auxiliary hidden states [T, len(aux_layers) * hidden]
        (the residual stream entering each of ``aux_layers``, concatenated) of the whole model."""
        hidden, aux = self.model.run(input_ids, positions, meta, None, aux_layers)
        return hidden, torch.cat(aux, dim=-1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        assert self.lm_head is not None, "with pipeline stages only rank 0 computes logits"
        return self.lm_head.compute_logits(hidden)

    def owns_layer(self, layer: int) -> bool:
        """Whether this rank's pipeline stage holds decoder layer ``layer``."""
        return layer in self.model.layer_range

    def owns_tensor(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` belongs to this rank's pipeline stage (always, without PP).

        A tensor of another stage is skipped by the loader, not reported as unexpected.
        """
        m = _LAYER.match(name)
        if m is not None:
            return self.owns_layer(int(m[1]))
        if name.startswith("model.embed_tokens."):
            return self.model.first
        if name.startswith("model.norm."):
            return self.model.last
        if name.startswith("lm_head."):
            return self.lm_head is not None
        return True

    def gather_tied_head(self) -> None:
        """Pipeline stages, tied embeddings, TP > 1 on the first stage: rank 0's whole LM head is the
        embedding's vocab shards gathered over the first stage's TP group (collective on that stage)."""
        ps, embed = self.ps, self.model.embed_tokens
        if ps.pp_size == 1 or not self.spec.tie_word_embeddings or ps.tp_size == 1 or embed is None:
            return
        parts = [torch.empty_like(embed.weight) for _ in range(ps.tp_size)]
        dist.all_gather(parts, embed.weight.data.contiguous(), group=ps.tp_group)  # [V_local, H] each
        if self.lm_head is not None:
            self.lm_head.weight.data.copy_(torch.cat(parts)[: self.spec.vocab_size])

    def attention_layers(self) -> list[PagedAttention]:
        return [m for m in self.modules() if isinstance(m, PagedAttention)]

    def checkpoint_shapes(self) -> dict[str, list[int]]:
        """Full (unsharded) shape of every tensor the checkpoint must hold; the linears' methods name theirs."""
        s, d = self.spec, self.spec.head_dim
        shapes = {"model.embed_tokens.weight": [s.vocab_size, s.hidden_size], "model.norm.weight": [s.hidden_size]}
        shapes = {k: v for k, v in shapes.items() if self.owns_tensor(k)}
        for i in self.model.layer_range:
            p = f"model.layers.{i}."
            shapes |= {
                p + "input_layernorm.weight": [s.hidden_size],
                p + "post_attention_layernorm.weight": [s.hidden_size],
                p + "self_attn.q_norm.weight": [d],
                p + "self_attn.k_norm.weight": [d],
            }
        fused: dict[str, list[tuple[str, object]]] = {}  # module name fragment -> [(checkpoint fragment, shard)]
        for frag, (target, shard) in self.stacked.items():
            fused.setdefault(target, []).append((frag, shard))
        for name, module in self.named_modules():
            if isinstance(module, LinearBase):
                parent, _, leaf = name.rpartition(".")
                stem = f"{parent}." if parent else ""
                prefixes = {shard: stem + frag for frag, shard in fused.get(leaf, [])} or {None: name}
                shapes |= module.checkpoint_tensors(prefixes)
        return shapes

    def optional_checkpoint_shapes(self) -> dict[str, list[int]]:
        """Tensors a checkpoint may hold, each keeping its default where it does not: the FP8 KV cache's
        per-layer scales ``self_attn.k_scale`` / ``v_scale`` (one float each; 1.0 by default), the names FP8
        checkpoints (vLLM's, llm-compressor's) use."""
        return {f"model.layers.{i}.self_attn.{n}": [] for i in self.model.layer_range for n in ("k_scale", "v_scale")}

    def process_weights_after_loading(self) -> None:
        """Once every tensor is loaded: dequantize the projections of a quantized checkpoint (else nothing)."""
        for module in self.modules():
            if isinstance(module, LinearBase):
                module.method.process_weights_after_loading(module)
            elif isinstance(module, FusedMoE):
                module.process_weights_after_loading()

    def param_for(self, name: str) -> tuple[str, object]:
        """Map a checkpoint tensor name to (parameter name, shard id)."""
        if name.endswith((".self_attn.k_scale", ".self_attn.v_scale")):  # the scales live on the attention core
            return name.replace(".self_attn.", ".self_attn.attn."), None
        for frag, (target, shard) in self.stacked.items():
            if f".{frag}." in name:
                return name.replace(f".{frag}.", f".{target}."), shard
        return name, None
