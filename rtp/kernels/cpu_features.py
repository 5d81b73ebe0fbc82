"""What this CPU computes natively: the facts the dtype and matmul choices rest on."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

_NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""Linux /proc/cpuinfo flags of bf16 dot-product instructions (AVX-512 BF16, AMX tiles)."""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags of the first CPU in /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def native_bf16() -> bool:
    """True where the CPU multiplies bf16 natively and torch's oneDNN can use it.

    That is where bf16 is worth its lost precision on a CPU: oneDNN's packed bf16 matmul runs at
    about twice its fp32 rate there and a decode step reads half the bytes. Elsewhere (AVX2) bf16
    is only a storage format: rtp's GEMM widens bf16 weights to fp32 in registers.
    """
    if not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    flags = cpu_flags()
    return any(f in flags for f in _NATIVE_BF16_FLAGS) if flags else True
