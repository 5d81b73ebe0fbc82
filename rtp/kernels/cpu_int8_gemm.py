"""int8 x int8 GEMM for CPUs with AVX-512 VNNI: int8 weights, activations quantized per step.

A decode step at M = 8-32 rows streams every weight once, and with int8 weights widened to
fp32 in registers (:mod:`rtp.kernels.cpu_gemm`) the widening and the fp32 FMAs, not the
bytes, bound it: about the time of oneDNN's bf16 product on an AVX-512 CPU, for half the
bytes. VNNI's ``vpdpbusd`` multiplies 64 pairs of bytes per instruction into 16 int32 sums,
four times the fp32 FMA's work per instruction, so this kernel computes in int8:

- each activation row is quantized as it arrives, per group of 128 inputs (symmetric, round
  to nearest even, ``scale = max|x| / 127``), so that one large value only coarsens its group;
- the weight ``q [N, K]`` (int8, one scale per output) is re-laid out once at load as panels of
  16 outputs x 4 inputs per 64-byte vector, ``[ceil(N / 16), ceil(K / 4), 16, 4]``, stored as
  ``q + 128`` (``vpdpbusd`` takes unsigned x signed bytes); the 128 offset is taken back out
  exactly with the sum of each row group's quantized activations;
- each group's int32 sums are scaled by their activation scale into fp32 accumulators, and
  the weight scale and bias join once per output.

So ``y[m, n] = sum_g sx[m, g] * (xq[m, g] . q[n, g]) * sw[n] + bias[n]``: the product of the
quantized operands, exact in int32 within a group. :func:`available` is False on CPUs without
AVX-512 VNNI (and where the build fails); callers then keep :mod:`rtp.kernels.cpu_gemm`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType

import torch

from rtp.kernels.cpu_build import build
from rtp.kernels.cpu_features import cpu_flags
from rtp.kernels.cpu_simd import AMX_HEADER

GROUP = 128
"""Activation inputs per quantization group."""

_SOURCE = AMX_HEADER + r"""
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

constexpr int64_t NR = 16, KG = 128, MR = 8, MB = 256;  // MB: rows per block, a multiple of MR
constexpr int64_t PF_AHEAD = 24576, PF_MAX_ROWS = 64;     // weight prefetch distance (bytes) and its row limit

// Row m of x [M, K] -> xq [M, Kp] (zero padded), with per-group scale sx [M, G] and sum of xq xs [M, G].
// q = round(x / scale) to nearest even (the default rounding mode), as torch.round(x / scale).
static void quantize_rows(const float* x, int64_t M, int64_t K, int64_t Kp, int8_t* xq, float* sx, int32_t* xs) {
  const int64_t G = (K + KG - 1) / KG;
  at::parallel_for(0, M, 8, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* xr = x + m * K;
      int8_t* qr = xq + m * Kp;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t k0 = g * KG, n = std::min(K, k0 + KG) - k0;
        __m512 vmax = _mm512_setzero_ps();
        for (int64_t k = 0; k < n; k += 16) {
          const __mmask16 mask = n - k >= 16 ? 0xFFFF : (__mmask16)((1u << (n - k)) - 1);
          vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_maskz_loadu_ps(mask, xr + k0 + k)));
        }
        const float amax = _mm512_reduce_max_ps(vmax);
        const float scale = amax > 0.f ? amax / 127.f : 1.f;
        const __m512 vs = _mm512_set1_ps(scale);
        __m512i vsum = _mm512_setzero_si512();
        for (int64_t k = 0; k < n; k += 16) {
          const __mmask16 mask = n - k >= 16 ? 0xFFFF : (__mmask16)((1u << (n - k)) - 1);
          const __m512i q = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_maskz_loadu_ps(mask, xr + k0 + k), vs));
          vsum = _mm512_add_epi32(vsum, q);  // |x| <= amax, so |q| <= 127: no clamp needed
          _mm_mask_storeu_epi8(qr + k0 + k, mask, _mm512_cvtsepi32_epi8(q));
        }
        sx[m * G + g] = scale;
        xs[m * G + g] = _mm512_reduce_add_epi32(vsum);
      }
      for (int64_t k = K; k < Kp; ++k) qr[k] = 0;
    }
  });
}

// y[m, n0 + c] = acc[m, c] * sw[n0 + c] + bias[n0 + c] for the nc outputs of a panel pair (acc: [M, 2 * NR]).
static void store_outputs(const float* acc, int64_t M, int64_t N, int64_t n0, int64_t nc, const float* sw,
                          const float* bias, float* y) {
  for (int64_t m = 0; m < M; ++m) {
    float* yr = y + m * N + n0;
    const float* ar = acc + m * 2 * NR;
    for (int64_t c = 0; c < nc; ++c) yr[c] = ar[c] * sw[n0 + c] + (bias != nullptr ? bias[n0 + c] : 0.f);
  }
}

// acc[r] (32 floats: output row r of two panels) += sx[r, g] * (xq[r, group g] . each panel's group g), for
// R rows; TWO = false: the second panel is absent (an odd count). Two panels per tile halve the broadcasts
// per multiply: one 4-byte broadcast feeds two vpdpbusd.
template <int R, bool TWO>
static inline void tile(const int8_t* xq, int64_t ldx, const float* sx, const int32_t* xs, int64_t ldg,
                        const uint8_t* w0, const uint8_t* w1, int64_t k4n, float* acc, const char* pf0,
                        const char* pf1, int64_t npf) {
  __m512i a0[R], a1[R];
  for (int r = 0; r < R; ++r) a1[r] = a0[r] = _mm512_set1_epi32(-128 * xs[r * ldg]);  // takes the +128 back out
  for (int64_t k = 0; k < k4n; ++k) {
    const __m512i v0 = _mm512_loadu_si512(w0 + k * 64);
    const __m512i v1 = TWO ? _mm512_loadu_si512(w1 + k * 64) : v0;
    if (k < npf) {
      __builtin_prefetch(pf0 + k * 64);
      if (TWO) __builtin_prefetch(pf1 + k * 64);
    }
    for (int r = 0; r < R; ++r) {
      int32_t x4;
      std::memcpy(&x4, xq + r * ldx + k * 4, 4);
      const __m512i xb = _mm512_set1_epi32(x4);
      a0[r] = _mm512_dpbusd_epi32(a0[r], v0, xb);
      if (TWO) a1[r] = _mm512_dpbusd_epi32(a1[r], v1, xb);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512 s = _mm512_set1_ps(sx[r * ldg]);
    float* ar = acc + r * 2 * NR;
    _mm512_storeu_ps(ar, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a0[r]), s, _mm512_loadu_ps(ar)));
    if (TWO) _mm512_storeu_ps(ar + NR, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1[r]), s, _mm512_loadu_ps(ar + NR)));
  }
}

template <bool TWO>
static void tile_rows(int64_t rows, const int8_t* xq, int64_t ldx, const float* sx, const int32_t* xs,
                      int64_t ldg, const uint8_t* w0, const uint8_t* w1, int64_t k4n, float* acc, const char* pf0,
                      const char* pf1, int64_t npf) {
#define RTP_TILE(R) tile<R, TWO>(xq, ldx, sx, xs, ldg, w0, w1, k4n, acc, pf0, pf1, npf)
  switch (rows) {
    case 8: RTP_TILE(8); break;
    case 7: RTP_TILE(7); break;
    case 6: RTP_TILE(6); break;
    case 5: RTP_TILE(5); break;
    case 4: RTP_TILE(4); break;
    case 3: RTP_TILE(3); break;
    case 2: RTP_TILE(2); break;
    default: RTP_TILE(1); break;
  }
#undef RTP_TILE
}

// y [M, N] fp32 = (per-group dequantized xq . panels) * sw + bias, for one block of rows.
static void gemm_block(const int8_t* xq, const float* sx, const int32_t* xs, const uint8_t* wp, const float* sw,
                       const float* bias, float* y, int64_t M, int64_t N, int64_t K, int64_t Kp) {
  const int64_t panels = (N + NR - 1) / NR, pairs = (panels + 1) / 2, G = (K + KG - 1) / KG;
  const int64_t panel_bytes = Kp * NR;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(M * 2 * NR);
    const char* stop = reinterpret_cast<const char*>(wp + std::min(panels, 2 * end) * panel_bytes);
    for (int64_t j = begin; j < end; ++j) {
      const int64_t p = 2 * j, n0 = p * NR, nc = std::min(2 * NR, N - n0);
      const bool two = p + 1 < panels;
      std::fill(acc.begin(), acc.end(), 0.f);
      const uint8_t* panel = wp + p * panel_bytes;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t k0 = g * KG, k4n = (std::min(Kp, k0 + KG) - k0) / 4;
        const uint8_t* w0 = panel + k0 * NR;
        const uint8_t* w1 = w0 + panel_bytes;
        // Few rows compute too little per cache line for the hardware prefetcher to stay ahead of
        // the weights: the first row tile asks for the lines PF_AHEAD bytes on in both panels (this
        // thread's panels are one contiguous range).
        const char* pf0 = reinterpret_cast<const char*>(w0) + PF_AHEAD;
        const char* pf1 = reinterpret_cast<const char*>(w1) + PF_AHEAD;
        const int64_t npf = M > PF_MAX_ROWS ? 0 : std::max<int64_t>(0, std::min<int64_t>(k4n, (stop - pf1) / 64));
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
          const int64_t rows = std::min(MR, M - m0), n = m0 == 0 ? npf : 0;
          const int8_t* xr = xq + m0 * Kp + k0;
          float* ar = acc.data() + m0 * 2 * NR;
          if (two) tile_rows<true>(rows, xr, Kp, sx + m0 * G + g, xs + m0 * G + g, G, w0, w1, k4n, ar, pf0, pf1, n);
          else tile_rows<false>(rows, xr, Kp, sx + m0 * G + g, xs + m0 * G + g, G, w0, w0, k4n, ar, pf0, pf0, n);
        }
      }
      store_outputs(acc.data(), M, N, n0, nc, sw, bias, y);
    }
  });
}


// AMX (Sapphire Rapids and later): one tdpbsud multiplies 16 rows x 64 inputs by 64 inputs x 16 outputs.
// The VNNI panels are already the tiles' layout: 16 k4-rows x 64 bytes per panel and 64 inputs. Each
// 32-row x 32-output block keeps four int32 tiles; after each group they are stored and folded into the fp32
// accumulators exactly as the VNNI tiles are, so both paths give the same result.
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
static bool amx_permitted() { return rtp_amx::permitted(); }

static void amx_block(const int8_t* xq, const float* sx, const int32_t* xs, const uint8_t* wp, const float* sw,
                      const float* bias, float* y, int64_t M, int64_t N, int64_t K, int64_t Kp) {
  // xq, sx, xs have rows up to M rounded up to 16 (zero padded).
  const int64_t panels = (N + NR - 1) / NR, pairs = (panels + 1) / 2, G = (K + KG - 1) / KG;
  const int64_t panel_bytes = Kp * NR;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    rtp_amx::TileConfig cfg;
    for (int t = 0; t < 8; ++t) { cfg.colsb[t] = 64; cfg.rows[t] = 16; }
    _tile_loadconfig(&cfg);  // tiles 0-3: int32 sums (rows 0-15 / 16-31 x panel 0 / 1); 4, 5: x; 6, 7: weights
    alignas(64) int32_t ci[32 * 32];
    std::vector<float> acc(M * 2 * NR);
    const char* stop = reinterpret_cast<const char*>(wp + std::min(panels, 2 * end) * panel_bytes);
    for (int64_t j = begin; j < end; ++j) {
      const int64_t p = 2 * j, n0 = p * NR, nc = std::min(2 * NR, N - n0);
      const bool two = p + 1 < panels;
      const uint8_t* panel = wp + p * panel_bytes;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t m0 = 0; m0 < M; m0 += 32) {
        const bool lower = m0 + 16 < M;  // a second 16-row tile
        const bool prefetch = m0 == 0 && M <= PF_MAX_ROWS;
        for (int64_t g = 0; g < G; ++g) {
          const int64_t k0 = g * KG, k1 = std::min(Kp, k0 + KG);
          _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
          for (int64_t k = k0; k < k1; k += 64) {
            if (prefetch) {  // as in the VNNI tiles: few rows leave the hardware prefetcher behind
              const char* pf = reinterpret_cast<const char*>(panel + k * NR) + PF_AHEAD;
              for (int64_t line = 0; line < 16 && pf + line * 64 < stop; ++line) __builtin_prefetch(pf + line * 64);
              for (int64_t line = 0; two && line < 16 && pf + panel_bytes + line * 64 < stop; ++line)
                __builtin_prefetch(pf + panel_bytes + line * 64);
            }
            _tile_loadd(4, xq + m0 * Kp + k, Kp);
            _tile_loadd(6, panel + k * NR, 64);
            _tile_dpbsud(0, 4, 6);
            if (two) { _tile_loadd(7, panel + panel_bytes + k * NR, 64); _tile_dpbsud(1, 4, 7); }
            if (lower) {
              _tile_loadd(5, xq + (m0 + 16) * Kp + k, Kp);
              _tile_dpbsud(2, 5, 6);
              if (two) _tile_dpbsud(3, 5, 7);
            }
          }
          _tile_stored(0, ci, 128);
          if (two) _tile_stored(1, ci + 16, 128);
          if (lower) _tile_stored(2, ci + 16 * 32, 128);
          if (lower && two) _tile_stored(3, ci + 16 * 32 + 16, 128);
          for (int64_t r = 0; r < std::min<int64_t>(32, M - m0); ++r) {
            const int64_t m = m0 + r;
            const __m512i comp = _mm512_set1_epi32(-128 * xs[m * G + g]);
            const __m512 s = _mm512_set1_ps(sx[m * G + g]);
            float* ar = acc.data() + m * 2 * NR;
            for (int h = 0; h < (two ? 2 : 1); ++h) {
              const __m512i v = _mm512_add_epi32(_mm512_load_si512(ci + r * 32 + h * 16), comp);
              _mm512_storeu_ps(ar + h * NR, _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), s, _mm512_loadu_ps(ar + h * NR)));
            }
          }
        }
      }
      store_outputs(acc.data(), M, N, n0, nc, sw, bias, y);
    }
    _tile_release();
  });
}
#else
static bool amx_permitted() { return false; }
static void amx_block(const int8_t*, const float*, const int32_t*, const uint8_t*, const float*, const float*, float*,
                      int64_t, int64_t, int64_t, int64_t) {}
#endif

bool has_amx() { return amx_permitted(); }

at::Tensor pack(at::Tensor q) {
  // int8 [N, K] -> uint8 [ceil(N / NR), Kp / 4, NR, 4], Kp = K rounded up to 64 (an AMX tile's depth),
  // holding q + 128 (padding: 128, i.e. a zero weight).
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "pack: the weight must be int8 [N, K]");
  const int64_t N = q.size(0), K = q.size(1), panels = (N + NR - 1) / NR, Kp = (K + 63) / 64 * 64;
  auto padded = at::zeros({panels * NR, Kp}, q.options().dtype(at::kShort));
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(q);
  padded.add_(128);
  return padded.to(at::kByte).view({panels, NR, Kp / 4, 4}).permute({0, 2, 1, 3}).contiguous();
}

template <typename T>
static void quantize_pack_impl(const T* w, int64_t N, int64_t K, int64_t Kp, uint8_t* wp, float* scale) {
  // Row n of w: scale[n] = max|w| / 127 (1 for an all-zero row), q = round(w / scale) to nearest even; q + 128
  // goes to byte (k % 4) of column n % NR in row k / 4 of panel n / NR.
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const T* row = w + n * K;
      float amax = 0.f;
      for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(static_cast<float>(row[k])));
      const float s = amax > 0.f ? amax / 127.f : 1.f;
      scale[n] = s;
      uint8_t* col = wp + (n / NR) * Kp * NR + (n % NR) * 4;
      for (int64_t k = 0; k < Kp; ++k) {
        const float q = k < K ? std::min(127.f, std::max(-127.f, std::nearbyint(static_cast<float>(row[k]) / s))) : 0.f;
        col[(k / 4) * NR * 4 + k % 4] = static_cast<uint8_t>(static_cast<int32_t>(q) + 128);
      }
    }
  });
}

std::vector<at::Tensor> quantize_pack(at::Tensor w) {
  // float [N, K] -> (pack(q), scale [N] fp32) for q, scale = rtp.model.quant.int8.quantize_per_channel(w), in one pass.
  TORCH_CHECK(w.dim() == 2, "quantize_pack: the weight must be [N, K]");
  w = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1), panels = (N + NR - 1) / NR, Kp = (K + 63) / 64 * 64;
  auto wp = at::full({panels, Kp / 4, NR, 4}, 128, w.options().dtype(at::kByte));  // padding: a zero weight
  auto scale = at::empty({N}, w.options().dtype(at::kFloat));
  uint8_t* out = wp.data_ptr<uint8_t>();
  float* sp = scale.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, w.scalar_type(), "quantize_pack",
                                  [&] { quantize_pack_impl<scalar_t>(w.data_ptr<scalar_t>(), N, K, Kp, out, sp); });
  return {wp, scale};
}

at::Tensor gemm(at::Tensor x, at::Tensor wp, int64_t N, at::Tensor scale, c10::optional<at::Tensor> bias,
                   bool use_amx) {
  // x: [M, K] (any float dtype); wp from pack(); scale: [N] per output; returns [M, N] in x's dtype.
  // use_amx: AMX tiles where the CPU and the kernel grant them (else VNNI).
  TORCH_CHECK(wp.dim() == 4 && wp.scalar_type() == at::kByte && wp.size(2) == NR && wp.size(3) == 4 &&
              wp.size(0) * NR >= N, "gemm: not a packed int8 weight");
  const int64_t K = x.size(1), Kp = wp.size(1) * 4;
  TORCH_CHECK(x.dim() == 2 && (K + 63) / 64 * 64 == Kp, "gemm: x does not fit the weight");
  auto sw = scale.to(at::kFloat).contiguous();
  TORCH_CHECK(sw.dim() == 1 && sw.size(0) == N, "gemm: the scale must be [N]");
  at::Tensor b;
  if (bias.has_value()) b = bias->to(at::kFloat).contiguous();
  const auto out_dtype = x.scalar_type();
  auto xf = x.to(at::kFloat).contiguous();
  const int64_t M = xf.size(0), G = (K + KG - 1) / KG, Mp = (M + 15) / 16 * 16;  // AMX reads 16-row tiles
  auto y = at::empty({M, N}, xf.options());
  std::vector<int8_t> xq(Mp * Kp, 0);
  std::vector<float> sx(Mp * G, 0.f);
  std::vector<int32_t> xs(Mp * G, 0);
  const bool amx = use_amx && amx_permitted();
  {
    // No Python object is touched below: let other threads (the heartbeat) run meanwhile.
    pybind11::gil_scoped_release no_gil;
    quantize_rows(xf.data_ptr<float>(), M, K, Kp, xq.data(), sx.data(), xs.data());
    const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
    // Row blocks of MB: every panel re-reads its block's rows, which then stay in L2.
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
      const int64_t mb = std::min(MB, M - m0);
      (amx ? amx_block : gemm_block)(xq.data() + m0 * Kp, sx.data() + m0 * G, xs.data() + m0 * G,
                                     wp.data_ptr<uint8_t>(), sw.data_ptr<float>(), bp, y.data_ptr<float>() + m0 * N,
                                     mb, N, K, Kp);
    }
  }
  return out_dtype == at::kFloat ? y : y.to(out_dtype);
}
"""


@functools.lru_cache(maxsize=1)
def load() -> ModuleType | None:
    """Build (first use) and import the kernel; None on CPUs without AVX-512 VNNI or where it cannot be built."""
    if "avx512_vnni" not in cpu_flags():
        return None
    return build("cpu_int8_gemm", _SOURCE, ["pack", "quantize_pack", "gemm", "has_amx"])


def available() -> bool:
    """True when this CPU has AVX-512 VNNI and the kernel built."""
    return load() is not None


def pack(q: torch.Tensor) -> torch.Tensor:
    """int8 ``q [N, K]`` as panels ``[ceil(N / 16), Kp / 4, 16, 4]`` (uint8, ``q + 128``; ``Kp``: ``K`` rounded up
    to 64) for :func:`linear`."""
    module = load()
    if module is None:
        raise RuntimeError("the int8 VNNI GEMM kernel is not available on this machine")
    return module.pack(q.detach())


def quantize_pack(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float ``weight [N, K]`` quantized per output channel and packed in one pass: ``(pack(q), scale)`` for
    ``q, scale = rtp.model.quant.int8.quantize_per_channel(weight)`` (fp32 scale)."""
    module = load()
    if module is None:
        raise RuntimeError("the int8 VNNI GEMM kernel is not available on this machine")
    panels, scale = module.quantize_pack(weight.detach())
    return panels, scale


def has_amx() -> bool:
    """True where the kernel multiplies on AMX tiles (the CPU has AMX-INT8 and Linux grants the tile state)."""
    module = load()
    return module is not None and module.has_amx()


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, scale: torch.Tensor,
           bias: torch.Tensor | None = None, amx: bool = True) -> torch.Tensor:
    """``x [M, K]`` times the int8 weight behind ``packed`` (per-output ``scale [N]``), activations quantized
    per row and group of :data:`GROUP` inputs; returns ``[M, N]`` in ``x``'s dtype. ``amx=False`` keeps to
    VNNI where AMX is there too (the result is the same)."""
    module = load()
    assert module is not None, "pack() succeeded, so the kernel is loaded"
    return module.gemm(x, packed, out_features, scale, bias, amx)


def bound(packed: torch.Tensor, out_features: int, scale: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> linear(x, packed, out_features, scale)``, the kernel bound to the weight: one call, no dispatch."""
    module = load()
    assert module is not None, "pack() succeeded, so the kernel is loaded"
    gemm = module.gemm
    return lambda x: gemm(x, packed, out_features, scale, None, True)
