"""Eight-float (and whole-register) SIMD helpers shared by rtp's C++ CPU kernels (prepended to their sources).

GCC/Clang vector extensions rather than intrinsics: with ``-march=native`` they compile
to AVX2 or AVX-512 (two halves of a register) or NEON, from one source.
"""

SIMD_HEADER = r"""
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));

// exp(x) for eight floats: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a degree-6 polynomial (the classic
// Cephes coefficients), 2^n put into the exponent bits; about 1 ulp over the clamped range.
static inline v8f exp8(v8f x) {
  const v8f hi = {88.3762626647949f, 88.3762626647949f, 88.3762626647949f, 88.3762626647949f,
                  88.3762626647949f, 88.3762626647949f, 88.3762626647949f, 88.3762626647949f};
  const float f_inf = std::numeric_limits<float>::infinity();
  const v8f inf = {f_inf, f_inf, f_inf, f_inf, f_inf, f_inf, f_inf, f_inf};
  const auto over = x > hi;   // exp overflows to +inf there, as std::exp does
  x = over ? hi : x;
  x = x < -hi ? -hi : x;
  v8f fn = x * 1.44269504088896341f + 0.5f;
  v8i n = __builtin_convertvector(fn, v8i);
  v8f nf = __builtin_convertvector(n, v8f);
  nf = nf > fn ? nf - 1.f : nf;  // floor (the conversion truncates toward zero)
  n = __builtin_convertvector(nf, v8i);
  const v8f r = x - nf * 0.693359375f - nf * -2.12194440e-4f;
  v8f p = 1.9875691500E-4f * r + 1.3981999507E-3f;
  p = p * r + 8.3334519073E-3f;
  p = p * r + 4.1665795894E-2f;
  p = p * r + 1.6666665459E-1f;
  p = p * r + 5.0000001201E-1f;
  p = p * (r * r) + r + 1.f;
  const v8i bits = (n + 127) << 23;
  v8f scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return over ? inf : p * scale;
}

// Eight values of T as floats, and back (rounding to nearest even, as torch's casts do).
static inline v8f load8(const float* p) { v8f v; std::memcpy(&v, p, sizeof v); return v; }
static inline void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof v); }
static inline v8f load8(const at::BFloat16* p) {
  uint16_t h[8];
  std::memcpy(h, p, sizeof h);
  v8u u = {h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]};
  u <<= 16;  // bf16 is the top half of an fp32
  v8f v; std::memcpy(&v, &u, sizeof v); return v;
}
// fp32 bits rounded to the nearest bf16 (ties to even) in their top half; NaN stays a quiet NaN.
static inline v8u bf16_bits(v8f v) {
  v8u u; std::memcpy(&u, &v, sizeof u);
  const v8u rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  const v8u nan = {0x7FC00000u, 0x7FC00000u, 0x7FC00000u, 0x7FC00000u,
                   0x7FC00000u, 0x7FC00000u, 0x7FC00000u, 0x7FC00000u};
  return (v8u)(v == v) ? rounded : nan;
}
static inline void store8(at::BFloat16* p, v8f v) {
  const v8u u = bf16_bits(v) >> 16;
  uint16_t h[8];
  for (int j = 0; j < 8; ++j) h[j] = static_cast<uint16_t>(u[j]);
  std::memcpy(p, h, sizeof h);
}
#if defined(__F16C__)
#include <immintrin.h>
// fp16 widened by vcvtph2ps (exact, as the lane-by-lane conversion below).
static inline v8f load8(const at::Half* p) { return (v8f)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
#else
static inline v8f load8(const at::Half* p) {
  float f[8]; for (int j = 0; j < 8; ++j) f[j] = static_cast<float>(p[j]);
  return load8(f);
}
#endif
static inline void store8(at::Half* p, v8f v) {
  float f[8]; std::memcpy(f, &v, sizeof f);
  for (int j = 0; j < 8; ++j) p[j] = at::Half(f[j]);
}
// Any other element type (double): converted one by one.
template <typename T> static inline v8f load8(const T* p) {
  float f[8]; for (int j = 0; j < 8; ++j) f[j] = static_cast<float>(p[j]);
  return load8(f);
}

// Whole vector registers of floats: VW lanes (16 with AVX-512, else 8: a v8f), loaded from fp32, bf16 (widened by
// a 16-bit shift), fp16 (vcvtph2ps where the CPU has it) or any other type (lane by lane), and stored as fp32.
#if defined(__AVX512F__)
#include <immintrin.h>
constexpr int VW = 16;
typedef float vf __attribute__((vector_size(64)));
static inline vf loadv(const at::BFloat16* p) {
  return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16);
}
static inline vf loadv(const at::Half* p) { return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
// exp8's steps over a whole register, 2^n applied by vscalefps: 0 below the float range, +inf above it (x is
// clamped to [-104, 100] first, a NaN kept).
static inline vf expv(vf xv) {
  const __m512 x = _mm512_min_ps(_mm512_set1_ps(100.f), _mm512_max_ps(_mm512_set1_ps(-104.f), (__m512)xv));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f),
                                    _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.9875691500E-4f), r, _mm512_set1_ps(1.3981999507E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return (vf)_mm512_scalef_ps(p, n);
}
#else
constexpr int VW = 8;
typedef v8f vf;
static inline vf loadv(const at::BFloat16* p) { return load8(p); }
static inline vf loadv(const at::Half* p) { return load8(p); }
static inline vf expv(vf x) { return exp8(x); }
#endif
static inline vf loadv(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
static inline void storev(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
template <typename T> static inline vf loadv(const T* p) {
  float f[VW];
  for (int j = 0; j < VW; ++j) f[j] = static_cast<float>(p[j]);
  return loadv(f);
}
// A whole register stored as T: bf16 rounded to nearest even (bf16_bits), any other type lane by lane; and
// rounded to T's precision in place (round_v: what storing as T and loading back gives).
#if defined(__AVX512F__)
typedef uint32_t vu __attribute__((vector_size(64)));
static inline vu bf16_bits(vf v) {
  vu u; std::memcpy(&u, &v, sizeof u);
  const vu rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  return (vu)(v == v) ? rounded : vu{} + 0x7FC00000u;
}
static inline void storev(at::BFloat16* p, vf v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16((__m512i)(bf16_bits(v) >> 16)));
}
#else
static inline void storev(at::BFloat16* p, vf v) { store8(p, v); }
#endif
template <typename T> static inline void storev(T* p, vf v) {
  float f[VW];
  storev(f, v);
  for (int j = 0; j < VW; ++j) p[j] = static_cast<T>(f[j]);
}
template <typename T> static inline vf round_v(vf v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    const auto u = bf16_bits(v);
    vf r; std::memcpy(&r, &u, sizeof r); return r;
  } else {
    T t[VW]; storev(t, v); return loadv(t);
  }
}

static inline float hsum8(v8f v) {
  float s = 0.f;
  for (int j = 0; j < 8; ++j) s += v[j];
  return s;
}

// sum_d q[d] * k[d] over n values (q in fp32), with two vector accumulators.
template <typename T>
static inline float dot_f(const float* q, const T* k, int64_t n) {
  v8f a0 = {0, 0, 0, 0, 0, 0, 0, 0}, a1 = a0;
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    a0 += load8(q + d) * load8(k + d);
    a1 += load8(q + d + 8) * load8(k + d + 8);
  }
  float s = hsum8(a0 + a1);
  for (; d < n; ++d) s += q[d] * static_cast<float>(k[d]);
  return s;
}

// acc[d] += p * v[d] over n values.
template <typename T>
static inline void axpy_f(float* acc, float p, const T* v, int64_t n) {
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) store8(acc + d, load8(acc + d) + p * load8(v + d));
  for (; d < n; ++d) acc[d] += p * static_cast<float>(v[d]);
}

// s[t] = exp(s[t] - m) in place over n values; returns their sum (softmax numerators).
static inline float exp_shift_sum(float* s, int64_t n, float m) {
  v8f vsum = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const v8f e = exp8(load8(s + t) - m);
    store8(s + t, e);
    vsum += e;
  }
  float sum = hsum8(vsum);
  for (; t < n; ++t) { s[t] = std::exp(s[t] - m); sum += s[t]; }
  return sum;
}
"""

AMX_HEADER = r"""
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdint>

namespace rtp_amx {
// Linux hands a process the AMX tile state only on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
static inline bool permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

// The 64-byte operand of _tile_loadconfig (palette 1): bytes per row and rows of each of 16 tiles.
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
}  // namespace rtp_amx
"""
"""Requesting the AMX tile state from Linux, and the tile configuration (prepended to the AMX kernels)."""
