"""What this CPU computes natively: the facts the dtype and matmul choices rest on."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

_NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""Linux /proc/cpuinfo flags of bf16 dot-product instructions (AVX-512 BF16, AMX tiles)."""


def first_cpu_info(cpuinfo: str | None = None) -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (or in the text ``cpuinfo``), e.g. ``"cpu family"`` ->
    ``"26"``; empty where there is none. Every core of a machine reads the same."""
    if cpuinfo is None:
        cpuinfo = _proc_cpuinfo()
    first = cpuinfo.split("\n\n", 1)[0]
    return {key.strip(): value.strip() for key, sep, value in (line.partition(":") for line in first.splitlines())
            if sep}


def zen4(cpuinfo: str | None = None) -> bool:
    """True on an AMD Zen 4 (family 25 with AVX-512), which runs 512-bit instructions on 256-bit units: at a
    decode step's few rows its GEMM tiles are bound by their arithmetic sooner than on a Zen 5 (full-width
    units), so :mod:`rtp.kernels.cpu_gemm` is built with other row tiles there. ``cpuinfo``: /proc/cpuinfo's
    text (default: this machine's)."""
    info = first_cpu_info(cpuinfo)
    return (info.get("vendor_id") == "AuthenticAMD" and info.get("cpu family") == "25"
            and "avx512f" in info.get("flags", "").split())


@functools.cache
def _proc_cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags of the first CPU in /proc/cpuinfo (empty where there is none)."""
    return frozenset(first_cpu_info().get("flags", "").split())


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
