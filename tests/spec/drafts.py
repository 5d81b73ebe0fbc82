"""Draft checkpoints for the draft-model tests, built from the random tiny Qwen3 the tests use.

``small_draft``: another random Qwen3, far smaller (one layer, one KV head), same vocabulary and
tokenizer: its drafts are almost never accepted. ``noisy_draft``: the target's own weights with
Gaussian noise on every tensor: drafts are accepted often but not always, so both the accept and
the reject paths run. Both are cached next to the default tiny model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rtp.testing import TinyQwen3Spec, default_model_dir, make_tiny_qwen3

SMALL = TinyQwen3Spec(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      intermediate_size=64, num_hidden_layers=1, seed=7)
NOISE = 0.02  # noise std relative to each tensor's own std


def _build_once(final: Path, build) -> Path:  # noqa: ANN001 - build(tmp_dir) writes the checkpoint
    if final.is_dir():
        return final
    tmp = final.with_name(f".{final.name}.tmp-{torch.randint(0, 2**31, ()).item()}")
    try:
        build(tmp)
        try:
            tmp.rename(final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def small_draft() -> Path:
    """A 1-layer random Qwen3 with the target's vocabulary and tokenizer."""
    target = default_model_dir()
    return _build_once(target.parent / f"{target.name}-draft-small", lambda d: make_tiny_qwen3(d, SMALL))


def noisy_draft(noise: float = NOISE) -> Path:
    """The target with ``noise`` (relative) Gaussian noise added to every weight tensor (seeded)."""
    target = default_model_dir()

    def build(out: Path) -> None:
        shutil.copytree(target, out)
        gen = torch.Generator().manual_seed(11)
        for f in out.glob("*.safetensors"):
            tensors = load_file(f)
            for name, t in tensors.items():
                tensors[name] = t + noise * t.float().std() * torch.randn(t.shape, generator=gen).to(t.dtype)
            save_file(tensors, f, metadata={"format": "pt"})

    return _build_once(target.parent / f"{target.name}-draft-noisy-{noise}", build)


def write_eagle3_head(out: Path, target: Path, *, fmt: str = "specforge", draft_vocab: int = 128,
                      aux_layers: list[int] | None = None, seed: int = 5, scale: float = 1.0) -> Path:
    """A random EAGLE-3 head for the Qwen3 in ``target``, in SpecForge's or the speculators format.

    One layer of the target's hidden size (the embedding is shared), 4 heads of 2 KV heads, a draft
    vocabulary of the first ``draft_vocab`` odd token ids (d2t holds the offsets); ``scale`` multiplies
    the random weights' standard deviation.
    """
    cfg = json.loads((target / "config.json").read_text())
    h, vocab, layers = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    heads, kv, d, inter = 4, 2, h // 4, 2 * h
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * scale / shape[-1] ** 0.5

    p = "midlayer." if fmt == "specforge" else "layers.0."
    ids = torch.arange(draft_vocab) * 2 + 1  # draft id i -> target id 2i + 1
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    tensors = {
        "fc.weight": rand(h, 3 * h), "norm.weight": 1 + 0.1 * rand(h), "lm_head.weight": rand(draft_vocab, h),
        "d2t": ids - torch.arange(draft_vocab), "t2d": t2d,
        p + "input_layernorm.weight": 1 + 0.1 * rand(h), p + "hidden_norm.weight": 1 + 0.1 * rand(h),
        p + "post_attention_layernorm.weight": 1 + 0.1 * rand(h),
        p + "self_attn.q_proj.weight": rand(heads * d, 2 * h), p + "self_attn.k_proj.weight": rand(kv * d, 2 * h),
        p + "self_attn.v_proj.weight": rand(kv * d, 2 * h), p + "self_attn.o_proj.weight": rand(h, heads * d),
        p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
        p + "mlp.down_proj.weight": rand(h, inter),
    }
    layer = {"model_type": "llama", "hidden_size": h, "num_attention_heads": heads, "num_key_value_heads": kv,
             "head_dim": d, "intermediate_size": inter, "rms_norm_eps": 1e-6, "vocab_size": vocab,
             "max_position_embeddings": cfg["max_position_embeddings"], "rope_theta": 10000.0}
    aux = aux_layers if aux_layers is not None else [min(i, layers - 1) for i in (0, layers // 2, layers - 1)]
    if fmt == "specforge":
        config = {**layer, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": draft_vocab,
                  "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux}}
    else:
        tensors["fc.bias"] = rand(h)
        tensors["embed_tokens.weight"] = rand(vocab, h)
        config = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
                  "transformer_layer_config": layer, "draft_vocab_size": draft_vocab, "norm_before_residual": True,
                  "target_hidden_size": h, "eagle_aux_hidden_state_layer_ids": aux,
                  "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                         "verifier": {"name_or_path": str(target)}}}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors")
    return out
