"""One piece of the shared-memory all-reduce (:mod:`rtp.distributed.shm_allreduce`) in one C++ call.

In Python a piece is about ten torch and numpy calls (slot views, the copy, the
counter store, the counter checks, the sum). Between two layers' GEMMs, with the
interpreter's own data pushed out of the caches, they cost 110-140 us a piece on
the 2-core AVX-512 host: ~2 ms of a ~30 ms TP = 2 decode step of the 40M bench
model, whose 17 all-reduces a step are otherwise ~50 KB copies. Here the same
protocol steps run in one call.

The call does what the Python path does, in the same order and with the same
roundings (the sum adds the slots in rank order, rounding to the tensor's dtype
after each add as torch's ``add`` does), so ranks on either path agree bit for
bit. It spins on the counters for a bounded time only; when a peer is later than
that it returns the stage it stopped at, and Python waits with its liveness
checks (a dead or hung peer is an error, never a hang) and calls it again.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from rtp.kernels.cpu_build import build
from rtp.kernels.cpu_simd import SIMD_HEADER

# Stages of one piece (the kernel returns the stage it stopped at, DONE when it finished).
WAIT_FREE, WAIT_PEERS, DONE = 0, 1, 2
DTYPES = (torch.float32, torch.bfloat16)

_SOURCE = SIMD_HEADER + r"""
#if defined(__x86_64__)
#include <immintrin.h>
static inline void relax() { _mm_pause(); }
#else
static inline void relax() {}
#endif

// Counters: posted[r] is the int64 at byte 64 * r of the segment; slots follow the world's counter lines.
static inline bool all_posted(const int64_t* posted, int64_t world, int64_t op) {
  for (int64_t r = 0; r < world; ++r)
    if (__atomic_load_n(posted + 8 * r, __ATOMIC_ACQUIRE) < op) return false;
  return true;
}

static inline bool spin_until(const int64_t* posted, int64_t world, int64_t op, int64_t spins) {
  for (int64_t i = 0; i <= spins; ++i) {
    if (all_posted(posted, world, op)) return true;
    relax();
  }
  return false;
}

// out = slot[0] + slot[1] (+ slot[2] ...), each add rounded to T (cpu_simd's load8/store8: torch's casts).
template <typename T>
static void sum_slots(T* out, const char* slots, int64_t world, int64_t slot_bytes, int64_t n) {
  for (int64_t r = 1; r < world; ++r) {
    const T* a = r == 1 ? reinterpret_cast<const T*>(slots) : out;
    const T* b = reinterpret_cast<const T*>(slots + r * slot_bytes);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) store8(out + i, load8(a + i) + load8(b + i));
    for (; i < n; ++i) out[i] = static_cast<T>(static_cast<float>(a[i]) + static_cast<float>(b[i]));
  }
}

// Elements [start, start + n) of the contiguous `flat` as collective number `op`, from `stage` on
// (0: wait until the op's buffer is free, copy in, post; 1: wait for every rank's post, sum).
// Returns the stage where a peer was later than `spins` pauses, or 2 when the piece is reduced.
int64_t all_reduce_piece(at::Tensor flat, int64_t start, int64_t n, at::Tensor segment, int64_t rank,
                         int64_t world, int64_t slot_bytes, int64_t op, int64_t stage, int64_t spins) {
  const int64_t es = flat.element_size();
  TORCH_CHECK(flat.is_contiguous() && n * es <= slot_bytes && start + n <= flat.numel(), "all_reduce_piece: bad piece");
  TORCH_CHECK(segment.numel() >= 64 * world + 2 * world * slot_bytes, "all_reduce_piece: segment too small");
  char* seg = static_cast<char*>(segment.data_ptr());
  int64_t* posted = reinterpret_cast<int64_t*>(seg);
  char* buffer = seg + 64 * world + (op % 2) * world * slot_bytes;  // slots[op % 2][0]
  char* mine = static_cast<char*>(flat.data_ptr()) + start * es;
  if (stage == 0) {
    if (!spin_until(posted, world, op - 1, spins)) return 0;  // whoever read this buffer at op - 2 is done
    std::memcpy(buffer + rank * slot_bytes, mine, n * es);
    __atomic_store_n(posted + 8 * rank, op, __ATOMIC_RELEASE);
  }
  if (!spin_until(posted, world, op, spins)) return 1;
  if (flat.scalar_type() == at::kFloat)
    sum_slots(reinterpret_cast<float*>(mine), buffer, world, slot_bytes, n);
  else if (flat.scalar_type() == at::kBFloat16)
    sum_slots(reinterpret_cast<at::BFloat16*>(mine), buffer, world, slot_bytes, n);
  else
    TORCH_CHECK(false, "all_reduce_piece: float32 and bfloat16 only");
  return 2;
}
"""


@functools.lru_cache(maxsize=1)
def load() -> ModuleType | None:
    """Build (first use) and import the kernel; None where it cannot be built."""
    return build("cpu_allreduce", _SOURCE, ["all_reduce_piece"])
