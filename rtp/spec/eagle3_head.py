"""EAGLE-3 draft heads: the two published checkpoint formats, their start-up checks, and the head itself.

The head is one Llama-style decoder layer that reads two things per position ``p``: the embedding of
the token at ``p + 1`` and a feature ``g_p`` of width H. For positions the target has computed,
``g_p = fc(aux_p)``: ``aux_p`` is the target's residual stream entering decoder layers (2, L/2, L-3)
at ``p`` (or the config's ``eagle_aux_hidden_state_layer_ids``), concatenated ([3 * H_target]).
Past them, ``g_p`` is the head's own output at ``p - 1`` (before its final norm). The layer::

    r   = g                      (norm_before_residual: r = hidden_norm(g))
    x   = [input_layernorm(embed), hidden_norm(g)]        # [2H]: the attention's input
    r   = r + o_proj(attention(x))                        # rotary positions, causal, its own KV cache
    out = r + mlp(post_attention_layernorm(r))            # the next position's feature
    logits over the draft vocabulary = lm_head(norm(out)); target id = draft id + d2t[draft id]

Formats (tensor names without a ``model.`` prefix):

- SpecForge: ``config.json`` is a Llama config with ``architectures: ["LlamaForCausalLMEagle3"]``,
  ``draft_vocab_size`` and optionally ``eagle_config.eagle_aux_hidden_state_layer_ids``; tensors ``fc.weight``
  [H, 3 H_target], ``midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}.weight``,
  ``midlayer.self_attn.{q,k,v,o}_proj.weight`` (q, k, v read 2H), ``midlayer.mlp.{gate,up,down}_proj.weight``,
  ``norm.weight``, ``lm_head.weight`` [draft vocab, H], ``d2t`` [draft vocab] and ``t2d`` [vocab] (unused
  here), and ``embed_tokens.weight`` [vocab, H] when the head does not share the target's embedding.
- speculators: ``config.json`` has ``speculators_model_type: "eagle3"``, ``speculators_config``, the Llama
  ``transformer_layer_config``, ``draft_vocab_size``, ``norm_before_residual`` and ``target_hidden_size``;
  the same tensors with the layer under ``layers.0.`` and a bias on ``fc``.

A head that does not fit the target (another vocabulary, another hidden size, an auxiliary layer the
target lacks) or lacks a tensor fails at start with one :class:`ConfigError` line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from rtp.distributed.parallel import ParallelState
from rtp.errors import ConfigError
from rtp.kernels import cpu_gemm
from rtp.model.attention import AttnMetadata, PagedAttention
from rtp.model.linear import ColumnParallelLinear, cpu_linear_method, pack_linear_weights
from rtp.model.ops import RMSNorm, RotaryEmbedding, SiluAndMul, rope_inv_freq

if TYPE_CHECKING:
    from transformers import LlamaConfig

_KEY = "speculative_config.model"
SPECFORGE_ARCH = "LlamaForCausalLMEagle3"


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """The layers EAGLE-3 heads read by default: (2, L/2, L-3), as SpecForge trains and vLLM serves them."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class HeadSpec:
    """An EAGLE-3 head's shape, from its config.json (either format)."""

    folder: Path
    format: str  # "specforge" or "speculators"
    layer_config: LlamaConfig  # the decoder layer's Llama config (RoPE, sizes)
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    attention_bias: bool
    vocab_size: int  # the target vocabulary the head maps into
    draft_vocab_size: int
    target_hidden_size: int
    norm_before_residual: bool
    aux_layers: tuple[int, ...] | None  # None: the default for the target's depth

    @property
    def layer_prefix(self) -> str:
        return "midlayer." if self.format == "specforge" else "layers.0."

    @classmethod
    def read(cls, folder: Path) -> HeadSpec:
        what = f"{_KEY}={str(folder)!r}"
        try:
            cfg = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{what}: cannot read an EAGLE-3 head's config.json there ({e})") from None
        if not isinstance(cfg, dict):
            raise ConfigError(f"{what}: config.json is not a JSON object")
        if cfg.get("speculators_model_type") == "eagle3":
            fmt, layer = "speculators", cfg.get("transformer_layer_config")
            if not isinstance(layer, dict):
                raise ConfigError(f"{what}: a speculators config without a transformer_layer_config mapping")
        elif SPECFORGE_ARCH in (cfg.get("architectures") or []):
            fmt, layer = "specforge", cfg
        else:
            raise ConfigError(f"{what} is not an EAGLE-3 head: expected architectures [{SPECFORGE_ARCH!r}] "
                              "(SpecForge) or speculators_model_type 'eagle3' (speculators)")
        eagle = cfg.get("eagle_config") or {}
        aux = eagle.get("eagle_aux_hidden_state_layer_ids", cfg.get("eagle_aux_hidden_state_layer_ids"))
        try:
            known = {k: v for k, v in layer.items() if k not in ("architectures", "eagle_config")}
            # Imported here, not with this module: every rank imports it, and LlamaConfig pulls in
            # transformers' model-loading stack (about a second of each rank's start-up).
            from transformers import LlamaConfig

            llama = LlamaConfig(**known)
            hidden, heads = int(layer["hidden_size"]), int(layer["num_attention_heads"])
            vocab = int(layer["vocab_size"])
            spec = cls(
                folder=folder, format=fmt, layer_config=llama, hidden_size=hidden, num_heads=heads,
                num_kv_heads=int(layer.get("num_key_value_heads") or heads),
                head_dim=int(layer.get("head_dim") or hidden // heads),
                intermediate_size=int(layer["intermediate_size"]), rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
                attention_bias=bool(layer.get("attention_bias", False)), vocab_size=vocab,
                draft_vocab_size=int(cfg.get("draft_vocab_size") or vocab),
                target_hidden_size=int(cfg.get("target_hidden_size") or hidden),
                norm_before_residual=bool(cfg.get("norm_before_residual", False)),
                aux_layers=None if aux is None else tuple(int(i) for i in aux),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{what}: config.json lacks or mistypes a setting of an EAGLE-3 head ({e!r})") from None
        return spec

    def tensor_shapes(self, num_aux: int, with_embed: bool, fc_bias: bool) -> dict[str, list[int]]:
        """Every tensor the checkpoint must hold, with its shape."""
        h, p, d = self.hidden_size, self.layer_prefix, self.head_dim
        q, kv, i = self.num_heads * d, self.num_kv_heads * d, self.intermediate_size
        shapes = {
            "fc.weight": [h, num_aux * self.target_hidden_size], "norm.weight": [h],
            "lm_head.weight": [self.draft_vocab_size, h],
            p + "input_layernorm.weight": [h], p + "hidden_norm.weight": [h],
            p + "post_attention_layernorm.weight": [h],
            p + "self_attn.q_proj.weight": [q, 2 * h], p + "self_attn.k_proj.weight": [kv, 2 * h],
            p + "self_attn.v_proj.weight": [kv, 2 * h], p + "self_attn.o_proj.weight": [h, q],
            p + "mlp.gate_proj.weight": [i, h], p + "mlp.up_proj.weight": [i, h], p + "mlp.down_proj.weight": [h, i],
        }
        if self.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": [q], p + "self_attn.k_proj.bias": [kv],
                       p + "self_attn.v_proj.bias": [kv], p + "self_attn.o_proj.bias": [h]}
        if fc_bias:
            shapes["fc.bias"] = [h]
        if self.draft_vocab_size != self.vocab_size:
            shapes["d2t"] = [self.draft_vocab_size]
        if with_embed:
            shapes["embed_tokens.weight"] = [self.vocab_size, h]
        return shapes


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the head's checkpoint (``*.safetensors``, else ``pytorch_model.bin``), names without a
    ``model.`` prefix."""
    files = sorted(folder.glob("*.safetensors"))
    out: dict[str, torch.Tensor] = {}
    if files:
        from safetensors.torch import load_file

        for f in files:
            out |= load_file(str(f))
    elif (folder / "pytorch_model.bin").is_file():
        out = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ConfigError(f"{_KEY}={str(folder)!r} holds no *.safetensors or pytorch_model.bin")
    return {k.removeprefix("model."): v for k, v in out.items()}


@dataclass
class Eagle3Checkpoint:
    """A head's spec and tensors, checked against the target (:meth:`open`)."""

    spec: HeadSpec
    tensors: dict[str, torch.Tensor]
    aux_layers: tuple[int, ...]

    @classmethod
    def open(cls, folder: Path, target_cfg: dict[str, Any]) -> Eagle3Checkpoint:
        """Read the head in ``folder`` and check it fits the target whose config.json is ``target_cfg``."""
        spec = HeadSpec.read(folder)
        what = f"{_KEY}={str(folder)!r}"
        vocab, hidden = int(target_cfg["vocab_size"]), int(target_cfg["hidden_size"])
        layers = int(target_cfg["num_hidden_layers"])
        if spec.vocab_size != vocab:
            raise ConfigError(f"{what} has vocab_size={spec.vocab_size}, the target {vocab}: an EAGLE-3 head "
                              "must map into the target's vocabulary")
        if spec.target_hidden_size != hidden:
            raise ConfigError(f"{what} reads hidden states of size {spec.target_hidden_size}, the target's are "
                              f"{hidden}")
        aux = spec.aux_layers if spec.aux_layers is not None else default_aux_layers(layers)
        bad = [i for i in aux if not 0 <= i < layers]
        if bad:
            raise ConfigError(f"{what} reads the hidden states of layer {bad[0]}, the target has {layers} layers "
                              "(set eagle_config.eagle_aux_hidden_state_layer_ids)")
        tensors = read_tensors(folder)
        with_embed = "embed_tokens.weight" in tensors
        if not with_embed and spec.hidden_size != hidden:
            raise ConfigError(f"{what} has hidden_size={spec.hidden_size} and no embed_tokens.weight: sharing the "
                              f"target's embedding needs the target's hidden size {hidden}")
        for name, shape in spec.tensor_shapes(len(aux), with_embed, "fc.bias" in tensors).items():
            if name not in tensors:
                raise ConfigError(f"{what} lacks the tensor {name!r} of a {spec.format} EAGLE-3 head")
            if list(tensors[name].shape) != shape:
                raise ConfigError(f"{what}: tensor {name!r} has shape {list(tensors[name].shape)}, expected {shape}")
        if "d2t" in tensors:
            targets = torch.arange(spec.draft_vocab_size) + tensors["d2t"].long()
            if int(targets.min()) < 0 or int(targets.max()) >= vocab:
                raise ConfigError(f"{what}: d2t maps a draft token outside the target's vocabulary of {vocab}")
        return cls(spec, tensors, tuple(aux))

    def build(self, device: torch.device, dtype: torch.dtype, embed: torch.Tensor | None,
              max_positions: int) -> Eagle3Head:
        """The head on ``device`` in ``dtype``; ``embed`` [vocab, H]: the target's embedding, used when the
        checkpoint has none."""
        t = self.tensors
        weight = t.get("embed_tokens.weight", embed)
        if weight is None:
            raise ConfigError(f"{_KEY}={str(self.spec.folder)!r} has no embed_tokens.weight and no target "
                              "embedding was given")
        head = Eagle3Head(self.spec, len(self.aux_layers), "fc.bias" in t, max_positions, device, dtype)
        head.load(t, weight)
        head.pack_for_cpu()
        return head.eval()


class Eagle3Head(nn.Module):
    """The head's forward pass over flat tokens with its paged KV cache (see the module docstring)."""

    def __init__(self, spec: HeadSpec, num_aux: int, fc_bias: bool, max_positions: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.spec = spec
        h, d, eps = spec.hidden_size, spec.head_dim, spec.rms_norm_eps
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, d
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        bias = spec.attention_bias
        # rtp's linears, packed on CPU (see pack_for_cpu)
        one = ParallelState.single(device)

        def linear(n_in: int, n_out: int, with_bias: bool) -> ColumnParallelLinear:
            return ColumnParallelLinear(n_in, n_out, one, bias=with_bias).to(**kw)

        self.fc = linear(num_aux * spec.target_hidden_size, h, fc_bias)
        self.qkv_proj = linear(2 * h, (spec.num_heads + 2 * spec.num_kv_heads) * d, bias)
        self.o_proj = linear(spec.num_heads * d, h, bias)
        self.gate_up_proj = linear(h, 2 * spec.intermediate_size, False)
        self.down_proj = linear(spec.intermediate_size, h, False)
        self.lm_head = linear(h, spec.draft_vocab_size, False)
        self.input_layernorm = RMSNorm(h, eps).to(**kw)
        self.hidden_norm = RMSNorm(h, eps).to(**kw)
        self.post_attention_layernorm = RMSNorm(h, eps).to(**kw)
        self.norm = RMSNorm(h, eps).to(**kw)
        self.act = SiluAndMul()
        inv_freq, scale = rope_inv_freq(spec.layer_config, d)
        self.rotary = RotaryEmbedding(d, max_positions, inv_freq, scale).to(device)
        self.attn = PagedAttention(spec.num_heads, spec.num_kv_heads, d, d**-0.5)
        self.embed = torch.empty(0, device=device, dtype=dtype)  # [vocab, H], set by load()
        self.draft_to_target = torch.arange(spec.draft_vocab_size, device=device)  # [draft vocab] int64

    @torch.no_grad()
    def load(self, t: dict[str, torch.Tensor], embed: torch.Tensor) -> None:
        """Copy the checkpoint tensors ``t`` (checked) in; ``embed`` [vocab, H] is the embedding to use."""
        p = self.spec.layer_prefix
        dev, dtype = self.fc.weight.device, self.fc.weight.dtype
        self.embed = embed if embed.device == dev and embed.dtype == dtype else embed.to(dev, dtype)

        def cat(*names: str) -> torch.Tensor:
            return torch.cat([t[p + n] for n in names])

        self.fc.weight.copy_(t["fc.weight"])
        if self.fc.bias is not None:
            self.fc.bias.copy_(t["fc.bias"])
        self.qkv_proj.weight.copy_(cat("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"))
        self.o_proj.weight.copy_(t[p + "self_attn.o_proj.weight"])
        if self.qkv_proj.bias is not None and self.o_proj.bias is not None:
            self.qkv_proj.bias.copy_(cat("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"))
            self.o_proj.bias.copy_(t[p + "self_attn.o_proj.bias"])
        self.gate_up_proj.weight.copy_(cat("mlp.gate_proj.weight", "mlp.up_proj.weight"))
        self.down_proj.weight.copy_(t[p + "mlp.down_proj.weight"])
        self.lm_head.weight.copy_(t["lm_head.weight"])
        self.input_layernorm.weight.copy_(t[p + "input_layernorm.weight"])
        self.hidden_norm.weight.copy_(t[p + "hidden_norm.weight"])
        self.post_attention_layernorm.weight.copy_(t[p + "post_attention_layernorm.weight"])
        self.norm.weight.copy_(t["norm.weight"])
        if "d2t" in t:
            self.draft_to_target += t["d2t"].to(dev).long()

    def pack_for_cpu(self) -> None:
        """On CPU, re-lay the linears out once for their matmuls.

        ``fc`` reads every token the target computes (whole prompts too): it is packed as the target's
        linears are. The others run once per draft position on at most a drafting batch of rows
        (``disable_by_batch_size``, 16 by default): rtp's panel GEMM, which streams a weight 1.2-3x faster
        than oneDNN at 1-8 rows (fp32; oneDNN wins from about 32 rows, which a head pass does not reach).
        """
        device, dtype = self.fc.weight.device, self.fc.weight.dtype
        if device.type != "cpu":
            return
        method = cpu_linear_method(device, dtype)
        if method is not None:
            pack_linear_weights(self.fc, method)
        if cpu_gemm.available():
            pack_linear_weights(self, "gemm")  # the layers still plain: all but fc

    def features(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's auxiliary hidden states [N, A * H_target] -> the head's features [N, H]."""
        return self.fc(aux.to(self.fc.weight.dtype))

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, feats: torch.Tensor,
                meta: AttnMetadata) -> torch.Tensor:
        """ids [T] (the tokens after each position), positions [T], feats [T, H] -> outputs [T, H] (each the
        feature of the position after it; :meth:`logits` gives the draft)."""
        t, d = ids.shape[0], self.head_dim
        if self.spec.norm_before_residual:
            g = self.hidden_norm(feats)
            residual = g
        else:
            residual, g = feats, self.hidden_norm(feats)
        x = torch.cat([self.input_layernorm(F.embedding(ids, self.embed)), g], dim=-1)  # [T, 2H]
        q, k, v = self.qkv_proj(x).split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        q, k = self.rotary(positions, q.reshape(t, self.num_heads, d), k.reshape(t, self.num_kv_heads, d))
        o = self.attn(q.contiguous(), k.contiguous(), v.reshape(t, self.num_kv_heads, d).contiguous(), meta)
        r = residual + self.o_proj(o.flatten(1))
        return r + self.down_proj(self.act(self.gate_up_proj(self.post_attention_layernorm(r))))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Outputs [R, H] -> float32 logits over the draft vocabulary [R, draft vocab]."""
        return self.lm_head(self.norm(out)).float()
