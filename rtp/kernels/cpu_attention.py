"""Paged attention for CPUs: small C++ kernels built once with torch's own extension loader.

On CPU the torch path of decode attention gathers every sequence's blocks into a
padded ``[B, L, Hkv, D]`` copy and then runs SDPA over it: the KV bytes cross
memory three times, and SDPA's CPU kernel is slow for one query per sequence.
This kernel reads each key and value once, straight from the paged cache: one
task per sequence, which scores the query heads against the sequence's own ``context_len``
keys, applies a softmax and sums the values; when there are few sequences, one task per
range of a sequence's keys (a split softmax, its ranges' sums merged at the end), so that
every task still reads whole slots (all KV heads of a token are adjacent). Against a task
per KV head for those (a slice of every slot), on a 2-core Zen 4: one sequence of 1000 tokens
at Qwen3-0.6B's heads 1.43x bf16, 1.36x fp32; two of 300 and 700 1.29x / 1.32x; one of 20-40
tokens 0.73-1.0x (a few microseconds a layer). It is what the torch reference computes
(``paged_decode_attention_reference``), in fp32 accumulation, for fp32/bf16/fp16 caches.

The blocks of a sequence lie anywhere in the cache, and a task reads a block's keys (then its values)
head by head, so its loads jump from slot to slot and the hardware prefetcher cannot follow them: each
key of the next block is prefetched into L2 while the same key of this block is read, a few lines at a
time between the arithmetic (after the last block of keys, the first block of values; after the last
values, the first keys of the thread's next task; only a thread's very first block is prefetched in one
go). Against the whole next block prefetched into L1 at once at the start of each block (a burst of
512-1024 prefetches, fp32 or bf16, 16 keys of 8 KV heads), on a 2-core Zen 4, 28 layers whose
caches are in memory, alternated in one process: Qwen3-0.6B's heads (16 / 8 of 128), 8 sequences of
60-130 tokens bf16 1.69x, fp32 1.06x; 32 sequences of 100-317 1.92x / 1.10x; one of 1000 1.56x / 1.19x;
the 40M's heads (8 / 4 of 64), 24 sequences of 40-155 2.16x / 1.49x. (Before the per-block prefetch
existed it ran at a fifth of the read bandwidth.) Tried and left: the cache in huge pages (the kernel
1.1-1.16x, but 32 sampled requests at Qwen3-0.6B's dimensions 0.95-0.97x end to end).

With AVX-512 BF16, bf16 caches whose head dim is a multiple of 32 take pair products (``dots_pairs``,
``pv_pairs_dec``): a key's 32 bf16 against the query's in one ``vdpbf16ps`` (the query unscaled, the sums
scaled in fp32), two keys' values interleaved by two unpacks against their softmax numerators rounded to bf16
(as the prompt kernel's pair tiles and flash attention do; the row sums stay fp32). With them the rows' maxima
are taken a register at a time and the outputs put back in order a register at a time (a running scalar
maximum and a scalar conversion per output had become a fifth of a call). Alternated in one process on a
2-core Zen 4 at Qwen3-0.6B's heads against the kernel before (widening bf16 to fp32), warm / with the cache
in memory: 8 sequences of ~100 keys 1.27x / 1.07x, 32 of ~160 1.28x / 1.06x, 32 of ~600 sharing 512 1.27x /
1.22x, 8 of ~1000 1.18x / 1.02x (memory-bound there); fp32 1.01-1.04x (the maxima), bit for bit the same.
(Scoring keys alone with ``vdpbf16ps`` had measured 0.78x: four instructions a sum before each fold, and
the scalar maxima and outputs around it.)

Where 8 or more sequences of a decode step share their leading blocks over at least 256 keys (a system prompt
found in the prefix cache), such bf16 caches also take a cascade pass over those keys (``cascade_prefix``): each
KV head's query rows of all the sequences score them together in the prompt kernel's pair tiles (the keys
gathered once per 64 for all rows, no horizontal sums), an online softmax whose result is one more part in each
row's merge; each sequence's own task starts after the shared keys. Alternated in one process on a 2-core Zen 4
at Qwen3-0.6B's heads against the pair products alone, warm / in memory: 32 sequences of ~600 keys sharing 512
1.53x / 1.21x, 8 of ~600 sharing 512 1.38x / 1.19x, 16 of ~300 sharing 256 1.31x / 1.11x, no shared blocks
level; ``scripts/bench.py --prefix-len 512`` (32 requests, bf16): decode step 110.5 -> 104.9 ms. Below those
bounds it lost where the shared blocks came from memory (its gathers do not prefetch).

Prompt chunks and mixed steps (:func:`paged_prefill_attention_cpu`) take the varlen kernel: one
task per (sequence, KV head, chunk of 128 queries), an online softmax over the sequence's cached
keys 64 at a time (causal, so a chunk reads only the keys up to its last query), also straight
from the paged cache: a cached prefix, earlier chunks and this step's own tokens alike. The tasks go
by descending work, each thread taking the next one when it is free. Both read the
cache through one ``PagedCache`` struct (pointers, geometry, strides, the block-table lookup).

Inside a block the decode kernel scores eight keys at a time (``dots_f``: eight dot products sharing the
query's loads, finished by one shuffle tree instead of eight horizontal sums) and sums the values with
64 outputs held in registers across the block's keys (``pv_f``: one store per block, not one per
key). With AVX-512 (32 vector registers) it scores two query heads of a KV head
together, so that each key and value is loaded (and widened from bf16) once for both: Qwen3-0.6B's
16 / 8 heads on a Zen 4, 1.2-1.5x per call at 1-32 sequences of 100-1000 tokens, level at 8 x 1600
(memory-bound there). Against one dot product and one in-memory axpy per key, on one thread of an
AVX-512 host: decode over 300 keys 28 -> 14.5 us, 96 sequences of 160 keys 2.8 -> 1.1 ms, a verification
step's 5 queries over 300 keys 114 -> 61 us. Its vectors are whole registers (16 floats with AVX-512, else 8;
head dims that are not a multiple take one dot product per key), and the next block's prefetch walks its
lines with a cursor: on a 2-core Zen 5, 28 layers of 8 sequences of 55-115 keys at Qwen3-0.6B's heads with
the caches in L2/L3, 1.30x bf16 and 1.33x fp32 against 8-float vectors and an integer division per
prefetched line (a fifth of the kernel's time in ``perf``); with the caches in memory level (0.95-1.07x,
bound by the memory there).

The varlen kernel has many query rows per key instead, so it works in register tiles like a GEMM
(``scores_tile``, ``pv_tile``): the 64 keys are gathered once per task into a transposed fp32 copy,
8 query rows (AVX2: 4) x two registers of keys (32 with AVX-512, 16 with AVX2) of scores are summed over
the head dimension with one broadcast per row, the values summed into 8 rows x two registers of outputs,
and each row's online softmax costs one max, the exponentials and one rescale per 64 keys; tiles past a
row's position are skipped. Against per-row dot products and value sums per 16-key block with 16-query
tasks, on a 2-core Zen 4: 24 prompts of 32-256 tokens (8 / 4 heads of 64) 1.55x (60 -> 93 GFLOP/s of causal
attention), at Qwen3-0.6B's heads (16 / 8 of 128) 1.59x; in the 40M benchmark's prompt steps 78 -> 53 ms.
The tiles were 8-float vectors (16 keys) until whole registers: on a 2-core Zen 5 (full-width AVX-512),
alternated in one process, one prompt of 2000 tokens at Qwen3-0.6B's heads 1.58-1.65x fp32 / 1.64-1.68x bf16 (~230
-> ~380 GFLOP/s), 8 prompts of 36-109 1.35-1.38x, the 40M's 24 prompts 1.37-1.43x, the same outputs; a
generate() of that 2000-token prompt (its time to first token) 1.27x bf16, 1.17x fp32; the bench.py
workloads, whose prompt attention is a few percent of their time, level (0.99-1.01x). 12 rows x 32 keys
and 6 rows x 64 keys measured no faster. With AVX-512 BF16, bf16 caches whose head dim is a multiple of the
tile (32) take the same tiles in pair products (``vdpbf16ps``, see ``gather_pairs``): the keys and values
copied as pairs of bf16, the scores and the softmax in fp32, its numerators rounded to bf16 for the value
sums. Against the fp32 tiles above, same host: one 2000-token prompt 1.59x per call (~370 -> ~570
GFLOP/s), 8 prompts of 36-109 1.50x, the 40M's heads (64) 1.32-1.35x; that prompt's ``generate()`` 1.17x
(3.22 -> 2.74 s; 4.13 s with the 8-float tiles before both); bf16 logits as far from HF's fp32 ones as before
(the trained default model 0.0091 either way). The online softmax was then ~40% of such a call: in whole
registers with the numerators written in the same pass (``softmax_tile``), the 2000-token prompt 1.23x bf16,
1.15x fp32 per call, its ``generate()`` 1.056x bf16 (2.62 -> 2.48 s), 1.034x fp32.

A task's last rows take a tile of 4 or 2 rows instead of a whole one padded with zero queries, so that a
decode row (one query: its ``rep`` query heads of a KV head) pays for 2 rows, not 8 (AVX2: 4). A row goes
through the same operations whatever its tile's height, which ``model.batch_invariant`` relies on. The values
are read in place from the cache (widened to fp32 as they load) instead of copied 64 at a time. Both against
the kernel before them, alternated in one process over 28 layers with the caches flushed, on a 2-core Zen 3
(AVX2: 4-row tiles before): decode rows of 8 sequences of 60-160 keys at Qwen3-0.6B's heads 1.15x fp32 /
1.40x bf16, of the 40M's 24 sequences 1.19x / 1.37x; 8 prompts of 36-109 1.08x / 1.05x; one of 2000 1.00x /
1.10x; a 512-token chunk beside 16 decode rows 1.06x / 1.01x; the outputs bit for bit the same. Such decode
rows still take 1.7x (fp32) and 2.3x (bf16) the decode kernel's time, the keys' transposed copy a quarter of
it (``perf``). The AVX-512 builds of this change were compiled, not measured.

The source is compiled on first use by :func:`rtp.kernels.cpu_build.build` (about 20 s,
cached). Without a C++ compiler, or if the build fails, :func:`load` returns None and the
runtime keeps the torch path.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from rtp.kernels.cpu_build import build
from rtp.kernels.cpu_simd import SIMD_HEADER

_SOURCE = SIMD_HEADER + r"""
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <limits>
#include <vector>
#include <atomic>

// __builtin_shufflevector: clang, and GCC from 12 (older compilers take one dot product per key below).
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define RTP_HSUM8X8 1
// Lane j = the sum of a[j]'s eight lanes: eight dot products finished at once (a tree of shuffles and
// adds, instead of eight horizontal sums one lane at a time).
__attribute__((always_inline)) static inline v8f hsum8x8(const v8f* a) {
  const v8f x01 = __builtin_shufflevector(a[0], a[1], 0, 8, 2, 10, 4, 12, 6, 14) +
                  __builtin_shufflevector(a[0], a[1], 1, 9, 3, 11, 5, 13, 7, 15);
  const v8f x23 = __builtin_shufflevector(a[2], a[3], 0, 8, 2, 10, 4, 12, 6, 14) +
                  __builtin_shufflevector(a[2], a[3], 1, 9, 3, 11, 5, 13, 7, 15);
  const v8f x45 = __builtin_shufflevector(a[4], a[5], 0, 8, 2, 10, 4, 12, 6, 14) +
                  __builtin_shufflevector(a[4], a[5], 1, 9, 3, 11, 5, 13, 7, 15);
  const v8f x67 = __builtin_shufflevector(a[6], a[7], 0, 8, 2, 10, 4, 12, 6, 14) +
                  __builtin_shufflevector(a[6], a[7], 1, 9, 3, 11, 5, 13, 7, 15);
  // y0 lanes: a0..a3's low halves, then their high halves; y1 the same for a4..a7.
  const v8f y0 = __builtin_shufflevector(x01, x23, 0, 1, 8, 9, 4, 5, 12, 13) +
                 __builtin_shufflevector(x01, x23, 2, 3, 10, 11, 6, 7, 14, 15);
  const v8f y1 = __builtin_shufflevector(x45, x67, 0, 1, 8, 9, 4, 5, 12, 13) +
                 __builtin_shufflevector(x45, x67, 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(y0, y1, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(y0, y1, 4, 5, 6, 7, 12, 13, 14, 15);
}

// r[i][j] -> r[j][i]: an 8 x 8 block of floats transposed (three rounds of pairwise shuffles).
static inline void transpose8x8(v8f* r) {
  v8f t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = __builtin_shufflevector(r[i], r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
    t[i + 1] = __builtin_shufflevector(r[i], r[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  }
  for (int i = 0; i < 8; i += 4)
    for (int k = 0; k < 2; ++k) {
      u[i + 2 * k] = __builtin_shufflevector(t[i + k], t[i + k + 2], 0, 1, 8, 9, 4, 5, 12, 13);
      u[i + 2 * k + 1] = __builtin_shufflevector(t[i + k], t[i + k + 2], 2, 3, 10, 11, 6, 7, 14, 15);
    }
  for (int k = 0; k < 4; ++k) {
    r[k] = __builtin_shufflevector(u[k], u[k + 4], 0, 1, 2, 3, 8, 9, 10, 11);
    r[k + 4] = __builtin_shufflevector(u[k], u[k + 4], 4, 5, 6, 7, 12, 13, 14, 15);
  }
}
#endif

// fold8: a whole register's (vf, see the shared header) lanes added into eight.
#if defined(__AVX512F__)
static inline v8f fold8(vf v) {
  return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
}
#else
static inline v8f fold8(vf v) { return v; }
#endif

// The decode kernel reads a block's keys (then its values) head by head, so its loads jump from slot to slot
// and the hardware prefetcher cannot follow them; each key of the next block is prefetched into L2 as the same
// key of this block is read (`next`: this head's keys or values one block further on, or null), a few lines
// at a time spread over the arithmetic. Here: the next ``count`` lines of the eight keys from key j of the
// next block (``lines`` lines per key), taken in order from line ``line`` of key j + ``key``, which move past
// them (a cursor rather than a division per line: an idiv per line was a fifth of the kernel's time).
template <typename T>
static inline void prefetch_lines(const T* next, int64_t stride, int64_t j, int64_t lines, int64_t& key,
                                  int64_t& line, int64_t count) {
  for (int64_t c = 0; c < count && key < 8; ++c) {
    __builtin_prefetch(reinterpret_cast<const char*>(next + (j + key) * stride) + line * 64, 0, 2);
    if (++line == lines) line = 0, ++key;
  }
}

// s_r[j] = q_r . k_j for NQ query rows (q_r = q + r * D, s_r = s + r * ls) and the n keys k_j = k + j *
// stride (D values each; q in fp32). The rows share each load (and bf16 widening) of a key; eight keys
// at a time share each load of q and end in one shuffle tree (hsum8x8); the rest one dot product each.
// next: see prefetch_lines (eight keys' lines over the D / VW steps, VW / 8 * sizeof(T) lines a step).
template <int NQ, typename T>
static inline void dots_f(const float* q, const T* k, int64_t stride, int64_t n, int64_t D, float* s, int64_t ls,
                          const T* next) {
  int64_t j = 0;
  const int64_t lines = std::max<int64_t>(1, D * static_cast<int64_t>(sizeof(T)) / 64);
#ifdef RTP_HSUM8X8
  if (D % VW == 0) {
    for (; j + 8 <= n; j += 8) {
      vf a[NQ][8] = {};
      const T* kj = k + j * stride;
      int64_t pk = 0, pl = 0;  // the prefetch cursor
      for (int64_t d = 0; d < D; d += VW) {
        if (next != nullptr) prefetch_lines(next, stride, j, lines, pk, pl, VW / 8 * sizeof(T));
        vf qv[NQ];
        for (int r = 0; r < NQ; ++r) qv[r] = loadv(q + r * D + d);
#pragma GCC unroll 8
        for (int u = 0; u < 8; ++u) {
          const vf kv = loadv(kj + u * stride + d);
          for (int r = 0; r < NQ; ++r) a[r][u] += qv[r] * kv;
        }
      }
      for (int r = 0; r < NQ; ++r) {
        v8f f[8];
        for (int u = 0; u < 8; ++u) f[u] = fold8(a[r][u]);
        store8(s + r * ls + j, hsum8x8(f));
      }
    }
  }
#endif
  for (; j < n; ++j)
    for (int r = 0; r < NQ; ++r) s[r * ls + j] = dot_f(q + r * D, k + j * stride, D);
}

// acc_r[0, D) += sum_j p_r[j] * v_j for NQ rows (acc_r = acc + r * D, p_r = p + r * lp) over the n values
// v_j = v + j * stride, each value loaded once for all rows: 64 outputs per row at a time stay in
// registers over all n keys (one store per 64 outputs, not one per key). next: as for dots_f, each value's
// 64 outputs' lines as they are read.
// pv_f for bf16 values with AVX-512 but not its BF16 (with it the decode kernel takes pv_pairs_dec), 32 * G outputs
// at a time: each 64-byte load of a value's 32 bf16 gives two registers of fp32 with two instructions, its 16
// even elements (a shift) and its 16 odd ones (a mask), where widening 16 at a time takes a zero-extend and a
// shift per 16. The outputs are kept in that pair-split order in
// acc (of each 32, the 16 even, then the 16 odd; decode_impl's split() reads them back in order); each output's
// sum is the same as before, in the same order. Alternated against widening 16 at a time on a 2-core Zen 4,
// Qwen3-0.6B's heads, outputs bit-identical: 32 or 8 sequences of ~600 tokens sharing 512 (the kernel
// compute-bound) 1.08-1.11x, 32 of ~160 1.01-1.06x, 8 of ~100 0.99-1.04x.
template <typename T>
static constexpr bool pair_split_values(int64_t D) {  // whether pv_f keeps a row's outputs in pair-split order
#if defined(__AVX512F__)
  return std::is_same_v<T, at::BFloat16> && D % 32 == 0;
#else
  return false;
#endif
}

#if defined(__AVX512F__)
template <int NQ, int G, typename T>
static inline void pv_split(float* acc, const float* p, int64_t lp, const T* v, int64_t stride, int64_t n, int64_t D,
                            const T* next, int64_t& d) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (; d + 32 * G <= D; d += 32 * G) {
    vf a[NQ][2 * G];
    for (int r = 0; r < NQ; ++r)
#pragma GCC unroll 8
      for (int u = 0; u < 2 * G; ++u) a[r][u] = loadv(acc + r * D + d + VW * u);
    for (int64_t j = 0; j < n; ++j) {
      const T* vj = v + j * stride + d;
      if (next != nullptr)
        for (int l = 0; l < G; ++l)
          __builtin_prefetch(reinterpret_cast<const char*>(next + j * stride + d) + l * 64, 0, 2);
      float pj[NQ];
      for (int r = 0; r < NQ; ++r) pj[r] = p[r * lp + j];
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) {
        const __m512i kv = _mm512_loadu_si512(vj + 32 * g);
        const vf ve = (vf)_mm512_slli_epi32(kv, 16), vo = (vf)_mm512_and_si512(kv, high);
        for (int r = 0; r < NQ; ++r) a[r][2 * g] += pj[r] * ve, a[r][2 * g + 1] += pj[r] * vo;
      }
    }
    for (int r = 0; r < NQ; ++r)
#pragma GCC unroll 8
      for (int u = 0; u < 2 * G; ++u) storev(acc + r * D + d + VW * u, a[r][u]);
  }
}
#endif

template <int NQ, typename T>
static inline void pv_f(float* acc, const float* p, int64_t lp, const T* v, int64_t stride, int64_t n, int64_t D,
                        const T* next) {
  int64_t d = 0;
  constexpr int NV = 64 / VW;  // vectors of 64 outputs
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (pair_split_values<T>(D)) {  // acc in pair-split order: a 64-byte load of values is 16 even + 16 odd
      pv_split<NQ, 2>(acc, p, lp, v, stride, n, D, next, d);
      pv_split<NQ, 1>(acc, p, lp, v, stride, n, D, next, d);
      return;
    }
  }
#endif
  for (; d + 64 <= D; d += 64) {
    vf a[NQ][NV];
    for (int r = 0; r < NQ; ++r)
#pragma GCC unroll 8
      for (int u = 0; u < NV; ++u) a[r][u] = loadv(acc + r * D + d + VW * u);
    for (int64_t j = 0; j < n; ++j) {
      const T* vj = v + j * stride + d;
      if (next != nullptr)
        for (int64_t l = 0; l < static_cast<int64_t>(sizeof(T)); ++l)
          __builtin_prefetch(reinterpret_cast<const char*>(next + j * stride + d) + l * 64, 0, 2);
      float pj[NQ];
      for (int r = 0; r < NQ; ++r) pj[r] = p[r * lp + j];
#pragma GCC unroll 8
      for (int u = 0; u < NV; ++u) {
        const vf vv = loadv(vj + VW * u);
        for (int r = 0; r < NQ; ++r) a[r][u] += pj[r] * vv;
      }
    }
    for (int r = 0; r < NQ; ++r)
#pragma GCC unroll 8
      for (int u = 0; u < NV; ++u) storev(acc + r * D + d + VW * u, a[r][u]);
  }
  for (int r = 0; r < NQ; ++r) {
    float* ar = acc + r * D;
    const float* pr = p + r * lp;
    for (int64_t e = d; e + 8 <= D; e += 8) {
      v8f a = load8(ar + e);
      for (int64_t j = 0; j < n; ++j) a += pr[j] * load8(v + j * stride + e);
      store8(ar + e, a);
    }
    for (int64_t e = d + (D - d) / 8 * 8; e < D; ++e) {
      float a = ar[e];
      for (int64_t j = 0; j < n; ++j) a += pr[j] * static_cast<float>(v[j * stride + e]);
      ar[e] = a;
    }
  }
}

#if defined(__AVX512BF16__) && defined(RTP_HSUM8X8)
#define RTP_PAIR_DECODE 1
// bf16 caches on CPUs with AVX-512 BF16, head dims a multiple of 32: the decode kernel in pair products
// (vdpbf16ps), read in place. Scores: a 64-byte load of q's and of a key's 32 bf16 is one vdpbf16ps (16 sums of
// two products) instead of two widenings and two FMAs; the sums are scaled in fp32 afterwards. Values: keys j and
// j + 1's 32 bf16 interleaved by two unpacks give the (v_j[d], v_j+1[d]) pairs of 16 + 16 outputs, one vdpbf16ps
// each with the pair (p_j, p_j+1) of softmax numerators rounded to bf16 (as the prompt kernel's pair tiles and
// flash attention do; the row sums stay fp32). An unpack works within 128-bit lanes, so the outputs lie in acc
// in that order: see write_pair_row.
template <int NQ>
static inline void dots_pairs(const at::BFloat16* q, const at::BFloat16* k, int64_t stride, int64_t n, int64_t D,
                              float* s, int64_t ls, const at::BFloat16* next, float scale) {
  const int64_t lines = D * 2 / 64;
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    vf a[NQ][8] = {};
    const at::BFloat16* kj = k + j * stride;
    int64_t pk = 0, pl = 0;  // the prefetch cursor: eight keys' 64-byte pieces a step
    for (int64_t d = 0; d < D; d += 32) {
      if (next != nullptr) prefetch_lines(next, stride, j, lines, pk, pl, 8);
      __m512bh qv[NQ];
      for (int r = 0; r < NQ; ++r) qv[r] = (__m512bh)_mm512_loadu_si512(q + r * D + d);
#pragma GCC unroll 8
      for (int u = 0; u < 8; ++u) {
        const __m512bh kv = (__m512bh)_mm512_loadu_si512(kj + u * stride + d);
        for (int r = 0; r < NQ; ++r) a[r][u] = (vf)_mm512_dpbf16_ps((__m512)a[r][u], qv[r], kv);
      }
    }
    for (int r = 0; r < NQ; ++r) {
      v8f f[8];
      for (int u = 0; u < 8; ++u) f[u] = fold8(a[r][u]);
      store8(s + r * ls + j, hsum8x8(f) * scale);
    }
  }
  for (; j < n; ++j)
    for (int r = 0; r < NQ; ++r) {
      __m512 a = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 32)
        a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(q + r * D + d),
                             (__m512bh)_mm512_loadu_si512(k + j * stride + d));
      s[r * ls + j] = _mm512_reduce_add_ps(a) * scale;
    }
}

// One step of pv_pairs_dec: keys j and j + 1 (TWO), or key j alone (its pair's other half zero).
template <int NQ, int G, bool TWO>
static inline void pv_pair_step(__m512 (&a)[NQ][2 * G], const at::BFloat16* p, int64_t lp, const at::BFloat16* v0,
                                int64_t stride, const at::BFloat16* next) {
  if (next != nullptr)
    for (int k = 0; k < 1 + TWO; ++k)
      for (int l = 0; l < G; ++l) __builtin_prefetch(reinterpret_cast<const char*>(next + k * stride) + l * 64, 0, 2);
  __m512bh w[NQ];
  for (int r = 0; r < NQ; ++r) {
    uint16_t lo, hi = 0;
    std::memcpy(&lo, p + r * lp, 2);
    if (TWO) std::memcpy(&hi, p + r * lp + 1, 2);
    w[r] = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(lo | static_cast<uint32_t>(hi) << 16));
  }
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) {
    const __m512i x0 = _mm512_loadu_si512(v0 + 32 * g);
    const __m512i x1 = TWO ? _mm512_loadu_si512(v0 + stride + 32 * g) : _mm512_setzero_si512();
    const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x0, x1), hi = (__m512bh)_mm512_unpackhi_epi16(x0, x1);
    for (int r = 0; r < NQ; ++r) {
      a[r][2 * g] = _mm512_dpbf16_ps(a[r][2 * g], w[r], lo);
      a[r][2 * g + 1] = _mm512_dpbf16_ps(a[r][2 * g + 1], w[r], hi);
    }
  }
}

// acc_r += sum_j p_r[j] v_j over 32 G outputs at a time from d (NQ rows, acc_r = acc + r * D; p_r = p + r * lp as
// bf16 numerators), two keys a step; an odd last key pairs with zeros. next: as pv_f's.
template <int NQ, int G>
static inline void pv_pairs_dec(float* acc, const at::BFloat16* p, int64_t lp, const at::BFloat16* v, int64_t stride,
                                int64_t n, int64_t D, const at::BFloat16* next, int64_t& d) {
  for (; d + 32 * G <= D; d += 32 * G) {
    __m512 a[NQ][2 * G];
    for (int r = 0; r < NQ; ++r)
#pragma GCC unroll 8
      for (int u = 0; u < 2 * G; ++u) a[r][u] = _mm512_loadu_ps(acc + r * D + d + 16 * u);
    const at::BFloat16* nd = next == nullptr ? nullptr : next + d;
    int64_t j = 0;
    for (; j + 2 <= n; j += 2)
      pv_pair_step<NQ, G, true>(a, p + j, lp, v + j * stride + d, stride, nd == nullptr ? nullptr : nd + j * stride);
    if (j < n)
      pv_pair_step<NQ, G, false>(a, p + j, lp, v + j * stride + d, stride, nd == nullptr ? nullptr : nd + j * stride);
    for (int r = 0; r < NQ; ++r)
#pragma GCC unroll 8
      for (int u = 0; u < 2 * G; ++u) _mm512_storeu_ps(acc + r * D + d + 16 * u, a[r][u]);
  }
}

template <int NQ>
static inline void pv_pairs_dec(float* acc, const at::BFloat16* p, int64_t lp, const at::BFloat16* v, int64_t stride,
                                int64_t n, int64_t D, const at::BFloat16* next) {
  int64_t d = 0;
  pv_pairs_dec<NQ, 4>(acc, p, lp, v, stride, n, D, next, d);
  pv_pairs_dec<NQ, 2>(acc, p, lp, v, stride, n, D, next, d);
  pv_pairs_dec<NQ, 1>(acc, p, lp, v, stride, n, D, next, d);
}
#endif

// Whether the decode kernel takes the pair products above for caches of T and head dim D.
template <typename T>
static constexpr bool pair_decode(int64_t D) {
#ifdef RTP_PAIR_DECODE
  return std::is_same_v<T, at::BFloat16> && D % 32 == 0;
#else
  return false;
#endif
}

// out[0, D) = sums in pv_pairs_dec's order, times inv, as T (bf16: called only where pair_decode<T>). Of each 32
// outputs the sums hold first the 16 that unpacklo paired (4 from each 128-bit lane: 0-3, 8-11, 16-19, 24-27),
// then the 16 of unpackhi (4-7, 12-15, ...); a whole row of 32 at a time, the two halves' lanes put back in order
// by one permute each (rounded as write_row does).
template <typename T>
static inline void write_pair_row(T* out, const float* sums, int64_t D, float inv) {
#ifdef RTP_PAIR_DECODE
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    const __m512 scale = _mm512_set1_ps(inv);
    for (int64_t d = 0; d < D; d += 32) {
      const __m512 lo = _mm512_loadu_ps(sums + d), hi = _mm512_loadu_ps(sums + d + 16);
      const __m512 a = _mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), scale);
      const __m512 b = _mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), scale);
      storev(out + d, (vf)a);
      storev(out + d + 16, (vf)b);
    }
  }
#endif
}

// out[0, D) = sums[0, D) * inv as T, a register at a time (storev rounds as a cast to T does: the same outputs as
// a cast one by one, which in perf was about a fifth of a bf16 decode call over ~100 keys; prompts level).
template <typename T>
static inline void write_row(T* out, const float* sums, int64_t D, float inv) {
  int64_t d = 0;
  for (; d + VW <= D; d += VW) storev(out + d, loadv(sums + d) * inv);
  for (; d < D; ++d) out[d] = static_cast<T>(sums[d] * inv);
}

// The largest of s[0, n) (-inf for none), a register at a time: a running maximum one float at a time waits on
// each comparison (a tenth of a bf16 decode call at 600 keys).
static inline float max_of(const float* s, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
  int64_t t = 0;
  if (n >= VW) {
    vf m = loadv(s);
    for (t = VW; t + VW <= n; t += VW) {
      const vf x = loadv(s + t);
      m = m > x ? m : x;
    }
    for (int l = 0; l < VW; ++l) mx = std::max(mx, m[l]);
  }
  for (; t < n; ++t) mx = std::max(mx, s[t]);
  return mx;
}

// Query rows scored together against one KV head: two where the registers allow (32 vector registers:
// 16 accumulators for two rows), else one.
#if defined(__AVX512F__)
constexpr int64_t ROW_PAIR = 2;
#else
constexpr int64_t ROW_PAIR = 1;
#endif

// The paged KV cache as both kernels read it. k_cache, v_cache: [num_blocks, block_size, Hkv, D], unit
// stride in D, the same strides for both (check_q_and_caches); block_tables: [B, max_blocks] int32.
template <typename T>
struct PagedCache {
  const T* k;
  const T* v;
  const int32_t* tables;
  int64_t block_size, num_kv_heads, block_stride, slot_stride, head_stride, max_blocks;

  PagedCache(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables)
      : k(k_cache.data_ptr<T>()), v(v_cache.data_ptr<T>()), tables(block_tables.data_ptr<int32_t>()),
        block_size(k_cache.size(1)), num_kv_heads(k_cache.size(2)), block_stride(k_cache.stride(0)),
        slot_stride(k_cache.stride(1)), head_stride(k_cache.stride(2)), max_blocks(block_tables.size(1)) {}

  // Element offset of KV head h of token t of sequence b; the next tokens of its block are slot_stride apart.
  int64_t offset(int64_t b, int64_t t, int64_t h) const {
    return static_cast<int64_t>(tables[b * max_blocks + t / block_size]) * block_stride + t % block_size * slot_stride +
           h * head_stride;
  }
};

#ifdef RTP_PAIR_DECODE
// The cascade pass over the keys all sequences share (defined with the prompt kernel's tiles, below), taken from
// CASCADE_MIN_SEQS sequences sharing CASCADE_MIN_KEYS keys: below, on a 2-core Zen 4 at Qwen3-0.6B's heads, it
// lost where the shared blocks came from memory (4 sequences sharing 256 keys 0.94x, 8 sharing 128 0.95x, 16
// sharing 64 0.91x: its gathers do not prefetch).
constexpr int64_t CASCADE_MIN_SEQS = 8, CASCADE_MIN_KEYS = 256;
static int64_t shared_prefix_keys(const PagedCache<at::BFloat16>& cache, const int32_t* lens, int64_t B);
static int64_t cascade_chunks(int64_t P, int64_t num_kv_heads);
static void cascade_prefix(const PagedCache<at::BFloat16>& cache, const at::BFloat16* q, int64_t B, int64_t Hq,
                           int64_t D, int64_t P, int64_t NC, float scale, float* part_max, float* part_sum,
                           float* part_acc);
#endif

template <typename T>
static void decode_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& context_lens, at::Tensor& out,
                        double scale) {
  // q, out: [B, Hq, D] contiguous; caches: [num_blocks, block_size, Hkv, D], unit stride in D;
  // block_tables: [B, max_blocks] int32; context_lens: [B] int32.
  const PagedCache<T> cache(k_cache, v_cache, block_tables);
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t block_size = cache.block_size, rep = Hq / cache.num_kv_heads, st = cache.slot_stride;
  const T* qp = q.data_ptr<T>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
  // A task is a range of a sequence's keys for all its query heads, so that it streams each block's slots
  // whole (the KV heads of a slot are adjacent): the whole sequence when there are sequences enough to keep
  // every thread busy; else each sequence's keys in S near-equal ranges (of at least 16 keys, cut at multiples
  // of 8), whose softmax sums are merged at the end (rather than a task per KV head, which reads a slice of
  // every slot: see the module's docstring).
  const bool pairs = pair_decode<T>(D), pair_split = !pairs && pair_split_values<T>(D);
  // Keys [0, P) that every sequence shares (the same leading blocks: a common prefix) are scored for all the
  // sequences at once by cascade_prefix, in NC chunks; the tasks below take each sequence's keys from P on.
  int64_t P = 0, NC = 0;
#ifdef RTP_PAIR_DECODE
  if constexpr (std::is_same_v<T, at::BFloat16>)
    if (pairs && B >= CASCADE_MIN_SEQS) {
      P = shared_prefix_keys(cache, lens, B);
      NC = P >= CASCADE_MIN_KEYS ? cascade_chunks(P, cache.num_kv_heads) : 0;
      if (NC == 0) P = 0;
    }
#endif
  int64_t longest = 1;
  for (int64_t b = 0; b < B; ++b) longest = std::max<int64_t>(longest, lens[b] - P);
  const int64_t busy = 4 * at::get_num_threads();
  const int64_t S = B >= busy ? 1 : std::max<int64_t>(1, std::min((busy + B - 1) / B, longest / 16));
  auto range = [&](int64_t task) {  // the keys [k0, k1) of task (b, s)
    const int64_t b = task / S, s = task % S, len = lens[b];
    auto cut = [&](int64_t i) { return i == S ? len : P + i * (len - P) / S / 8 * 8; };
    return std::make_pair(cut(s), cut(s + 1));
  };
  // Per part and row where a row has several (S > 1 ranges, or the cascade's chunks): the largest score, the sum
  // of exp(score - it) and the unnormalised values (in acc's order); the cascade's NC after the tasks' B S.
  const bool parts = S > 1 || NC > 0;
  std::vector<float> part_max, part_sum, part_acc;
  if (parts) {
    part_max.resize((B * S + NC * B) * Hq);
    part_sum.resize(part_max.size());
    part_acc.resize(part_max.size() * D);
  }
#ifdef RTP_PAIR_DECODE
  if constexpr (std::is_same_v<T, at::BFloat16>)
    if (NC > 0)
      cascade_prefix(cache, qp, B, Hq, D, P, NC, fscale, part_max.data() + B * S * Hq, part_sum.data() + B * S * Hq,
                     part_acc.data() + B * S * Hq * D);
#endif
  const int64_t slot_lines = (cache.num_kv_heads * cache.head_stride * static_cast<int64_t>(sizeof(T)) + 63) / 64;
  const int64_t nq = rep % ROW_PAIR == 0 ? ROW_PAIR : 1;  // rows i, i + 1 share a KV head when rep is even
  // A row's output from its fp32 sums in acc's order (pv_pairs_dec's; pv_f's pair-split one: of each 32 outputs
  // the 16 even, then the 16 odd; else in order), times inv.
  auto write_out = [&](T* out, const float* sums, float inv) {
    if (pairs) {
      write_pair_row(out, sums, D, inv);
    } else if (pair_split) {
      for (int64_t d = 0; d < D; ++d) out[d] = static_cast<T>(sums[d / 32 * 32 + d % 2 * 16 + d % 32 / 2] * inv);
    } else {
      write_row(out, sums, D, inv);
    }
  };
  at::parallel_for(0, B * S, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(pairs ? 0 : Hq * D), acc(Hq * D), scores, row_max(Hq), row_sum(Hq);
    std::vector<T> numerators;  // pairs: the softmax numerators rounded to bf16, as scores
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / S;
      const auto [k0, k1] = range(task);
      const int64_t n_keys = std::max<int64_t>(k1 - k0, 0);
      scores.resize(Hq * std::max<int64_t>(n_keys, 1));  // row i = query head i, one score per key from k0
      if (!pairs)
        for (int64_t i = 0; i < Hq * D; ++i) qf[i] = static_cast<float>(qp[b * Hq * D + i]) * fscale;
      // Key t's offset, and how many keys from t on lie in its block (t need not start the block).
      auto slot = [&](int64_t t) { return cache.offset(b, t, 0); };
      auto piece = [&](int64_t t) { return std::min(block_size - t % block_size, k1 - t); };
      // A thread's first block in one go; every later one key by key while the block before it is read
      // (dots_f, pv_f): the next block of keys, after the last of them the first block of values, after the
      // last block of values the first keys of the thread's next task.
      if (task == begin && n_keys > 0) {
        const char* p = reinterpret_cast<const char*>(cache.k + slot(k0));
        for (int64_t j = 0, n = piece(k0); j < n; ++j)
          for (int64_t l = 0; l < slot_lines; ++l) __builtin_prefetch(p + (j * st * sizeof(T)) + l * 64);
      }
      // Scores: q . k for every key, block by block (row by row; a block's keys stay in L1 across rows).
      for (int64_t t0 = k0, n; t0 < k1; t0 += n) {
        n = piece(t0);
        const T* kb = cache.k + slot(t0);
        const T* kn = t0 + n < k1 ? cache.k + slot(t0 + n) : cache.v + slot(k0);
        for (int64_t i = 0; i < Hq; i += nq) {
          const int64_t hd = (i / rep) * cache.head_stride;
          float* si = scores.data() + i * n_keys + (t0 - k0);
#ifdef RTP_PAIR_DECODE
          if constexpr (std::is_same_v<T, at::BFloat16>) {
            if (pairs) {
              const T* qi = qp + (b * Hq + i) * D;
              if (nq == 2) dots_pairs<2>(qi, kb + hd, st, n, D, si, n_keys, kn + hd, fscale);
              else dots_pairs<1>(qi, kb + hd, st, n, D, si, n_keys, kn + hd, fscale);
              continue;
            }
          }
#endif
          if (nq == 2) dots_f<2>(qf.data() + i * D, kb + hd, st, n, D, si, n_keys, kn + hd);
          else dots_f<1>(qf.data() + i * D, kb + hd, st, n, D, si, n_keys, kn + hd);
        }
      }
      // Softmax numerators exp(s - max), eight at a time, and their sums.
      for (int64_t i = 0; i < Hq; ++i) {
        float* si = scores.data() + i * n_keys;
        const float mx = max_of(si, n_keys);
        row_max[i] = mx;
        row_sum[i] = exp_shift_sum(si, n_keys, mx);
      }
#ifdef RTP_PAIR_DECODE
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        if (pairs) {  // rounded to nearest even, 16 at a time
          const int64_t total = static_cast<int64_t>(scores.size());
          numerators.resize(total);
          int64_t t = 0;
          for (; t + 16 <= total; t += 16)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(numerators.data() + t),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(scores.data() + t)));
          for (; t < total; ++t) numerators[t] = static_cast<T>(scores[t]);
        }
      }
#endif
      // The numerator-weighted sum of the values.
      std::fill(acc.begin(), acc.end(), 0.f);
      const auto next_task = task + 1 < end ? range(task + 1) : std::make_pair<int64_t, int64_t>(0, 0);
      for (int64_t t0 = k0, n; t0 < k1; t0 += n) {
        n = piece(t0);
        const T* vb = cache.v + slot(t0);
        const int64_t nb = (task + 1) / S, nt = next_task.first;  // the next task's first keys
        const T* vn = t0 + n < k1 ? cache.v + slot(t0 + n)
                      : next_task.second > nt ? cache.k + cache.offset(nb, nt, 0)
                      : nullptr;
        for (int64_t i = 0; i < Hq; i += nq) {
          const int64_t hd = (i / rep) * cache.head_stride;
          const float* pi = scores.data() + i * n_keys + (t0 - k0);
          const T* next = vn == nullptr ? nullptr : vn + hd;
#ifdef RTP_PAIR_DECODE
          if constexpr (std::is_same_v<T, at::BFloat16>) {
            if (pairs) {
              const T* ni = numerators.data() + i * n_keys + (t0 - k0);
              if (nq == 2) pv_pairs_dec<2>(acc.data() + i * D, ni, n_keys, vb + hd, st, n, D, next);
              else pv_pairs_dec<1>(acc.data() + i * D, ni, n_keys, vb + hd, st, n, D, next);
              continue;
            }
          }
#endif
          if (nq == 2) pv_f<2>(acc.data() + i * D, pi, n_keys, vb + hd, st, n, D, next);
          else pv_f<1>(acc.data() + i * D, pi, n_keys, vb + hd, st, n, D, next);
        }
      }
      if (!parts) {
        for (int64_t i = 0; i < Hq; ++i) {
          const float inv = row_sum[i] > 0.f ? 1.f / row_sum[i] : 0.f;
          write_out(op + (b * Hq + i) * D, acc.data() + i * D, inv);
        }
      } else {
        std::copy(row_max.begin(), row_max.end(), part_max.begin() + task * Hq);
        std::copy(row_sum.begin(), row_sum.end(), part_sum.begin() + task * Hq);
        std::copy(acc.begin(), acc.end(), part_acc.begin() + task * Hq * D);
      }
    }
  });
  if (!parts) return;
  // Merge the parts: out = sum_s e_s acc_s / sum_s e_s sum_s, e_s = exp(max_s - the largest max). Rows in
  // grains of 64 (a few microseconds of work; fewer rows run on this thread, without waking the others).
  at::parallel_for(0, B * Hq, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> o(D);
    std::vector<int64_t> row_parts(S + NC);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / Hq, i = row % Hq;
      for (int64_t s = 0; s < S; ++s) row_parts[s] = (b * S + s) * Hq + i;
      for (int64_t c = 0; c < NC; ++c) row_parts[S + c] = (B * S + c * B) * Hq + row;
      float top = -std::numeric_limits<float>::infinity(), total = 0.f;
      for (const int64_t part : row_parts) top = std::max(top, part_max[part]);
      std::fill(o.begin(), o.end(), 0.f);
      if (top != -std::numeric_limits<float>::infinity()) {
        for (const int64_t part : row_parts) {
          const float e = std::exp(part_max[part] - top);
          total += e * part_sum[part];
          for (int64_t d = 0; d < D; ++d) o[d] += e * part_acc[part * D + d];
        }
      }
      const float inv = total > 0.f ? 1.f / total : 0.f;
      write_out(op + row * D, o.data(), inv);
    }
  });
}

static void check_q_and_caches(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.strides() == v_cache.strides(), "bad shapes");
  TORCH_CHECK(k_cache.stride(3) == 1 && q.size(1) % k_cache.size(2) == 0 && q.size(2) == k_cache.size(3),
              "query heads/dim do not fit the cache");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share a dtype");
}

at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                           at::Tensor block_tables, at::Tensor context_lens, double scale) {
  check_q_and_caches(q, k_cache, v_cache);
  q = q.contiguous();
  auto tables = block_tables.to(at::kInt).contiguous();
  auto lens = context_lens.to(at::kInt).contiguous();
  auto out = at::empty_like(q);
  {
    // No Python object is touched below: let other threads (the heartbeat) run meanwhile.
    pybind11::gil_scoped_release no_gil;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, q.scalar_type(), "paged_decode",
                                    [&] { decode_impl<scalar_t>(q, k_cache, v_cache, tables, lens, out, scale); });
  }
  return out;
}

// Prompt attention works on tiles: a task's query rows against KB keys at a time, the keys gathered from their
// blocks into a transposed fp32 copy (kt [D][KB]) so that R rows x TW keys of scores are vector sums over D with
// one broadcast of q per row and d (no horizontal sums), the values read in place (one row of D each) and summed
// into R rows x TW outputs held in registers. Per row and KB keys, the online softmax costs one max, the
// exponentials and one rescale. R rows: PR, as many as the registers hold, then 4 or 2 for a task's last rows;
// TW: two whole registers (32 floats with AVX-512, 16 otherwise), so that each broadcast feeds two FMAs.
#if defined(__AVX512F__)
constexpr int PR = 8;
#else
constexpr int PR = 4;
#endif
constexpr int NT = 2;
constexpr int64_t KB = 64, TW = NT * VW;

// s_r[0, TW) = q_r . k_j for R rows (q_r = q + r * D, s_r = s + r * KB; k_j = column j of kt [D][KB]).
template <int R>
static inline void scores_tile(const float* q, int64_t D, const float* kt, float* s) {
  vf a[R][NT] = {};
  for (int64_t d = 0; d < D; ++d) {
    vf k[NT];
    for (int u = 0; u < NT; ++u) k[u] = loadv(kt + d * KB + u * VW);
    for (int r = 0; r < R; ++r) {
      const float qv = q[r * D + d];
      for (int u = 0; u < NT; ++u) a[r][u] += qv * k[u];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < NT; ++u) storev(s + r * KB + u * VW, a[r][u]);
}

// acc_r[d, d + NV VW) = acc_r * corr[r] + sum_{j < n} p_r[j] v_j there, for R rows (acc_r = acc + r * D,
// p_r = p + r * KB), the values v_j = v + off[j] read in place from the cache (widened to fp32 as they load).
template <int R, int NV, typename T>
static inline void pv_cols(float* acc, const float* corr, const float* p, const T* v, const int64_t* off, int64_t n,
                           int64_t D, int64_t d) {
  vf a[R][NV];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < NV; ++u) a[r][u] = loadv(acc + r * D + d + u * VW) * corr[r];
  for (int64_t j = 0; j < n; ++j) {
    vf x[NV];
    for (int u = 0; u < NV; ++u) x[u] = loadv(v + off[j] + d + u * VW);
    for (int r = 0; r < R; ++r) {
      const float pj = p[r * KB + j];
      for (int u = 0; u < NV; ++u) a[r][u] += pj * x[u];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < NV; ++u) storev(acc + r * D + d + u * VW, a[r][u]);
}

// The same over all of [0, D): TW outputs of every row at a time, then one register, then one by one.
template <int R, typename T>
static inline void pv_tile(float* acc, const float* corr, const float* p, const T* v, const int64_t* off, int64_t n,
                           int64_t D) {
  int64_t d = 0;
  for (; d + TW <= D; d += TW) pv_cols<R, NT>(acc, corr, p, v, off, n, D, d);
  for (; d + VW <= D; d += VW) pv_cols<R, 1>(acc, corr, p, v, off, n, D, d);
  for (int r = 0; r < R; ++r)
    for (int64_t e = d; e < D; ++e) {
      float a = acc[r * D + e] * corr[r];
      for (int64_t j = 0; j < n; ++j) a += p[r * KB + j] * static_cast<float>(v[off[j] + e]);
      acc[r * D + e] = a;
    }
}

// Keys j < n (at cache offsets off[j]) as fp32, transposed into kt [D][KB] (zeros past n up to whole tiles). The
// values need no copy: pv_tile reads them in place.
template <typename T>
static inline void gather_keys(const T* kc, const int64_t* off, int64_t n, int64_t D, float* kt) {
  const int64_t n_tiles = (n + TW - 1) / TW * TW;
  int64_t j = 0;
#ifdef RTP_HSUM8X8
  // Eight keys at a time: 8 x 8 blocks of them, transposed in registers. Against scalar stores down
  // kt's columns, the kernel on a 2-core Zen 4 at Qwen3-0.6B's heads: one prompt of 2000 tokens 1.11x fp32,
  // 1.13x bf16; eight of 36-109 1.16-1.18x.
  if (D % 8 == 0)
    for (; j + 8 <= n; j += 8)
      for (int64_t d = 0; d < D; d += 8) {
        v8f r[8];
        for (int u = 0; u < 8; ++u) r[u] = load8(kc + off[j + u] + d);
        transpose8x8(r);
        for (int u = 0; u < 8; ++u) store8(kt + (d + u) * KB + j, r[u]);
      }
#endif
  for (; j < n; ++j)
    for (int64_t d = 0; d < D; ++d) kt[d * KB + j] = static_cast<float>(kc[off[j] + d]);
  for (int64_t d = 0; d < D; ++d) std::fill(kt + d * KB + n, kt + d * KB + n_tiles, 0.f);
}

#if defined(__AVX512BF16__) && defined(RTP_HSUM8X8)
#define RTP_PAIR_TILES 1
// bf16 caches on CPUs with AVX-512 BF16, head dims in whole tiles: the same tiles in pair products
// (vdpbf16ps: 16 sums of two bf16 products a register, twice an fp32 FMA's work) over copies laid out in
// pairs, as 32-bit words: the keys [D / 2][KB] (inputs 2i, 2i + 1 of key j), the values [KB / 2][D] (the value d
// of keys 2m, 2m + 1). The scores are summed and scaled in fp32; the softmax numerators are rounded to bf16 for
// the value sums (as flash attention does on GPUs), their row sums stay fp32.
static inline __m512bh pair_bcast(uint32_t w) { return (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(w)); }

// Keys and values j < n (at cache offsets off[j]) into kt and vp, zeros past n up to whole tiles.
static inline void gather_pairs(const at::BFloat16* kc, const at::BFloat16* vc, const int64_t* off, int64_t n,
                                int64_t D, uint32_t* kt, uint32_t* vp) {
  const int64_t D2 = D / 2, n_tiles = (n + TW - 1) / TW * TW;
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)  // 8 keys x 8 words, transposed in registers (as bit patterns)
    for (int64_t i = 0; i < D2; i += 8) {
      v8f r[8];
      for (int u = 0; u < 8; ++u) std::memcpy(&r[u], kc + off[j + u] + 2 * i, sizeof r[u]);
      transpose8x8(r);
      for (int u = 0; u < 8; ++u) std::memcpy(kt + (i + u) * KB + j, &r[u], sizeof r[u]);
    }
  for (; j < n; ++j)
    for (int64_t i = 0; i < D2; ++i) std::memcpy(kt + i * KB + j, kc + off[j] + 2 * i, sizeof(uint32_t));
  for (int64_t i = 0; i < D2; ++i) std::fill(kt + i * KB + n, kt + i * KB + n_tiles, 0u);
  for (int64_t m = 0; 2 * m < n; ++m) {
    const at::BFloat16* a = vc + off[2 * m];
    const at::BFloat16* b = 2 * m + 1 < n ? vc + off[2 * m + 1] : nullptr;
    for (int64_t d = 0; d < D; d += 16) {
      // key 2m's value in each word's low half; key 2m + 1's in its high half: the bf16 widened to fp32 (loadv)
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + d)));
      const __m512i hi = b == nullptr ? _mm512_setzero_si512() : (__m512i)loadv(b + d);
      _mm512_storeu_si512(vp + m * D + d, _mm512_or_si512(lo, hi));
    }
  }
}

// scores_tile in pairs: s_r[0, TW) = scale * q_r . k_j (q_r = q + r * D2 words, D2 = D / 2; kt as above).
template <int R>
static inline void scores_pairs(const uint32_t* q, int64_t D2, const uint32_t* kt, float* s, float scale) {
  __m512 a[R][NT];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < NT; ++u) a[r][u] = _mm512_setzero_ps();
  for (int64_t i = 0; i < D2; ++i) {
    __m512bh k[NT];
    for (int u = 0; u < NT; ++u) k[u] = (__m512bh)_mm512_loadu_si512(kt + i * KB + u * VW);
    for (int r = 0; r < R; ++r) {
      const __m512bh x = pair_bcast(q[r * D2 + i]);
      for (int u = 0; u < NT; ++u) a[r][u] = _mm512_dpbf16_ps(a[r][u], x, k[u]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < NT; ++u) _mm512_storeu_ps(s + r * KB + u * VW, _mm512_mul_ps(a[r][u], sc));
}

// 16 softmax numerators as bf16 at p (8 words: pairs of keys).
static inline void store_bf16(uint32_t* p, vf e) {
  const __m256bh h = _mm512_cvtneps_pbh((__m512)e);
  std::memcpy(p, &h, sizeof h);
}

// pv_tile in pairs: acc_r[0, D) = acc_r * corr[r] + sum_{j < n} p_r[j] v_j (p as softmax_tile leaves it,
// vp as gather_pairs does), D a multiple of TW.
template <int R>
static inline void pv_pairs(float* acc, const float* corr, const uint32_t* p, const uint32_t* vp, int64_t n,
                            int64_t D) {
  for (int64_t d = 0; d < D; d += TW) {
    __m512 a[R][NT];
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < NT; ++u)
        a[r][u] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + d + u * VW), _mm512_set1_ps(corr[r]));
    for (int64_t m = 0; 2 * m < n; ++m) {
      __m512bh x[NT];
      for (int u = 0; u < NT; ++u) x[u] = (__m512bh)_mm512_loadu_si512(vp + m * D + d + u * VW);
      for (int r = 0; r < R; ++r) {
        const __m512bh w = pair_bcast(p[r * KB / 2 + m]);
        for (int u = 0; u < NT; ++u) a[r][u] = _mm512_dpbf16_ps(a[r][u], w, x[u]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < NT; ++u) _mm512_storeu_ps(acc + r * D + d + u * VW, a[r][u]);
  }
}
constexpr bool PAIR_TILES = true;
#else
// Without them no call is made (PAIR_TILES): empty stand-ins keep prefill_impl one code path.
constexpr bool PAIR_TILES = false;
static inline void gather_pairs(const at::BFloat16*, const at::BFloat16*, const int64_t*, int64_t, int64_t, uint32_t*,
                                uint32_t*) {}
template <int R> static inline void scores_pairs(const uint32_t*, int64_t, const uint32_t*, float*, float) {}
static inline void store_bf16(uint32_t*, vf) {}
template <int R>
static inline void pv_pairs(float*, const float*, const uint32_t*, const uint32_t*, int64_t, int64_t) {}
#endif

// The online softmax of a tile's R rows over nt scored keys (s_r[0, nt), s_r = s + r * KB), row r seeing the
// first visible[r] of them (none where <= 0): the numerators exp(s_r - m_r') (zeros past visible[r]) go to s_r,
// or with ``p`` (pair tiles) as bf16 to p_r (KB / 2 words a row, see pv_pairs); m_r' = max(m_r, its visible
// scores); l_r = l_r corr_r + their sum (in fp32), corr_r = exp(m_r - m_r') (1 where m_r stays, 0 on a row's
// first keys: m_r = -inf), m_r = m_r'.
#if defined(__AVX512F__)
// Whole registers: the masked maximum, the exponentials and their sum a register of keys at a time (expv), the
// eight rows' corrections in one exp8, the pair tiles' bf16 numerators written here (no second pass over the
// scores). With the softmax taken out, a 2000-token bf16 prompt at Qwen3-0.6B's heads ran in 17.6 ms instead of
// 29.0 (a row at a time in 8-float vectors, a libm exp per row, the masked lanes filled after, the numerators
// converted in a pass of their own); now 22.4. Alternated against that on a 2-core Zen 5: the 2000-token prompt
// 1.23-1.24x bf16 / 1.14-1.15x fp32 per call, 8 prompts of 36-109 1.20x / 1.10-1.17x, the 40M's heads (64)
// 1.40-1.44x / 1.23-1.26x.
static_assert(PR <= 8, "one v8f lane per row");
static inline __mmask16 first_lanes(int64_t k) {
  return k >= VW ? static_cast<__mmask16>(0xFFFF) : k <= 0 ? 0 : static_cast<__mmask16>((1u << k) - 1);
}
template <int R>
static inline void softmax_tile(float* s, int64_t nt, const int64_t* visible, float* m, float* l, float* corr,
                                uint32_t* p) {
  v8f m_new = {}, sums = {}, m_old = {}, l_old = {};  // a lane per row (lanes past R unused)
  for (int r = 0; r < R; ++r) {
    float* sr = s + r * KB;
    __m512 mx = _mm512_set1_ps(m[r]);
    for (int64_t j = 0; j < visible[r]; j += VW)
      mx = _mm512_mask_max_ps(mx, first_lanes(visible[r] - j), mx, _mm512_loadu_ps(sr + j));
    m_new[r] = _mm512_reduce_max_ps(mx);
    const __m512 shift = _mm512_set1_ps(m_new[r]);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < nt; j += VW) {
      const __m512 e = _mm512_maskz_mov_ps(first_lanes(visible[r] - j),
                                           (__m512)expv((vf)_mm512_sub_ps(_mm512_loadu_ps(sr + j), shift)));
      if (p != nullptr) store_bf16(p + r * KB / 2 + j / 2, (vf)e);
      else _mm512_storeu_ps(sr + j, e);
      sum = _mm512_add_ps(sum, e);
    }
    sums[r] = _mm512_reduce_add_ps(sum);
  }
  for (int r = 0; r < R; ++r) m_old[r] = m[r], l_old[r] = l[r];
  const v8f one = {1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f};
  const v8f c = m_old == m_new ? one : exp8(m_old - m_new);
  const v8f l_new = l_old * c + sums;
  for (int r = 0; r < R; ++r) corr[r] = c[r], l[r] = l_new[r], m[r] = m_new[r];
}
#else
template <int R>
static inline void softmax_tile(float* s, int64_t nt, const int64_t* visible, float* m, float* l, float* corr,
                                uint32_t*) {  // no pair tiles here
  for (int r = 0; r < R; ++r) {
    float* sr = s + r * KB;
    if (visible[r] <= 0) {
      std::fill(sr, sr + nt, 0.f);
      corr[r] = 1.f;
      continue;
    }
    const float new_m = std::max(m[r], max_of(sr, visible[r]));
    corr[r] = std::exp(m[r] - new_m);
    const float sum = exp_shift_sum(sr, visible[r], new_m);
    std::fill(sr + visible[r], sr + nt, 0.f);
    l[r] = l[r] * corr[r] + sum;
    m[r] = new_m;
  }
}
#endif

// tile(height, r0) over rows [0, rows_pad) (an even count) in tiles of PR rows, then 4, then 2, the height an
// integral_constant (the tile kernels' row count is a template argument).
template <typename F>
static inline void for_row_tiles(int64_t rows_pad, F&& tile) {
  int64_t r0 = 0;
  for (; r0 + PR <= rows_pad; r0 += PR) tile(std::integral_constant<int, PR>{}, r0);
  if constexpr (PR > 4)
    if (r0 + 4 <= rows_pad) tile(std::integral_constant<int, 4>{}, r0), r0 += 4;
  if (r0 < rows_pad) tile(std::integral_constant<int, 2>{}, r0);
}

#ifdef RTP_PAIR_DECODE
// The cascade pass. Where a decode step's sequences share their leading blocks (a system prompt in the prefix
// cache), each sequence's task would read the same keys and score them against its own query rows, a dot product
// at a time. Here each KV head's query rows of all B sequences score the shared keys together in the prompt
// kernel's pair tiles (keys gathered and transposed once per KB, then PR rows x TW keys of scores a tile), an
// online softmax over them; the result, per row, is one more part for decode_impl's merge.

// Keys in the leading blocks that every sequence's table holds alike, all before each sequence's last key.
static int64_t shared_prefix_keys(const PagedCache<at::BFloat16>& cache, const int32_t* lens, int64_t B) {
  int64_t shortest = lens[0];
  for (int64_t b = 1; b < B; ++b) shortest = std::min<int64_t>(shortest, lens[b]);
  const int64_t blocks = std::min(std::max<int64_t>(shortest - 1, 0) / cache.block_size, cache.max_blocks);
  for (int64_t k = 0; k < blocks; ++k)
    for (int64_t b = 1; b < B; ++b)
      if (cache.tables[b * cache.max_blocks + k] != cache.tables[k]) return k * cache.block_size;
  return blocks * cache.block_size;
}

// Chunks of the shared keys, so that KV heads x chunks keep every thread busy (chunks of at least KB keys).
static int64_t cascade_chunks(int64_t P, int64_t num_kv_heads) {
  const int64_t want = (2 * at::get_num_threads() + num_kv_heads - 1) / num_kv_heads;
  return std::max<int64_t>(1, std::min(want, P / KB));
}

// The acc order of the decode kernel's pair products (see write_pair_row) from outputs in order, 32 at a time.
static inline void to_pair_slots(float* out, const float* in, int64_t D) {
  const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i hi = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int64_t d = 0; d < D; d += 32) {
    const __m512 a = _mm512_loadu_ps(in + d), b = _mm512_loadu_ps(in + d + 16);
    _mm512_storeu_ps(out + d, _mm512_permutex2var_ps(a, lo, b));
    _mm512_storeu_ps(out + d + 16, _mm512_permutex2var_ps(a, hi, b));
  }
}

// Parts c = 0 .. NC - 1 of every row (b, head): the largest score, the sum and the unnormalised values over chunk c
// of the shared keys [0, P), at part_max[c B Hq + b Hq + head] (part_acc: times D, in pv_pairs_dec's order).
static void cascade_prefix(const PagedCache<at::BFloat16>& cache, const at::BFloat16* q, int64_t B, int64_t Hq,
                           int64_t D, int64_t P, int64_t NC, float scale, float* part_max, float* part_sum,
                           float* part_acc) {
  const int64_t Hkv = cache.num_kv_heads, rep = Hq / Hkv;
  const int64_t rows = B * rep, rows_pad = (rows + 1) / 2 * 2;
  const float ninf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, Hkv * NC, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(rows_pad * D), m(rows_pad), l(rows_pad), corr(rows_pad), s(rows_pad * KB);
    std::vector<uint32_t> q2(rows_pad * D / 2), ktp(D / 2 * KB), vp(KB / 2 * D), pw(PR * KB / 2);
    std::vector<int64_t> off(KB);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / NC, c = task % NC;
      const int64_t t0 = c * P / NC / KB * KB, t1 = c + 1 == NC ? P : (c + 1) * P / NC / KB * KB;
      // Row i: sequence i / rep, head h rep + i % rep (a padding row: a zero query, never read).
      for (int64_t i = 0; i < rows; ++i)
        std::memcpy(q2.data() + i * D / 2, q + ((i / rep) * Hq + h * rep + i % rep) * D, D * sizeof(at::BFloat16));
      std::fill(q2.begin() + rows * D / 2, q2.end(), 0u);
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), ninf);
      std::fill(l.begin(), l.end(), 0.f);
      for (int64_t tk = t0; tk < t1; tk += KB) {
        const int64_t n = std::min(KB, t1 - tk);
        for (int64_t j = 0; j < n; ++j) off[j] = cache.offset(0, tk + j, h);  // sequence 0's table: shared
        gather_pairs(cache.k, cache.v, off.data(), n, D, ktp.data(), vp.data());
        auto tile = [&](auto height, int64_t r0) {
          constexpr int R = decltype(height)::value;
          float* st0 = s.data() + r0 * KB;
          for (int64_t j = 0; j < n; j += TW)
            scores_pairs<R>(q2.data() + r0 * D / 2, D / 2, ktp.data() + j, st0 + j, scale);
          int64_t visible[R];
          for (int r = 0; r < R; ++r) visible[r] = n;
          softmax_tile<R>(st0, n, visible, m.data() + r0, l.data() + r0, corr.data() + r0, pw.data());
          pv_pairs<R>(acc.data() + r0 * D, corr.data() + r0, pw.data(), vp.data(), n, D);
        };
        for_row_tiles(rows_pad, tile);
      }
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t part = c * B * Hq + (i / rep) * Hq + h * rep + i % rep;
        part_max[part] = m[i];
        part_sum[part] = l[i];
        to_pair_slots(part_acc + part * D, acc.data() + i * D, D);
      }
    }
  });
}
#endif

template <typename T>
static void prefill_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& block_tables, const at::Tensor& cu_q, const at::Tensor& k_lens,
                         at::Tensor& out, double scale) {
  // q, out: [T, Hq, D] contiguous; sequence b's q_len = cu_q[b+1] - cu_q[b] queries sit at the end of
  // its k_lens[b] cached keys (positions k_len - q_len ..), causal. One task per (sequence, KV head,
  // chunk of QC queries): an online softmax over the keys, KB at a time, in fp32. Every task gathers the
  // keys it sees into kt (the values are read in place); chunks of 128 queries (256 rows at GQA 2:1) share
  // each gather among more rows than chunks of 32 (see the numbers at the task queue below).
  constexpr int64_t QC = 128;
  const PagedCache<T> cache(k_cache, v_cache, block_tables);
  const int64_t B = k_lens.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t Hkv = cache.num_kv_heads, rep = Hq / Hkv;
  const T* qp = q.data_ptr<T>();
  const int32_t* cu = cu_q.data_ptr<int32_t>();
  const int32_t* lens = k_lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale), ninf = -std::numeric_limits<float>::infinity();
  // Tasks: (b, chunk) pairs, times Hkv. A chunk's work grows with the position of its last query (causal), so
  // the chunks go by descending last position and each thread takes the next task when it is free: split
  // in contiguous ranges, one thread had a long prompt's early chunks and the other its late ones (three
  // times the work). Both changes against chunks of 32 in contiguous ranges, on a 2-core Zen 4 at Qwen3-0.6B's
  // heads: one prompt of 2000 tokens 2.0-2.1x fp32 / 1.6-1.8x bf16, one of 300 1.5-1.6x, four of 300-600
  // 1.15-1.2x, eight of 36-109 1.0-1.26x.
  std::vector<int64_t> task_seq, task_q0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t q0 = cu[b]; q0 < cu[b + 1]; q0 += QC) { task_seq.push_back(b); task_q0.push_back(q0); }
  const int64_t num_chunks = static_cast<int64_t>(task_seq.size()), num_tasks = num_chunks * Hkv;
  auto chunk_end = [&](int64_t c) {  // the position of chunk c's last query
    const int64_t b = task_seq[c];
    return lens[b] - cu[b + 1] + std::min<int64_t>(cu[b + 1], task_q0[c] + QC) - 1;
  };
  std::vector<int64_t> order(num_chunks);
  for (int64_t c = 0; c < num_chunks; ++c) order[c] = c;
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return chunk_end(x) > chunk_end(y); });
  std::atomic<int64_t> next_task{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_tasks), 1, [&](int64_t, int64_t) {
    // Rows padded to pairs (padding row: a zero query, never written out), in tiles of PR rows, then 4, then 2.
    const int64_t rows_max = (QC * rep + PR - 1) / PR * PR;
    std::vector<float> acc(rows_max * D), m(rows_max), l(rows_max), corr(rows_max), s(rows_max * KB);
    std::vector<int64_t> pos(rows_max), off(KB);  // off: the gathered keys' (and values') cache offsets
    // The copies one tile kind reads: fp32 queries (scaled) and keys (gather_keys), or the pair tiles' queries as
    // words (unscaled), keys, values (gather_pairs) and numerators.
    const bool pairs = PAIR_TILES && std::is_same_v<T, at::BFloat16> && D % TW == 0;
    std::vector<float> qf(pairs ? 0 : rows_max * D), kt(pairs ? 0 : D * KB);
    std::vector<uint32_t> q2(pairs ? rows_max * D / 2 : 0), ktp(pairs ? D / 2 * KB : 0), vp(pairs ? KB / 2 * D : 0),
        pw(pairs ? PR * KB / 2 : 0);
    for (int64_t task; (task = next_task.fetch_add(1)) < num_tasks;) {
      const int64_t c = order[task / Hkv], h = task % Hkv, b = task_seq[c], q0 = task_q0[c];
      const int64_t qn = std::min<int64_t>(QC, cu[b + 1] - q0);
      const int64_t k_len = lens[b], first_pos = k_len - (cu[b + 1] - cu[b]);  // position of query cu[b]
      // Row i: query i / rep, head h * rep + i % rep.
      const int64_t rows = qn * rep, rows_pad = (rows + 1) / 2 * 2;
      for (int64_t i = 0; i < rows; ++i) {
        const T* src = qp + ((q0 + i / rep) * Hq + h * rep + i % rep) * D;
        if (pairs) {
          std::memcpy(q2.data() + i * D / 2, src, D * sizeof(T));
          continue;
        }
        float* dst = qf.data() + i * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]) * fscale;
      }
      if (pairs) std::fill(q2.begin() + rows * D / 2, q2.begin() + rows_pad * D / 2, 0u);
      else std::fill(qf.begin() + rows * D, qf.begin() + rows_pad * D, 0.f);
      for (int64_t i = 0; i < rows_pad; ++i) pos[i] = first_pos + (q0 - cu[b]) + std::min(i, rows - 1) / rep;
      std::fill(acc.begin(), acc.begin() + rows_pad * D, 0.f);
      std::fill(m.begin(), m.begin() + rows_pad, ninf);
      std::fill(l.begin(), l.begin() + rows_pad, 0.f);
      const int64_t last_pos = pos[rows - 1];  // the task's last query sees keys <= it
      for (int64_t tk = 0; tk <= last_pos; tk += KB) {
        // Keys tk .. tk + n - 1, gathered from their blocks (gather_keys, gather_pairs).
        const int64_t n = std::min(KB, last_pos + 1 - tk);
        for (int64_t j = 0; j < n; ++j) off[j] = cache.offset(b, tk + j, h);
        if (pairs)
          gather_pairs(reinterpret_cast<const at::BFloat16*>(cache.k), reinterpret_cast<const at::BFloat16*>(cache.v),
                       off.data(), n, D, ktp.data(), vp.data());
        else
          gather_keys(cache.k, off.data(), n, D, kt.data());
        // The R rows from r0 against these keys. Every row takes the same operations in every tile height, so
        // a row's output does not depend on the rows beside it (see model.batch_invariant).
        auto tile = [&](auto height, int64_t r0) {
          constexpr int R = decltype(height)::value;
          if (pos[r0 + R - 1] < tk) return;  // none of its rows sees these keys (positions ascend with the row)
          // The tile's rows see the first nt of these keys at most (fewer on the diagonal).
          const int64_t nt = std::min(n, pos[r0 + R - 1] + 1 - tk);
          float* st0 = s.data() + r0 * KB;
          for (int64_t j = 0; j < nt; j += TW) {
            if (pairs) scores_pairs<R>(q2.data() + r0 * D / 2, D / 2, ktp.data() + j, st0 + j, fscale);
            else scores_tile<R>(qf.data() + r0 * D, D, kt.data() + j, st0 + j);
          }
          int64_t visible[R];  // keys past a row's position count as exp(-inf) = 0
          for (int r = 0; r < R; ++r) visible[r] = std::min(nt, pos[r0 + r] + 1 - tk);
          softmax_tile<R>(st0, nt, visible, m.data() + r0, l.data() + r0, corr.data() + r0,
                          pairs ? pw.data() : nullptr);
          if (pairs) pv_pairs<R>(acc.data() + r0 * D, corr.data() + r0, pw.data(), vp.data(), nt, D);
          else pv_tile<R>(acc.data() + r0 * D, corr.data() + r0, st0, cache.v, off.data(), nt, D);
        };
        for_row_tiles(rows_pad, tile);
      }
      for (int64_t i = 0; i < rows; ++i) {
        const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
        write_row(op + ((q0 + i / rep) * Hq + h * rep + i % rep) * D, acc.data() + i * D, D, inv);
      }
    }
  });
}

at::Tensor paged_prefill(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                            at::Tensor block_tables, at::Tensor cu_seqlens_q, at::Tensor k_lens,
                            double scale) {
  check_q_and_caches(q, k_cache, v_cache);
  TORCH_CHECK(cu_seqlens_q.numel() == k_lens.numel() + 1 && block_tables.size(0) == k_lens.numel(),
              "one cu_seqlens_q entry per sequence plus one, one block table and key length per sequence");
  q = q.contiguous();
  auto tables = block_tables.to(at::kInt).contiguous();
  auto cu = cu_seqlens_q.to(at::kInt).contiguous();
  auto lens = k_lens.to(at::kInt).contiguous();
  TORCH_CHECK(cu[-1].item<int64_t>() == q.size(0), "cu_seqlens_q must end at the number of query tokens");
  auto out = at::empty_like(q);
  {
    pybind11::gil_scoped_release no_gil;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, q.scalar_type(), "paged_prefill",
                                    [&] { prefill_impl<scalar_t>(q, k_cache, v_cache, tables, cu, lens, out, scale); });
  }
  return out;
}
"""


@functools.lru_cache(maxsize=1)
def load() -> ModuleType | None:
    """Build (first use) and import the kernel; None where it cannot be built (the torch path stays)."""
    # a * b + c contracted into one FMA in the dot products (C++17 mode turns it off by default).
    return build("cpu_attention", _SOURCE, ["paged_decode", "paged_prefill"], extra_cflags=("-ffp-contract=fast",))


def _kernel() -> ModuleType:
    module = load()
    if module is None:
        raise RuntimeError("the CPU paged-attention kernel is not available on this machine")
    return module


def paged_decode_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``q [B, Hq, D]`` attends its sequence's ``context_lens[b]`` cached keys; returns ``[B, Hq, D]``."""
    return _kernel().paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale)


def paged_prefill_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal varlen attention over the paged cache: sequence b's queries ``q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]``
    are the last of its ``context_lens[b]`` keys (a cached prefix, earlier chunks, or none before them).

    ``q [T, Hq, D]``; the step's own keys must already be stored in the cache. Returns ``[T, Hq, D]``.
    """
    return _kernel().paged_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale)
