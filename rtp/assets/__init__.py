"""Files shipped inside the package: the small trained Qwen3 that rtp runs by default.

``qwen3-tiny-shakespeare/`` is a 3.4 M-parameter Qwen3 (bfloat16, about 7 MB) trained on
Shakespeare's plays by ``scripts/train_tiny_qwen3.py``; see the README's "The default model".
The random-weight models of :mod:`rtp.testing` remain the tests' models.
"""

from __future__ import annotations

from pathlib import Path

TRAINED_MODEL_NAME = "qwen3-tiny-shakespeare"


def trained_model_dir() -> Path:
    """The shipped trained model's folder (a Hugging Face checkpoint): the default ``model``."""
    return Path(__file__).resolve().parent / TRAINED_MODEL_NAME
