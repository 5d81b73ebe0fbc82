"""Bound oneDNN's per-shape caches, which otherwise grow a CPU server's RSS for a long time.

Where oneDNN runs the CPU linears (fp32 on AVX-512 CPUs, bf16 where the CPU has native bf16; see
``cpu_linear_method``; rtp's own panel GEMM, used elsewhere, has no such cache), every linear runs
a oneDNN primitive built for its exact input shape, and two caches keep
the primitives (JIT code and descriptors, a few hundred KB each): oneDNN's own primitive cache
(``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) and ideep's (``LRU_CACHE_CAPACITY``), 1024 entries each by
default. A server sees a new token count in almost every mixed step, so each rank's RSS grew by
tens of MB per few hundred requests until both caches were full (measured with
``scripts/soak.py`` with oneDNN linears: 678 -> 1324 MB on rank 0 over 7 abort storms, still
growing; with both at 64: 678 -> 735 MB, flat after the first storm). Decode steps repeat
the same few batch shapes, so a small cache keeps their primitives; a prefill shape that was
evicted is rebuilt when it comes back.

The capacities are read when oneDNN builds its first primitive, so :func:`bound_onednn_caches`
runs in ``rtp.init`` before the model is loaded. A value already in the environment wins.
"""

from __future__ import annotations

import os

from rtp.log import get_logger

logger = get_logger(__name__)

CACHE_ENV_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
DEFAULT_CAPACITY = 64


def bound_onednn_caches(capacity: int = DEFAULT_CAPACITY) -> dict[str, str]:
    """Set each cache's capacity to ``capacity`` unless the environment sets it; return the values in force."""
    for name in CACHE_ENV_VARS:
        os.environ.setdefault(name, str(capacity))
    values = {name: os.environ[name] for name in CACHE_ENV_VARS}
    logger.debug("oneDNN cache capacities: %s", values)
    return values
