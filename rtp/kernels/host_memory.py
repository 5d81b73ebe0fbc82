"""Packed weights in transparent huge pages.

A decode step streams every weight once. Memory from torch's allocator comes in 4 KiB pages where THP
is set to ``madvise`` (most distributions): a TLB miss every 4 KiB, each a page walk (two nested ones
in a VM), and the hardware prefetchers stop at every page boundary. :func:`in_huge_pages` copies a
packed weight into a fresh anonymous mapping whose whole 2 MiB spans are advised for huge pages
(``MADV_HUGEPAGE``). On a 2-core Zen 4 VM, 28 layers of Qwen3-0.6B's linears plus its LM head ran
1.1-1.2x as fast at 1 row, 1.08-1.09x at 8, 1.06x at 16 and level at 32 (compute-bound), fp32 and
bf16 alike. The KV cache stays in 4 KiB pages: in huge pages, 32 sampled requests at Qwen3-0.6B's
dimensions took 16.2-16.4 s against 15.3 s.

Where the kernel has no THP (or it is ``never``) the advice changes nothing. Only whole 2 MiB spans
inside the tensor are advised, so a huge page never holds memory the tensor does not use.
"""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 << 20


def in_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU tensor ``t`` starting on a 2 MiB boundary, its whole huge pages advised for
    THP; ``t`` itself where it is smaller than a huge page or not on the CPU."""
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return t
    # A huge page more than the tensor needs, never touched, so that the copy can start on a boundary.
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(buf, dtype=torch.uint8)  # the tensor keeps the mapping alive
    offset = -whole.data_ptr() % HUGE_PAGE
    try:
        buf.madvise(mmap.MADV_HUGEPAGE, offset, nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError:  # a kernel built without THP: 4 KiB pages, as for any other memory
        pass
    out = whole[offset : offset + nbytes].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out
