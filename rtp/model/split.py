"""How a Qwen3 checkpoint splits over tensor-parallel ranks: the arithmetic alone (no torch), shared by the model,
which checks its spec when it is built, and the ``rtp`` launcher, which checks config.json before any rank starts."""

from __future__ import annotations

import json
from pathlib import Path

from rtp.errors import ModelShapeError


def divide(numerator: int, denominator: int, what: str) -> int:
    """Exact division, or a ModelShapeError naming the numbers."""
    if numerator % denominator != 0:
        raise ModelShapeError(
            f"{what}={numerator} is not divisible by the tensor-parallel size {denominator}; "
            f"choose a TP size that divides {numerator}"
        )
    return numerator // denominator


def check_attention_split(heads: int, kv_heads: int, tp: int) -> None:
    """Query heads split ``tp`` ways; KV heads split, or replicated when ``tp`` is a multiple of them."""
    divide(heads, tp, "num_attention_heads")
    if heads % kv_heads:
        raise ModelShapeError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    if kv_heads % tp and tp % kv_heads:
        raise ModelShapeError(
            f"num_key_value_heads={kv_heads} and tensor-parallel size {tp}: one must divide the other "
            f"(KV heads are split when tp <= {kv_heads} and replicated when tp is a multiple of {kv_heads})"
        )


def check_checkpoint_split(model_dir: Path, tp: int) -> None:
    """The launcher's early check: the attention (and a dense model's MLP) of the checkpoint in ``model_dir``
    split ``tp`` ways, read from its config.json (what it does not hold is left to the ranks' full check)."""
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return  # the ranks name what is wrong with it
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads") or cfg.get("num_attention_heads")
    if isinstance(heads, int) and isinstance(kv, int) and heads > 0 and kv > 0:
        check_attention_split(heads, kv, tp)
    if cfg.get("model_type") == "qwen3" and isinstance(cfg.get("intermediate_size"), int):
        divide(cfg["intermediate_size"], tp, "intermediate_size")
