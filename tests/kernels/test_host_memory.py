"""Packed weights in huge pages (:mod:`rtp.kernels.host_memory`): a copy on a 2 MiB boundary, its mapping
advised for THP, equal to the tensor it came from."""

import gc
import os

import pytest
import torch

from rtp.kernels import cpu_gemm
from rtp.kernels.host_memory import HUGE_PAGE, in_huge_pages

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads the mappings from /proc")
# A kernel built without THP refuses the advice (rtp then keeps 4 KiB pages): the flag is checked where it has THP.
THP = os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled")


def vm_flags(t: torch.Tensor) -> list[str]:
    """The VmFlags of the mapping that holds ``t``'s first byte (/proc/self/smaps)."""
    addr, inside, flags = t.data_ptr(), False, None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                flags = line.split()[1:]
                break
    assert flags is not None, "no mapping holds the tensor"
    return flags


@pytest.mark.parametrize("shape", [(HUGE_PAGE // 4,), (3, HUGE_PAGE // 4), (11, 65537)])
def test_a_large_tensor_is_copied_onto_a_huge_page_boundary_and_advised(shape):
    t = torch.randn(shape)
    moved = in_huge_pages(t)
    assert moved.data_ptr() != t.data_ptr() and moved.is_contiguous() and moved.shape == t.shape
    assert torch.equal(moved, t)
    assert moved.data_ptr() % HUGE_PAGE == 0
    assert "hg" in vm_flags(moved) or not THP  # MADV_HUGEPAGE on its mapping
    moved += 1.0  # writable to its last byte (the tail beyond the last whole huge page is 4 KiB pages)
    assert torch.equal(moved, t + 1.0)


def test_the_copy_outlives_every_other_reference_to_its_mapping():
    view = in_huge_pages(torch.ones(2, HUGE_PAGE // 4))[1]
    gc.collect()
    view *= 3.0  # the mapping is still there: writing to it must not fault
    assert torch.equal(view, torch.full((HUGE_PAGE // 4,), 3.0))


def test_small_and_non_cpu_tensors_are_kept_as_they_are():
    small = torch.randn(16, 16)
    assert in_huge_pages(small) is small
    meta = torch.empty(HUGE_PAGE, device="meta")
    assert in_huge_pages(meta) is meta


@pytest.mark.skipif(not cpu_gemm.available(), reason="the CPU GEMM kernel did not build")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_weights_live_in_huge_pages_and_multiply_as_before(dtype):
    w, x = torch.randn(1024, 1024), torch.randn(8, 1024)  # 4 MiB (fp32) or 2 MiB (bf16) of panels
    packed = cpu_gemm.pack(w.to(dtype))
    assert packed.data_ptr() % HUGE_PAGE == 0 and ("hg" in vm_flags(packed) or not THP)
    ref = (x.to(dtype).float() @ w.to(dtype).float().T).to(dtype)
    torch.testing.assert_close(cpu_gemm.linear(x.to(dtype), packed, 1024), ref, rtol=2e-2, atol=2e-2)
