"""Draft checkpoints for the draft-model tests, built from the random tiny Qwen3 the tests use.

``small_draft``: another random Qwen3, far smaller (one layer, one KV head), same vocabulary and
tokenizer: its drafts are almost never accepted. ``noisy_draft``: the target's own weights with
Gaussian noise on every tensor: drafts are accepted often but not always, so both the accept and
the reject paths run. Both are cached next to the default tiny model.
"""

from __future__ import annotations

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
