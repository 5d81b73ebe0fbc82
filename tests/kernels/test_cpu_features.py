"""dtype "auto" on CPU follows the CPU's native bf16 support, as vLLM's CPU backend does."""

import pytest
import torch

from rtp.kernels import cpu_features
from rtp.runtime.model_runner import resolve_dtype

CPU = torch.device("cpu")


@pytest.fixture
def cpu_with(monkeypatch):
    def set_cpu(flags: set[str], onednn_bf16: bool = True) -> None:
        monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset(flags))
        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: onednn_bf16)

    return set_cpu


@pytest.mark.parametrize(
    "flags, onednn_bf16, expected",
    [
        ({"avx2", "fma"}, False, torch.float32),  # AVX2 only: bf16 is a storage format there
        ({"avx512f", "avx512bw"}, True, torch.float32),  # AVX-512 without BF16 dot products
        ({"avx512f", "avx512_bf16"}, True, torch.bfloat16),
        ({"avx512f", "amx_bf16", "amx_tile"}, True, torch.bfloat16),
        ({"avx512_bf16"}, False, torch.float32),  # torch's oneDNN cannot use it
    ],
)
def test_auto_dtype_on_cpu(cpu_with, flags, onednn_bf16, expected):
    cpu_with(flags, onednn_bf16)
    assert resolve_dtype("auto", CPU) == expected


def test_explicit_dtype_and_cuda_are_unaffected(cpu_with):
    cpu_with({"avx2"}, False)
    assert resolve_dtype("bfloat16", CPU) == torch.bfloat16
    assert resolve_dtype("float32", CPU) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16


def test_cpu_flags_reads_this_machine():
    flags = cpu_features.cpu_flags()
    assert isinstance(flags, frozenset)
    if flags:  # Linux: x86 CPUs list sse2, ARM ones fp or asimd
        assert flags & {"sse2", "fp", "asimd"}


def _cpuinfo(vendor: str, family: int, flags: str) -> str:
    core = f"processor\t: {{}}\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: 17\nflags\t\t: {flags}\n"
    return "\n".join(core.format(i) for i in range(2))


@pytest.mark.parametrize(
    "vendor, family, flags, expected",
    [
        ("AuthenticAMD", 25, "fpu avx2 avx512f avx512_bf16", True),  # Zen 4
        ("AuthenticAMD", 25, "fpu avx2 fma", False),  # Zen 3: same family, no AVX-512
        ("AuthenticAMD", 26, "fpu avx2 avx512f avx512_bf16 avx_vnni", False),  # Zen 5: full-width units
        ("GenuineIntel", 6, "fpu avx2 avx512f avx512_bf16 amx_bf16", False),
    ],
)
def test_zen4_is_amd_family_25_with_avx512(vendor, family, flags, expected):
    """The CPU GEMM's Zen 4 build (other row tiles) is chosen from /proc/cpuinfo's vendor, family and flags."""
    assert cpu_features.zen4(_cpuinfo(vendor, family, flags)) is expected
