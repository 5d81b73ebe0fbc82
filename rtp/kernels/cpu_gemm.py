"""Linear layers for CPUs: a small C++ GEMM over weights packed once into column panels.

A decode step only needs to stream its weights once, and oneDNN's fp32 kernels do not keep up
with memory at decode shapes (M = 1-32 rows): about 12 GB/s and 50 GFLOP/s at M = 8 on a 2-core
AVX2 AMD EPYC. On a 2-core AVX-512 Xeon this kernel runs a 12-layer loop of Qwen3-0.6B's linears
1.1-1.5x as fast as oneDNN at 1-32 rows, level with it at 64 and 0.84x at 256, where oneDNN's kernels are
compute-bound and closer to the FMA peak (for small weights that stay in cache, such as the 3.4M
default model's, oneDNN leads from ~64 rows).

The weight ``[N, K]`` is re-laid out at load as panels of ``NR`` output columns, ``[ceil(N / NR), K, NR]``:
NR = 64 on AVX-512 (a register tile of 6 rows x 4 zmm vectors), 16 elsewhere (6 rows x 2 ymm), one fused
multiply-add per weight and row either way. K is cut in slices of 1024 (bf16 pair panels: 2048) so that the
panel slice stays in L2 while every row tile of the batch (at most 6 rows, of equal sizes above 12; on a Zen 4
also at 7-9) reuses it (at 7-9 rows in slices of 64 where a tail cannot prefetch, in L1: see KC_SHORT); panels
are spread over the threads. The tiles also prefetch the next slice of weights from memory where that measured
faster (see PF_MIN_ROWS). Prompt steps run in equal blocks of at most 240 rows, so that the rows a panel reads
come from L2.

A SwiGLU's gate ‖ up weight can be packed with each panel holding NR / 2 gate columns and the same
up columns (:func:`pack` with ``gate_up``): :func:`silu_mul` then writes ``silu(gate) * up`` from the sums
in the tile's buffer, and the ``[M, 2I]`` product never goes through memory.

Weights may be float32, bfloat16 or int8 (bf16 and int8 are widened to fp32 in
registers: half or a quarter of the bytes to stream, fp32 arithmetic, so it also
serves CPUs without native bf16 or int8 dot products). int8 panels come with a
per-output-column scale, applied once per output. Activations are computed in
fp32; the output has the input's dtype.

Where the CPU has AVX-512 BF16, bf16 weights are packed in pairs of inputs, ``[ceil(N / NR),
ceil(K / 2), NR, 2]`` (:func:`pack` with ``pairs``), and the tiles multiply bf16 rows with
``vdpbf16ps`` (two products per lane and instruction, summed in fp32), writing bf16 outputs
directly. On a 2-core Zen 4, 12 layers of Qwen3-0.6B's linears against oneDNN's bf16: 1.3-1.5x at
1 row, 1.1-1.2x at 4-8, level at 16-64, 0.92-0.95x at 256-2048 rows.

Where the CPU also has AMX and Linux grants the tile state (:func:`has_amx`), the same pair panels are
multiplied on AMX tiles (``amx_tile``: 16 rows x 64 columns a pass, the weights prefetched 8 KB ahead), whose
arithmetic is no limit at decode shapes. On a 2-core AMX Xeon, where ``vdpbf16ps`` runs at one instruction a
cycle (the pair tiles peak at ~215 GFLOP/s there, compute-bound from 2 rows), 28 layers of Qwen3-0.6B's bf16
linears against oneDNN's (AMX) kernels: 0.81-0.90x its time at 1-32 rows (26 against 22 GB/s), 0.87-0.98x at
64-128, 1.1-1.35x at 256-1024 (prompt steps: ~1.6 against ~2.0 TFLOP/s).

:func:`available` says whether the kernel built (on first use, like the CPU
attention kernel); where it did not, the runtime keeps oneDNN or ``F.linear``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType

import torch

from rtp.kernels.cpu_build import build
from rtp.kernels.cpu_features import zen4
from rtp.kernels.cpu_simd import AMX_HEADER, SIMD_HEADER
from rtp.kernels.host_memory import in_huge_pages

_SOURCE = SIMD_HEADER + AMX_HEADER + r"""
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

// A register tile is MR rows x NV vectors of VW floats (vf, loadv: the shared header's whole registers): one
// panel of NR = NV * VW output columns. AVX-512: 6 x 4 zmm (64 columns); otherwise 6 x 2 ymm (16 columns). 24
// or 12 accumulators. int8 weights are sign-extended to int32 lanes, then converted.
#if defined(__AVX512F__)
constexpr int NV = 4;
static inline vf loadv(const int8_t* p) {
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
#else
constexpr int NV = 2;
static inline vf loadv(const int8_t* p) {
  // one vpmovsxbd + vcvtdq2ps on AVX2 (converting an 8-byte vector directly compiles to a scalar
  // conversion per lane)
  typedef int32_t v8i __attribute__((vector_size(32)));
  const v8i v = {p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]};
  return __builtin_convertvector(v, vf);
}
#endif
// K slices of KC (fp32 panels: 256 KB of weights on AVX-512, in L2). Against slices of 256 (a slice in
// L1/L2), on a Zen 4, 28 layers of Qwen3-0.6B's fp32 linears, alternated in one process: 1.0-1.07x at
// 1-16 rows, 1.01-1.04x at 24-583 (fewer passes of each row tile's sums through memory); the 40M's
// linears 1.0x at 1-8 rows, 1.01-1.03x at 24-1560; int8 panels 1.0-1.035x; the AVX2 build level (0.98-1.03x).
constexpr int64_t NR = NV * VW, MR = 6, KC = 1024, MB = 240, MB_PAIRS = 960;
// Pair panels take K in slices of up to KC_PAIRS (256 KB of weights, in L2): on a Zen 4, 28 layers of
// Qwen3-0.6B's bf16 linears ran 1.25x as fast as with slices of 256 at 1-8 rows, 1.1x at 32, 1.05x at
// 256-960.
constexpr int64_t KC_PAIRS = 2048;
// Pair panels on AMX tiles (see amx_tile): rows in tiles of AMX_ROWS, in row blocks of at most AMX_MB.
constexpr int64_t AMX_ROWS = 16, AMX_MB = 512;
// Software prefetch of the weights (see gemm_impl): below PF_MIN_ROWS rows only from the row tiles after
// the first with at least PF_LATE_ROWS rows, into L2; into L1 up to PF_L1_MAX_ROWS, into L2 above. On an
// AVX-512 BF16 Zen 4 the hardware prefetcher keeps up with few rows and a prefetch from every tile got in
// its way: 28 layers of Qwen3-0.6B's fp32 linears at 8 rows ran 1.2-1.4x as fast without it (31-39 against
// 25-28 GB/s), level at 16; at 24-32 rows it still gains up to 1.14x. The same on a 2-core AVX2 Zen 3, 28 layers of
// Qwen3-0.6B's linears and its LM head, alternated in one process: fp32 1.24-1.36x at 7-9 rows (8 rows had run
// slower than 12: 122 against 114 ms), 1.07-1.10x at 1-4 and 16, level at 6, 12 and 24-32; bf16 1.13-1.23x at 1-9
// rows, level at 12-16. AVX-512 builds without BF16 (the Xeon above) keep a prefetch from every tile.
constexpr int64_t PF_L1_MAX_ROWS = 48, PF_LATE_ROWS = 4;
#if defined(__AVX512BF16__) || !defined(__AVX512F__)
constexpr int64_t PF_MIN_ROWS = 17;
#else
constexpr int64_t PF_MIN_ROWS = 0;
#endif
// Below PF_MIN_ROWS, from PF_AHEAD_MIN_ROWS rows, the first row tile (the one that streams the weights from
// memory) also prefetches the lines PF_AHEAD k steps ahead of the ones it reads. At 8 rows its arithmetic keeps
// it from issuing loads early enough for memory to stay busy (the hardware prefetcher alone overlapped little of
// it). On a 2-core Zen 5, 28 layers of Qwen3-0.6B's linears, alternated: bf16 pair panels 1.06x at 4 rows, 1.12x
// at 8, 1.10x at 16 (1.04-1.09x while the host's memory ran at ~47 rather than ~75 GB/s); fp32 1.08-1.09x at
// 4-16; level at 32 (not prefetching) and at 1 row (prefetching there measured 0.93-0.97x, hence the bound).
//
// A Zen 4 (RTP_ZEN4: AVX-512 on 256-bit units, half a Zen 5's arithmetic a cycle) takes neither the look-ahead
// nor, at 7-9 rows, a six-row first tile (see gemm_impl): there the tiles' arithmetic, not memory, sets the pace,
// and a prefetch instruction or a tail tile of 1-3 rows costs more than it hides. On a 2-core Zen 4, 28 layers
// of Qwen3-0.6B's linears and its LM head, alternated in one process: without the look-ahead bf16 pair panels
// 1.07-1.10x at 4-6 rows, fp32 1.04-1.18x, 1.0-1.03x at 8-16.
constexpr int64_t PF_AHEAD = 32;
#ifdef RTP_ZEN4
constexpr int64_t PF_AHEAD_MIN_ROWS = PF_MIN_ROWS, EQUAL_TILES_MIN_ROWS = MR + 1;
#else
constexpr int64_t PF_AHEAD_MIN_ROWS = 4, EQUAL_TILES_MIN_ROWS = 2 * MR + 1;
#endif
// K slices of KC_SHORT where one row tile streams the weights and a tail too small to prefetch follows it (7-9
// rows, a Zen 4's 7 rows as 4 + 3: see gemm_impl): in long slices the tail re-reads each slice from L2 while memory
// idles; in short ones it reads it from L1 right after the streaming tile, whose look-ahead (into the next slice) keeps
// memory busy meanwhile. On a 2-core Zen 5, 28 layers of Qwen3-0.6B's linears, alternated in one process: bf16
// 1.06-1.13x at 7-9 rows, fp32 1.08-1.13x (1.03-1.09x while the host's memory ran slow); level at 1-6. Not with more
// rows: at 32, slices of 32-128 cost 0.58-0.84x (every tile's sums through memory once a slice).
constexpr int64_t KC_SHORT = 64;


// The weight lines PF_AHEAD k steps after those at w_k, one step being ``step_bytes`` (a pair step in pair
// panels). The panel and this thread's next ones are contiguous; a prefetch past the weight's end is harmless.
static inline void prefetch_ahead(const void* w_k, int64_t step_bytes) {
  const char* p = static_cast<const char*>(w_k) + PF_AHEAD * step_bytes;
  for (int64_t q = 0; q < step_bytes; q += 64) __builtin_prefetch(p + q);
}

// acc[r, :NR] += x[r, k0:k0+kc] . w_panel[k0:k0+kc, :NR] for R rows (fresh: acc = the products, acc not read).
template <int R, typename W>
static inline void tile(const float* x, int64_t ldx, const W* w, int64_t kc, float* acc, const char* pf,
                        int64_t npf, bool to_l1, bool ahead, bool fresh) {
  vf a[R][NV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) a[r][j] = fresh ? vf{} : loadv(acc + r * NR + j * VW);
  for (int64_t k = 0; k < kc; ++k) {
    if (ahead) prefetch_ahead(w + k * NR, NR * sizeof(W));
    if (k < npf) {  // a line of the next weight slice (see gemm_impl)
      if (to_l1) __builtin_prefetch(pf + k * 64);
      else __builtin_prefetch(pf + k * 64, 0, 2);
    }
    vf v[NV];
    for (int j = 0; j < NV; ++j) v[j] = loadv(w + k * NR + j * VW);
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * ldx + k];
      for (int j = 0; j < NV; ++j) a[r][j] += xv * v[j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) storev(acc + r * NR + j * VW, a[r][j]);
}

#if defined(__AVX512BF16__)
#define RTP_BF16_DOT 1
// The same tile for bf16 x and bf16 weights packed in pairs of inputs, [K / 2, NR, 2] per panel: one
// vdpbf16ps multiplies 16 columns x 2 inputs and adds both products to fp32 sums, twice an fp32 FMA's work.
// Prefetches as the fp32 tile does (one line of the next slice a pair step, and ``ahead``). On a 2-core Zen 5,
// 28 layers of Qwen3-0.6B's bf16 linears, alternated, with the next-slice prefetch against without: 1.18-1.31x
// at 24-32 rows, 1.10x at 64, 1.04-1.10x at 12-16, level at 256-583 (on the Zen 4 host the pair tiles were
// written on, a prefetch from every tile cost 0.8x at 8 rows; rows below PF_MIN_ROWS no longer do that).
template <int R>
static inline void tile(const at::BFloat16* x, int64_t ldx, const at::BFloat16* w, int64_t kc, float* acc,
                        const char* pf, int64_t npf, bool to_l1, bool ahead, bool fresh) {
  __m512 a[R][NV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) a[r][j] = fresh ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + r * NR + j * VW);
  for (int64_t kp = 0; kp < kc / 2; ++kp) {
    if (ahead) prefetch_ahead(w + kp * NR * 2, NR * 2 * sizeof(at::BFloat16));
    if (kp < npf) {
      if (to_l1) __builtin_prefetch(pf + kp * 64);
      else __builtin_prefetch(pf + kp * 64, 0, 2);
    }
    __m512bh v[NV];
    for (int j = 0; j < NV; ++j) v[j] = (__m512bh)_mm512_loadu_si512(w + (kp * NR + j * VW) * 2);
    for (int r = 0; r < R; ++r) {
      int32_t pair;  // inputs 2 kp and 2 kp + 1 of row r
      std::memcpy(&pair, x + r * ldx + 2 * kp, sizeof pair);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NV; ++j) a[r][j] = _mm512_dpbf16_ps(a[r][j], xv, v[j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc + r * NR + j * VW, a[r][j]);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define RTP_AMX_PAIRS 1
// AMX (Sapphire Rapids and later) over the same pair panels: one tdpbf16ps multiplies 16 rows x 32 inputs by
// 32 inputs x 16 columns into fp32 sums. A pair panel's 16 pair rows x 16 columns are a B tile as they lie
// (rows NR * 4 bytes apart), so four C tiles hold 16 rows x NR = 64 columns. The arithmetic is ~16x the
// vdpbf16ps tiles' a cycle: at decode shapes a step is the weight stream alone, which the first row block
// prefetches AMX_PF_AHEAD bytes ahead (the hardware prefetcher alone left memory idle between tile loads).
constexpr int64_t AMX_K = 32, AMX_PF_AHEAD = 8192;

// acc[16, NR] (row stride NR) += x[16 rows, 0:k32] . panel[0:k32, :NR], x's rows ldx apart; k32 a multiple of 32.
static inline void amx_tile(const at::BFloat16* x, int64_t ldx, const at::BFloat16* w, int64_t k32, float* acc,
                            int64_t pf_bytes) {
  static_assert(NR == 64, "four 16-column C tiles a panel");
  constexpr int64_t ldc = NR * sizeof(float);  // (tile numbers are immediates: no loops over tiles)
  _tile_loadd(0, acc, ldc); _tile_loadd(1, acc + 16, ldc); _tile_loadd(2, acc + 32, ldc); _tile_loadd(3, acc + 48, ldc);
  for (int64_t k = 0; k < k32; k += AMX_K) {
    const at::BFloat16* wk = w + k * NR;  // pair row k / 2, 16 pair rows x NR columns x 2 = 4 KB
    if (pf_bytes) {
      const char* pf = reinterpret_cast<const char*>(wk) + pf_bytes;
      for (int64_t line = 0; line < AMX_K * NR * 2; line += 64) __builtin_prefetch(pf + line);
    }
    _tile_loadd(4, x + k, ldx * sizeof(at::BFloat16));
    _tile_loadd(5, wk, NR * 4);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, wk + 32, NR * 4);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(7, wk + 64, NR * 4);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, wk + 96, NR * 4);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, acc, ldc); _tile_stored(1, acc + 16, ldc); _tile_stored(2, acc + 32, ldc);
  _tile_stored(3, acc + 48, ldc);
}
#endif
#endif

// One row tile of ``rows`` rows: fp32 rows, or bf16 rows over pair panels (the weights are pairs whenever x is
// bf16, see gemm()).
template <typename X, typename W>
static void tile_rows(int64_t rows, const X* x, int64_t ldx, const W* w, int64_t kc, float* acc,
                      const char* pf, int64_t npf, bool to_l1, bool ahead, bool fresh) {
  switch (rows) {
    case 6: tile<6>(x, ldx, w, kc, acc, pf, npf, to_l1, ahead, fresh); break;
    case 5: tile<5>(x, ldx, w, kc, acc, pf, npf, to_l1, ahead, fresh); break;
    case 4: tile<4>(x, ldx, w, kc, acc, pf, npf, to_l1, ahead, fresh); break;
    case 3: tile<3>(x, ldx, w, kc, acc, pf, npf, to_l1, ahead, fresh); break;
    case 2: tile<2>(x, ldx, w, kc, acc, pf, npf, to_l1, ahead, fresh); break;
    default: tile<1>(x, ldx, w, kc, acc, pf, npf, to_l1, ahead, fresh); break;
  }
}

// n outputs of one row, from the fp32 sums: as they are, or rounded to bf16 (to nearest even).
static inline void store_row(float* y, const float* acc, int64_t n) { std::memcpy(y, acc, n * sizeof(float)); }
static inline void store_row(at::BFloat16* y, const float* acc, int64_t n) {
  int64_t j = 0;
#ifdef RTP_BF16_DOT
  for (; j + 16 <= n; j += 16)
    _mm256_storeu_si256((__m256i*)(y + j), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(acc + j)));
#endif
  for (; j < n; ++j) y[j] = at::BFloat16(acc[j]);
}

// y[j] = silu(g[j]) * u[j] for n outputs of one row from the fp32 sums of its gate and up columns, rounded
// to Y wherever the unfused path (the product stored in Y, then silu_and_mul in Y) rounds: the same steps in
// whole registers (expv's polynomial may be contracted into FMAs differently in the two builds: a last-bit
// difference).
template <typename Y>
static inline void store_silu_mul(Y* y, const float* g, const float* u, int64_t n) {
  int64_t j = 0;
  for (; j + VW <= n; j += VW) {
    const vf gv = round_v<Y>(loadv(g + j));
    storev(y + j, round_v<Y>(gv / (1.f + expv(-gv))) * round_v<Y>(loadv(u + j)));
  }
  for (; j < n; ++j) {
    const float gv = static_cast<float>(static_cast<Y>(g[j])), uv = static_cast<float>(static_cast<Y>(u[j]));
    y[j] = static_cast<Y>(static_cast<float>(static_cast<Y>(gv / (1.f + std::exp(-gv)))) * uv);
  }
}

// Panels of a gate ‖ up weight (see pack() in Python, gate_up): panel p holds gate columns p NR/2 .. p NR/2 +
// NR/2 - 1 in its first half and the same up columns in its second. GLU_SPLIT writes the product in the
// checkpoint's order ([M, 2I] = gate ‖ up), GLU_SILU_MUL writes silu(gate) * up ([M, I]).
enum Glu : int64_t { GLU_NONE = 0, GLU_SPLIT = 1, GLU_SILU_MUL = 2 };

// Panel p's fp32 sums acc [M, NR] before the products: the bias where it is the start (bias_first), else zero.
static void start_sums(std::vector<float>& acc, int64_t p, const float* bias, bool bias_first, int64_t M,
                       int64_t N) {
  const int64_t n0 = p * NR, nc = std::min(NR, N - n0);
  std::fill(acc.begin(), acc.end(), 0.f);
  if (bias_first)
    for (int64_t m = 0; m < M; ++m) std::memcpy(acc.data() + m * NR, bias + n0, nc * sizeof(float));
}

// Panel p's outputs from its fp32 sums acc [M, NR]: times the scale, plus the bias where there is a scale (without
// one the bias was the sums' start), written to y [M, N] as glu says.
template <typename Y>
static void store_panel(float* acc, int64_t p, const float* bias, const float* scale, Y* y, int64_t M, int64_t N,
                        Glu glu) {
  const int64_t n0 = p * NR, nc = std::min(NR, N - n0);
  if (scale != nullptr)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t j = 0; j < nc; ++j)
        acc[m * NR + j] = acc[m * NR + j] * scale[n0 + j] + (bias != nullptr ? bias[n0 + j] : 0.f);
  if (glu == GLU_NONE) {
    for (int64_t m = 0; m < M; ++m) store_row(y + m * N + n0, acc + m * NR, nc);
    return;
  }
  const int64_t h = NR / 2, I = N / 2, g0 = p * h, gc = std::min(h, I - g0);
  for (int64_t m = 0; m < M; ++m) {
    const float* a = acc + m * NR;
    if (glu == GLU_SPLIT) {
      store_row(y + m * N + g0, a, gc);
      store_row(y + m * N + I + g0, a + h, gc);
    } else {
      store_silu_mul(y + m * I + g0, a, a + h, gc);
    }
  }
}

template <typename X, typename W, typename Y>
static void gemm_impl(const X* x, const W* wp, const float* bias, const float* scale, Y* y, int64_t M,
                      int64_t N, int64_t K, Glu glu) {
  // x: [M, K] fp32 (or bf16 with pair panels); wp: [ceil(N / NR), K, NR] (pairs: [.., K / 2, NR, 2], the
  // same offsets); y: [M, N] fp32 or bf16 = (x wᵀ) * scale + bias (scale: [N] or null), summed in fp32;
  // gate ‖ up panels (glu): N = 2I, no bias or scale, y as Glu says.
  const int64_t panels = (N + NR - 1) / NR;
  constexpr bool pair_tiles = std::is_same_v<X, at::BFloat16>;  // bf16 rows: pair panels
  // Which row tiles prefetch the next weight slice (see the K loop below): all of them from PF_MIN_ROWS rows,
  // below that only the tiles after the first with at least PF_LATE_ROWS rows.
  const bool few = M < PF_MIN_ROWS;
  // Above 2 MR rows, the rows in ceil(M / MR) tiles of as equal sizes as they go (tile t: rows tile_m0(t) ..
  // tile_m0(t + 1) - 1): a tile of one or two rows re-reads the panel slice from L2 for little arithmetic. Against
  // full tiles and a remainder, on a 2-core Zen 5, alternated: 28 layers of Qwen3-0.6B's linears fp32 1.11x at 20
  // rows, 1.15x at 25 (6 x 4 + 1 -> 5 x 5), 1.02-1.04x at 32-44, level at 13; bf16 pair panels 1.04-1.16x at
  // 13-44; int8 1.0-1.03x; its LM head 1.06-1.2x at 13-32 rows. At 7-12 rows the first tile streams the weights
  // and keeps six rows (4 + 3 at 7 rows measured 0.88x on the LM head there). A Zen 4 (EQUAL_TILES_MIN_ROWS) takes
  // 7-9 rows as 4 + 3, 4 + 4 and 5 + 4 instead of a six-row tile and a tail of 1-3: 28 layers of Qwen3-0.6B's
  // linears and its LM head, alternated in one process: bf16 pair panels 1.19-1.56x at 7 rows, 1.25-1.27x at 8-9,
  // fp32 1.23x at 7, 1.27-1.30x at 8-9 (8 rows had run slower than 12), int8 level; equal tiles at 10-11 rows
  // measured 0.97-0.99x there.
  const int64_t tiles = (M + MR - 1) / MR;
  const bool equal_tiles = M >= EQUAL_TILES_MIN_ROWS && (M > 2 * MR || M - MR < PF_LATE_ROWS);
  auto tile_m0 = [&](int64_t t) { return equal_tiles ? t * M / tiles : std::min(t * MR, M); };
  auto prefetches = [&](int64_t t) { return !few || (t > 0 && tile_m0(t + 1) - tile_m0(t) >= PF_LATE_ROWS); };
  // see KC_SHORT: fp32 and pair panels (int8 ones, whose tiles widen each weight, measured 0.93-0.94x at 7-9 rows)
  constexpr bool short_kinds = std::is_same_v<W, float> || pair_tiles;
  const bool short_slices = short_kinds && M > MR && M < 2 * MR && !prefetches(1);
  const int64_t kc_max = short_slices ? KC_SHORT : pair_tiles ? KC_PAIRS : KC;
  int64_t sharers = 0;
  for (int64_t t = 0; t < tiles; ++t) sharers += prefetches(t);
  // The sums start at the bias where it is added before the scale; else at zero, which the first K slice's tiles
  // start from in registers. Zeroing acc a panel at a time (a memset each) held ~2% of a bf16 decode step's samples
  // at 8 rows; without it 28 layers of Qwen3-0.6B's linears and its LM head ran 1.01-1.02x (bf16 and fp32, 8-32
  // rows, alternated on a 2-core Zen 4), same outputs.
  const bool bias_first = bias != nullptr && scale == nullptr, from_zero = !bias_first && K > 0;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(M * NR);  // this panel's outputs, all rows
    for (int64_t p = begin; p < end; ++p) {
      if (!from_zero) start_sums(acc, p, bias, bias_first, M, N);  // else the bias joins after the scale
      const W* panel = wp + p * K * NR;
      for (int64_t k0 = 0; k0 < K; k0 += kc_max) {
        const int64_t kc = std::min(kc_max, K - k0);
        // The weights come from memory, and on an AVX-512 Xeon the hardware prefetcher did not keep
        // ahead of a tile loop: the time was the memory time plus the compute time, not the larger of
        // the two. So the row tiles prefetch the next K slice (this thread's panels are one contiguous
        // range), shared out between the tiles: 1.05-1.2x at 8-24 rows on a 28-layer Qwen3-0.6B stack
        // there, into L1 up to PF_L1_MAX_ROWS rows, into L2 above (1.1-1.2x at 64-128 rows).
        //
        // Below PF_MIN_ROWS the first tile streams the slice (the hardware prefetcher keeps up) and every later
        // tile of at least PF_LATE_ROWS rows, which reads the slice from L2 while memory would idle, prefetches
        // one line of the next slice per k into L2: on a Zen 4, 28 layers of Qwen3-0.6B's fp32 linears ran
        // 1.07-1.13x as fast at 16 rows and 1.0-1.09x at 10-14 (four runs of 7-9 alternated rounds), level at
        // 6-8 (no later tile prefetches there); int8 panels 1.02-1.045x at 12-16; later tiles of 1-3 rows (7-9
        // rows in all) lost up to 0.83x.
        const int64_t lines = kc * NR * (int64_t)sizeof(W) / 64;
        const int64_t steps = pair_tiles ? kc / 2 : kc;  // one prefetch a step at most
        const int64_t per_tile = sharers == 0 ? 0 : std::min(few ? steps : lines, (lines + sharers - 1) / sharers);
        const char* next_slice = reinterpret_cast<const char*>(panel + (k0 + kc) * NR);
        const char* stop = reinterpret_cast<const char*>(wp + end * K * NR);
        for (int64_t t = 0, s = 0; t < tiles; ++t) {
          const int64_t m0 = tile_m0(t), rows = tile_m0(t + 1) - m0;
          const bool shares = prefetches(t);  // s: this tile's share of the lines
          const char* pf = next_slice + s * per_tile * 64;
          const int64_t npf = !shares ? 0 : std::max<int64_t>(0, std::min({per_tile, lines - s * per_tile,
                                                                          (stop - pf) / 64}));
          s += shares;
          tile_rows(rows, x + m0 * K + k0, K, panel + k0 * NR, kc, acc.data() + m0 * NR, pf, npf,
                    !few && M <= PF_L1_MAX_ROWS, m0 == 0 && few && M >= PF_AHEAD_MIN_ROWS, from_zero && k0 == 0);
        }
      }
      store_panel(acc.data(), p, bias, scale, y, M, N, glu);
    }
  });
}

#ifdef RTP_AMX_PAIRS
// gemm_impl for bf16 rows over pair panels on AMX tiles: x [Mp, K], Mp = M rounded up to AMX_ROWS (zero rows
// past M), K even; the last K % 32 inputs go through the vdpbf16ps tiles.
template <typename Y>
static void amx_pairs_impl(const at::BFloat16* x, const at::BFloat16* wp, const float* bias, Y* y, int64_t M,
                           int64_t N, int64_t K, Glu glu) {
  const int64_t panels = (N + NR - 1) / NR, Mp = (M + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
  const int64_t k32 = K / AMX_K * AMX_K;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    rtp_amx::TileConfig cfg;  // every tile 16 rows x 64 bytes: C 0-3, x 4, weights 5-7
    for (int t = 0; t < 8; ++t) { cfg.colsb[t] = 64; cfg.rows[t] = AMX_ROWS; }
    _tile_loadconfig(&cfg);
    std::vector<float> acc(Mp * NR);
    for (int64_t p = begin; p < end; ++p) {
      start_sums(acc, p, bias, bias != nullptr, M, N);
      const at::BFloat16* panel = wp + p * K * NR;
      for (int64_t m0 = 0; m0 < Mp; m0 += AMX_ROWS) {
        amx_tile(x + m0 * K, K, panel, k32, acc.data() + m0 * NR, m0 == 0 ? AMX_PF_AHEAD : 0);
        for (int64_t r0 = m0; r0 < std::min(M, m0 + AMX_ROWS) && k32 < K; r0 += MR)
          tile_rows(std::min({MR, M - r0, m0 + AMX_ROWS - r0}), x + r0 * K + k32, K, panel + k32 * NR, K - k32,
                    acc.data() + r0 * NR, nullptr, 0, false, false, false);
      }
      store_panel(acc.data(), p, nullptr, nullptr, y, M, N, glu);  // the bias was the sums' start
    }
    _tile_release();
  });
}
#endif

int64_t panel_width() { return NR; }

bool bf16_dot() {
#ifdef RTP_BF16_DOT
  return true;
#else
  return false;
#endif
}

at::Tensor pack_pairs(at::Tensor w) {
  // [N, K] bf16 -> [ceil(N / NR), ceil(K / 2), NR, 2]: panel p, input pair i, column j holds inputs 2i, 2i + 1
  // of output p NR + j (zero-padded columns and, for an odd K, a zero last input).
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "pack_pairs: weight must be 2-D bf16");
  const int64_t N = w.size(0), K = w.size(1), panels = (N + NR - 1) / NR, Kp = (K + 1) / 2 * 2;
  auto padded = at::zeros({panels * NR, Kp}, w.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(w);
  return padded.view({panels, NR, Kp / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

at::Tensor pack(at::Tensor w) {
  // [N, K] -> [ceil(N / NR), K, NR], zero-padded columns; same dtype.
  TORCH_CHECK(w.dim() == 2, "pack: weight must be 2-D");
  const int64_t N = w.size(0), K = w.size(1), panels = (N + NR - 1) / NR;
  auto padded = at::zeros({panels * NR, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({panels, NR, K}).transpose(1, 2).contiguous();
}

bool has_amx() {
#ifdef RTP_AMX_PAIRS
  return rtp_amx::permitted();
#else
  return false;
#endif
}

at::Tensor gemm(at::Tensor x, at::Tensor wp, int64_t N, c10::optional<at::Tensor> bias,
                   c10::optional<at::Tensor> scale, int64_t glu_mode, bool use_amx) {
  // x: [M, K] (any float dtype; computed in fp32, or in bf16 products with pair panels); wp from pack() or
  // pack_pairs(); returns [M, N] in x's dtype ([M, N / 2] for GLU_SILU_MUL).
  // int8 panels need scale [N] (output column n is multiplied by scale[n]); the others take none.
  // glu_mode (Glu): wp holds gate ‖ up panels; no bias or scale then. use_amx: pair panels on AMX tiles where
  // has_amx() (else the vdpbf16ps tiles).
  const bool pairs = wp.dim() == 4;
  TORCH_CHECK((pairs ? wp.size(2) == NR && wp.size(3) == 2 && wp.scalar_type() == at::kBFloat16
                     : wp.dim() == 3 && wp.size(2) == NR) && wp.size(0) * NR >= N, "gemm: not a packed weight");
  const int64_t Kw = pairs ? 2 * wp.size(1) : wp.size(1);
  TORCH_CHECK(x.dim() == 2 && (x.size(1) == Kw || (pairs && x.size(1) == Kw - 1)), "gemm: x does not fit the weight");
#ifndef RTP_BF16_DOT
  TORCH_CHECK(!pairs, "gemm: pair panels need AVX-512 BF16");
#endif
  const auto wt = wp.scalar_type();
  TORCH_CHECK(wt == at::kFloat || wt == at::kBFloat16 || wt == at::kChar, "gemm: fp32, bf16 or int8 weights");
  TORCH_CHECK((wt == at::kChar) == scale.has_value(), "gemm: int8 weights need a scale, other weights take none");
  TORCH_CHECK(glu_mode >= GLU_NONE && glu_mode <= GLU_SILU_MUL, "gemm: glu_mode must be 0, 1 or 2");
  const Glu glu = static_cast<Glu>(glu_mode);
  TORCH_CHECK(glu == GLU_NONE || (N % 2 == 0 && !bias.has_value() && wt != at::kChar &&
                                  wp.size(0) == (N / 2 + NR / 2 - 1) / (NR / 2)),
              "gemm: gate ‖ up panels need an even N (their count), fp32 or bf16 weights and no bias");
  at::Tensor sc;
  if (scale.has_value()) {
    sc = scale->to(at::kFloat).contiguous();
    TORCH_CHECK(sc.dim() == 1 && sc.size(0) == N, "gemm: the scale must be [N]");
  }
  const auto out_dtype = x.scalar_type();
  // bf16 rows for pair panels (an odd K gets a zero last input, as the weight), fp32 rows otherwise.
  auto xf = !pairs ? x.to(at::kFloat).contiguous()
            : x.size(1) == Kw ? x.to(at::kBFloat16).contiguous()
            : at::constant_pad_nd(x.to(at::kBFloat16), {0, 1}).contiguous();
  const int64_t M = xf.size(0), K = xf.size(1);
  const bool amx = pairs && use_amx && has_amx();
  if (amx && M % AMX_ROWS != 0) xf = at::constant_pad_nd(xf, {0, 0, 0, AMX_ROWS - M % AMX_ROWS});  // whole x tiles
  // The output is written in x's dtype where that is fp32 or bf16 (an fp32 [M, N] and a conversion pass
  // cost a prompt step's largest matmuls 0.76x -> 0.9x of oneDNN's rate at 2048 rows).
  const bool bf16_out = out_dtype == at::kBFloat16;
  const int64_t ldy = glu == GLU_SILU_MUL ? N / 2 : N;
  auto y = at::empty({M, ldy}, x.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  at::Tensor b;
  if (bias.has_value()) b = bias->to(at::kFloat).contiguous();
  {
    // No Python object is touched below: let other threads (the heartbeat) run meanwhile.
    pybind11::gil_scoped_release no_gil;
    const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
    const float* sp = sc.defined() ? sc.data_ptr<float>() : nullptr;
    // Row blocks of at most MB, of equal size: every panel re-reads its block's rows, which then stay in
    // L2 (prompt steps have thousands of rows; a whole block per panel made them come from L3: 10-15%
    // slower). Equal blocks, since each block streams every weight once: 256 rows as 240 + 16 paid a
    // decode step's weight traffic for the last 16 (AVX-512, 0.6B shapes: 0.86x -> 0.92x of oneDNN).
    // Pair panels read bf16 rows, half the bytes: blocks of up to MB_PAIRS (240, 480 and 960 measured level
    // within the host's noise at 256-2048 rows on a Zen 4).
    const int64_t mb_max = amx ? AMX_MB : pairs ? MB_PAIRS : MB, mr = amx ? AMX_ROWS : MR;
    const int64_t blocks = std::max<int64_t>(1, (M + mb_max - 1) / mb_max);  // no rows: one empty block
    const int64_t step = ((M + blocks - 1) / blocks + mr - 1) / mr * mr;
    auto run = [&](auto* y0) {
      for (int64_t m0 = 0; m0 < M; m0 += step) {
        const int64_t mb = std::min(step, M - m0);
        auto* yb = y0 + m0 * ldy;
#ifdef RTP_AMX_PAIRS
        if (amx) {
          amx_pairs_impl(xf.data_ptr<at::BFloat16>() + m0 * K, wp.data_ptr<at::BFloat16>(), bp, yb, mb, N, K, glu);
          continue;
        }
#endif
#ifdef RTP_BF16_DOT
        if (pairs) {
          gemm_impl(xf.data_ptr<at::BFloat16>() + m0 * K, wp.data_ptr<at::BFloat16>(), bp, nullptr, yb, mb, N, K, glu);
          continue;
        }
#endif
        const float* xb = xf.data_ptr<float>() + m0 * K;
        if (wt == at::kFloat)
          gemm_impl(xb, wp.data_ptr<float>(), bp, nullptr, yb, mb, N, K, glu);
        else if (wt == at::kBFloat16)
          gemm_impl(xb, wp.data_ptr<at::BFloat16>(), bp, nullptr, yb, mb, N, K, glu);
        else
          gemm_impl(xb, wp.data_ptr<int8_t>(), bp, sp, yb, mb, N, K, glu);
      }
    };
    if (bf16_out) run(y.data_ptr<at::BFloat16>());
    else run(y.data_ptr<float>());
  }
  return out_dtype == at::kFloat || bf16_out ? y : y.to(out_dtype);
}
"""


@functools.lru_cache(maxsize=1)
def load() -> ModuleType | None:
    """Build (first use) and import the kernel; None where it cannot be built."""
    # Contracting a * b + c into one FMA is what the kernel is for (C++17 mode turns it off by default).
    return build("cpu_gemm", _SOURCE, ["pack", "pack_pairs", "gemm", "panel_width", "bf16_dot", "has_amx"],
                 extra_cflags=("-ffp-contract=fast", *(("-DRTP_ZEN4",) if zen4() else ())))


def available() -> bool:
    """True when the kernel built on this machine."""
    return load() is not None


def panel_width() -> int:
    """Output columns per packed panel on this machine (64 with AVX-512, else 16)."""
    module = load()
    if module is None:
        raise RuntimeError("the CPU GEMM kernel is not available on this machine")
    return int(module.panel_width())


def bf16_dot() -> bool:
    """True where the kernel multiplies bf16 natively (built with AVX-512 BF16's ``vdpbf16ps``)."""
    module = load()
    return module is not None and bool(module.bf16_dot())


def has_amx() -> bool:
    """True where bf16 pair panels multiply on AMX tiles (the CPU has AMX-BF16 and Linux grants the tile state)."""
    module = load()
    return module is not None and bool(module.has_amx())


def pack(weight: torch.Tensor, pairs: bool | None = None, gate_up: bool = False) -> torch.Tensor:
    """``weight [N, K]`` (fp32, bf16 or int8) as panels ``[ceil(N / NR), K, NR]`` for :func:`linear`
    (NR = :func:`panel_width`), or for bf16 as pair panels ``[ceil(N / NR), ceil(K / 2), NR, 2]``,
    which :func:`linear` multiplies in bf16 (the rows rounded to bf16, products summed in fp32).
    ``pairs`` defaults to bf16 weights where :func:`bf16_dot`.

    ``gate_up``: the rows are a SwiGLU's gate ‖ up (two halves of I, fp32 or bf16). Each panel then holds
    NR / 2 gate columns and the same NR / 2 up columns (``ceil(I / (NR / 2))`` panels), so that
    :func:`silu_mul` finishes ``silu(gate) * up`` on the sums in registers; :func:`linear` with
    ``gate_up=True`` returns the plain product.
    """
    module = load()
    if module is None:
        raise RuntimeError("the CPU GEMM kernel is not available on this machine")
    if pairs is None:
        pairs = weight.dtype == torch.bfloat16 and bool(module.bf16_dot())
    weight = weight.detach()
    if gate_up:
        if weight.shape[0] % 2 or weight.dtype == torch.int8:
            raise ValueError(f"gate_up panels need fp32 or bf16 rows of two equal halves, got {tuple(weight.shape)} "
                             f"{weight.dtype}")
        half, n = weight.shape[0] // 2, int(module.panel_width()) // 2
        panels = -(-half // n)
        pad = (0, 0, 0, panels * n - half)  # zero columns past I in the last panel, in both halves
        gate = torch.nn.functional.pad(weight[:half], pad).view(panels, n, -1)
        up = torch.nn.functional.pad(weight[half:], pad).view(panels, n, -1)
        weight = torch.cat([gate, up], dim=1).view(2 * panels * n, -1)
    # Every decode step streams the panels once: in huge pages (see host_memory).
    return in_huge_pages(module.pack_pairs(weight) if pairs else module.pack(weight))


GLU_NONE, GLU_SPLIT, GLU_SILU_MUL = 0, 1, 2  # the kernel's Glu modes (the last argument of load().gemm)


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None,
           scale: torch.Tensor | None = None, gate_up: bool = False, amx: bool = True) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x [M, K]`` from ``packed = pack(weight, gate_up=gate_up)``;
    ``out_features`` = N.

    int8 panels need ``scale [N]``: the result is ``F.linear(x, q * scale[:, None], bias)``. ``amx=False`` keeps
    pair panels on the vdpbf16ps tiles where :func:`has_amx` (the sums are added in another order).
    """
    module = load()
    assert module is not None, "pack() succeeded, so the kernel is loaded"
    return module.gemm(x, packed, out_features, bias, scale, GLU_SPLIT if gate_up else GLU_NONE, amx)


def bound(packed: torch.Tensor, out_features: int, scale: torch.Tensor | None = None,
          glu: int = GLU_NONE) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> y`` as :func:`linear` without a bias (``glu``: GLU_NONE, GLU_SPLIT for a gate ‖ up packing) or
    :func:`silu_mul` (GLU_SILU_MUL) computes it, the kernel bound to the weight: one call, no dispatch."""
    module = load()
    assert module is not None, "pack() succeeded, so the kernel is loaded"
    gemm = module.gemm
    return lambda x: gemm(x, packed, out_features, None, scale, glu, True)


def silu_mul(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """``silu(gate) * up`` of ``F.linear(x, weight)`` = gate ‖ up, from ``packed = pack(weight, gate_up=True)``;
    ``out_features`` = 2I, returns ``[M, I]``. The same steps as :func:`linear` then
    :func:`rtp.kernels.cpu_ops.silu_and_mul`, the roundings to x's dtype included (equal up to a last bit
    of the exponential), without writing and re-reading the ``[M, 2I]`` product."""
    module = load()
    assert module is not None, "pack() succeeded, so the kernel is loaded"
    return module.gemm(x, packed, out_features, None, None, GLU_SILU_MUL, True)

