"""Quantized checkpoints and weight-only quantization, each a method on the linear layers' seam.

- :mod:`.fp8`: Qwen's FP8 block checkpoints (``quant_method: fp8``, 128 x 128 blocks);
- :mod:`.awq`: AutoAWQ GEMM checkpoints (``quant_method: awq``, 4 bits, groups of 128);
- :mod:`.int8`: int8 weights quantized at load from a float checkpoint
  (``quantization: int8``), for CPU decode.

:func:`checkpoint_format` reads a checkpoint's ``quantization_config`` and refuses, in one line
naming the key, what rtp cannot read.
"""

from __future__ import annotations

from typing import Any

from rtp.errors import CheckpointError
from rtp.model.quant.awq import AwqFormat
from rtp.model.quant.base import QuantFormat, QuantLinearMethod
from rtp.model.quant.fp8 import Fp8BlockFormat

__all__ = ["AwqFormat", "Fp8BlockFormat", "QuantFormat", "QuantLinearMethod", "checkpoint_format"]

SUPPORTED = "'fp8' (e4m3, 128x128 blocks, dynamic activations) and 'awq' (4-bit GEMM, group 128, zero point)"


def _bad(key: str, value: Any, allowed: str) -> CheckpointError:
    return CheckpointError(f"config.json quantization_config.{key}={value!r} is not supported; {allowed}")


def _fp8(qc: dict[str, Any]) -> Fp8BlockFormat:
    if qc.get("fmt", "e4m3") != "e4m3":
        raise _bad("fmt", qc.get("fmt"), "rtp reads FP8 checkpoints in e4m3")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise _bad("activation_scheme", qc.get("activation_scheme"), "rtp reads FP8 checkpoints with 'dynamic'")
    block = qc.get("weight_block_size")
    if block is None or list(block) != [128, 128]:
        raise _bad("weight_block_size", block, "rtp reads FP8 checkpoints with weight_block_size [128, 128]")
    return Fp8BlockFormat((128, 128))


def _awq(qc: dict[str, Any]) -> AwqFormat:
    for key, want in (("bits", 4), ("group_size", 128), ("zero_point", True)):
        if qc.get(key, want) != want:
            raise _bad(key, qc.get(key), f"rtp reads AWQ checkpoints with {key}={want!r}")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _bad("version", qc.get("version"), "rtp reads AWQ checkpoints packed for 'gemm'")
    return AwqFormat(128)


def checkpoint_format(hf_config: Any) -> QuantFormat | None:
    """The format named by ``hf_config.quantization_config``, None for a float checkpoint.

    Raises :class:`CheckpointError` (one line naming the key and what is allowed) for an
    unsupported method or setting, or for projections listed in ``modules_to_not_convert``
    (rtp quantizes every attention and MLP projection of a quantized checkpoint).
    """
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else getattr(qc, "__dict__", qc)
    if not isinstance(qc, dict):
        raise CheckpointError(f"config.json quantization_config must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    plain = ("lm_head", "embed_tokens", "gate")  # stored unquantized by rtp's reading anyway
    modules = qc.get("modules_to_not_convert") or []
    modules = [modules] if isinstance(modules, str) else modules  # one name, as a string
    skipped = [m for m in modules if not str(m).endswith(plain)]
    if skipped:
        raise _bad("modules_to_not_convert", skipped, "rtp reads checkpoints whose every projection is quantized")
    if method == "fp8":
        return _fp8(qc)
    if method == "awq":
        return _awq(qc)
    raise _bad("quant_method", method, f"rtp reads {SUPPORTED}")
