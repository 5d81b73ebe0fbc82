"""Files shipped inside the package: the small trained Qwen3 that rtp runs by default.

``qwen3-tiny-shakespeare/`` is a 3.4 M-parameter Qwen3 (bfloat16, about 7 MB) trained on
Shakespeare's plays by ``scripts/train_tiny_qwen3.py``; see the README's "The default model".
``qwen3-tiny-shakespeare-eagle3/`` is its EAGLE-3 draft head (SpecForge format), trained by
``scripts/train_eagle3.py``; see the README's "EAGLE-3".
The random-weight models of :mod:`rtp.testing` remain the tests' models.
"""

from __future__ import annotations

from pathlib import Path

TRAINED_MODEL_NAME = "qwen3-tiny-shakespeare"


def trained_model_dir() -> Path:
    """The shipped trained model's folder (a Hugging Face checkpoint): the default ``model``."""
    return Path(__file__).resolve().parent / TRAINED_MODEL_NAME


def trained_eagle3_dir() -> Path:
    """The shipped EAGLE-3 head for the trained model (SpecForge format)."""
    return Path(__file__).resolve().parent / f"{TRAINED_MODEL_NAME}-eagle3"
