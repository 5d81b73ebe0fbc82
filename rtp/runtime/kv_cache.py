"""Size the paged KV cache (the MIN over ranks), allocate it, bind it to the layers."""

from __future__ import annotations

import math
import mmap

import torch

from rtp.distributed.parallel import ParallelState
from rtp.errors import ConfigError
from rtp.log import get_logger
from rtp.model.attention import PagedAttention

logger = get_logger(__name__)


def bytes_per_block(layers: list[PagedAttention], block_size: int, dtype: torch.dtype) -> int:
    """KV bytes one block costs on this rank, over every layer (K and V), in the cache's ``dtype``.

    An FP8 cache costs one byte per element: the same budget holds twice the blocks of a bf16 cache.
    """
    elem = dtype.itemsize
    return sum(2 * block_size * a.num_kv_heads * a.head_dim * elem for a in layers)


def plan_num_blocks(
    ps: ParallelState,
    per_block: int,
    *,
    fixed: int | None,
    cpu_cache_gib: float,
    gpu_memory_utilization: float,
    peak_bytes: int = 0,
) -> int:
    """How many KV blocks fit on every rank.

    ``fixed`` (config ``num_kv_blocks``) wins; on CPU the budget is
    ``cpu_cache_gib``; on GPU it is ``utilization * total - peak`` where peak
    is the memory used by weights and a profiling forward pass. The result is
    reduced with MIN over ranks, so no rank is asked to hold more than it can.
    """
    if fixed is not None:
        local = fixed
    elif ps.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(ps.device)
        # Memory outside torch's allocator (CUDA context, NCCL buffers) counts against the budget too.
        non_torch = max(0, (total - free) - torch.cuda.memory_reserved(ps.device))
        local = int((total * gpu_memory_utilization - peak_bytes - non_torch) // per_block)
    else:
        local = int(cpu_cache_gib * 2**30 // per_block)
    num_blocks = ps.min_int(local)
    if num_blocks < 1:
        if fixed is not None:
            knob = f"num_kv_blocks={fixed}"
        elif ps.device.type == "cuda":
            knob = f"gpu_memory_utilization={gpu_memory_utilization} (after {peak_bytes / 2**30:.2f} GiB of weights " \
                   "and activations)"
        else:
            knob = f"cpu_kv_cache_gib={cpu_cache_gib}"
        raise ConfigError(f"{knob} leaves no room for the KV cache: a block takes {per_block} bytes on each rank "
                          f"({per_block / 2**30:.6f} GiB) and rank {ps.rank} fits {local}; raise it, or use more ranks")
    logger.info("KV cache: %d blocks of %.1f KiB per rank (local estimate %d)", num_blocks, per_block / 1024, local)
    if ps.device.type == "cpu":
        node_bytes, available = num_blocks * per_block * len(ps.local_ranks), available_memory()
        if available is not None and node_bytes > available:
            logger.warning("the KV caches of this node's %d rank(s) take %.1f GiB and %.1f GiB of memory is "
                           "available: sequences that fill them will run the machine out of memory; lower "
                           "cpu_kv_cache_gib", len(ps.local_ranks), node_bytes / 2**30, available / 2**30)
    return num_blocks


def allocate_kv_cache(
    layers: list[PagedAttention], num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> None:
    """Give each attention layer its cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` for K and V,
    in ``dtype`` (the compute dtype, or ``float8_e4m3fn`` read with the layer's scales)."""
    for attn in layers:
        shape = (num_blocks, block_size, attn.num_kv_heads, attn.head_dim)
        attn.k_cache = zeroed(shape, dtype, device)
        attn.v_cache = zeroed(shape, dtype, device)


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor whose memory is faulted in where it is first written.

    On a CPU it is a fresh anonymous mapping: the kernel gives each page on first touch, zeroed, so start-up
    writes nothing and a run pays for the blocks it uses, once, where it first writes them. Pre-faulting it
    (``MAP_POPULATE``, or ``torch.zeros`` writing every byte) took 2.3-7 s per rank for two TP = 2 ranks of
    2 GiB each on the 2-core VM: bench.py's whole TP = 2 process went from 16-17.5 s to 8.9-9.4 s without it
    (40M model, timed batches no slower), a TP = 1 one at Qwen3-0.6B dimensions from 30-32 s to 19-22 s,
    where the first timed batch, the first to write its ~300 MB of blocks, became 5-10% slower (6.3-6.5 s
    -> 6.8-7.0 s). The memory is not reserved up front: :func:`plan_num_blocks` warns when the node's
    caches exceed the memory available. The tensor keeps the mapping alive; it is unmapped when the tensor
    is freed.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    try:
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as e:  # more than the kernel will map (overcommit refused it)
        raise ConfigError(f"the KV cache needs {nbytes / 2**30:.1f} GiB per layer tensor and the kernel refused to "
                          f"map it ({e.strerror or e}): lower cpu_kv_cache_gib (--cpu-kv-cache-gib)") from None
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


def available_memory() -> int | None:
    """Bytes of memory the kernel could give without swapping (``MemAvailable``), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None
