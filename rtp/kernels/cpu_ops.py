"""Fused elementwise layer ops for CPUs: RMSNorm, per-head norm + RoPE, SiLU-and-mul, KV store.

On CPU each of these is a chain of small torch ops at decode shapes (a few dozen
rows): Qwen3's per-head q/k norm and rotary embedding alone are ~20 ops a layer
(norm, gather of cos/sin, chunk, four multiplies, cat, casts), and storing K/V
through boolean-mask indexing is five more. Each op costs a dispatch, an output
allocation and a pass over memory; at the 40M bench model's decode shape they
added up to ~8 ms of a ~40 ms step. Each function here is one pass in C++.

They compute what the torch code in :mod:`rtp.model.ops` and
:func:`rtp.kernels.kv_store.store_kv_reference` compute, in the same order of
roundings: fp32 arithmetic, and for 16-bit activations the same intermediate
roundings to the activation dtype as HF's Qwen3 (the normalised value is rounded
before the weight multiplies it; the SiLU is rounded before the multiply). The
torch code stays the reference the tests compare against, and the path for
CUDA and for machines where the kernel does not build (:func:`available`).
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from rtp.kernels.cpu_build import build
from rtp.kernels.cpu_simd import SIMD_HEADER

_SOURCE = SIMD_HEADER + r"""
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

static inline float to_f(float v) { return v; }
static inline float to_f(at::BFloat16 v) { return static_cast<float>(v); }
static inline float to_f(at::Half v) { return static_cast<float>(v); }
template <typename T> static inline T from_f(float v) { return static_cast<T>(v); }  // round to nearest even
// The value a float takes once stored in T (identity for float): HF rounds some intermediates this way.
template <typename T> static inline float round_to(float v) { return to_f(from_f<T>(v)); }

// 1 / sqrt(mean(x^2) + eps) over n values, with eight partial sums (a loop the compiler vectorises).
template <typename T>
static inline float inv_rms(const T* x, int64_t n, float eps) {
  float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) { const float v = to_f(x[i + j]); part[j] += v * v; }
  float ss = 0.f;
  for (int j = 0; j < 8; ++j) ss += part[j];
  for (; i < n; ++i) { const float v = to_f(x[i]); ss += v * v; }
  return 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
}

// y = w * round_T(x * r): HF's Qwen3RMSNorm (for fp32 the rounding is the identity).
template <typename T, typename W>
static inline void norm_row(const T* x, const W* w, float* y, int64_t n, float eps) {
  const float r = inv_rms(x, n, eps);
  for (int64_t i = 0; i < n; ++i) y[i] = to_f(w[i]) * round_to<T>(to_f(x[i]) * r);
}

// A [T] int32 or int64 index tensor (contiguous), read as int64.
struct Index {
  const int32_t* i32 = nullptr;
  const int64_t* i64 = nullptr;
  explicit Index(const at::Tensor& t) {
    TORCH_CHECK(t.dim() == 1 && t.is_contiguous() && (t.scalar_type() == at::kInt || t.scalar_type() == at::kLong),
                "index tensors must be 1-D contiguous int32 or int64");
    if (t.scalar_type() == at::kInt) i32 = t.data_ptr<int32_t>(); else i64 = t.data_ptr<int64_t>();
  }
  int64_t operator[](int64_t j) const { return i64 != nullptr ? i64[j] : i32[j]; }
};

// Rows per task: below ~16K elements a second thread costs more than it saves.
static inline int64_t grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

// y = norm(x) row by row; with a residual (res non-null): s = round_T(x + res) is written to ``sum``
// first and normalised instead (the decoder layer's residual add, fused: HF adds in the activation dtype).
// x, res, w, y and sum share the dtype T.
template <typename T>
static void rms_norm_impl(const at::Tensor& x, const at::Tensor* res, const at::Tensor& w, at::Tensor& y,
                          at::Tensor* sum, float eps) {
  const int64_t rows = x.size(0), n = x.size(1), ldx = x.stride(0), ldr = res != nullptr ? res->stride(0) : 0;
  const T* xp = x.data_ptr<T>();
  const T* rp = res != nullptr ? res->data_ptr<T>() : nullptr;
  const T* wp = w.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  T* sp = sum != nullptr ? sum->data_ptr<T>() : nullptr;
  at::parallel_for(0, rows, grain(n), [&](int64_t b, int64_t e) {
    std::vector<float> tmp(n);
    for (int64_t r = b; r < e; ++r) {
      const T* src = xp + r * ldx;
      if (rp != nullptr) {
        T* s = sp + r * n;
        for (int64_t i = 0; i < n; ++i) s[i] = from_f<T>(to_f(src[i]) + to_f(rp[r * ldr + i]));
        src = s;
      }
      norm_row(src, wp, tmp.data(), n, eps);
      for (int64_t i = 0; i < n; ++i) yp[r * n + i] = from_f<T>(tmp[i]);
    }
  });
}

static void rms_norm_any(const at::Tensor& x, const at::Tensor* res, const at::Tensor& w, at::Tensor& y,
                         at::Tensor* sum, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous(),
              "rms_norm: x must be [T, n] with a contiguous last dim and w [n]");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "rms_norm: x and w must have one dtype");
  pybind11::gil_scoped_release no_gil;
  const auto xt = x.scalar_type();
  if (xt == at::kFloat) rms_norm_impl<float>(x, res, w, y, sum, (float)eps);
  else if (xt == at::kBFloat16) rms_norm_impl<at::BFloat16>(x, res, w, y, sum, (float)eps);
  else if (xt == at::kHalf) rms_norm_impl<at::Half>(x, res, w, y, sum, (float)eps);
  else TORCH_CHECK(false, "rms_norm: unsupported dtypes");
}

at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) {
  // x: [T, n] (rows may be strided; last dim contiguous); w: [n] -> [T, n] contiguous, x's dtype.
  auto y = at::empty({x.size(0), x.size(1)}, x.options());
  rms_norm_any(x, nullptr, w, y, nullptr, eps);
  return y;
}

std::vector<at::Tensor> add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor w, double eps) {
  // x, residual: [T, n] of one dtype (last dims contiguous); w: [n] -> (norm(x + residual), x + residual), both
  // [T, n] contiguous in x's dtype.
  TORCH_CHECK(residual.dim() == 2 && residual.sizes() == x.sizes() && residual.stride(1) == 1 &&
              residual.scalar_type() == x.scalar_type(), "add_rms_norm: x and residual must be [T, n] of one dtype");
  auto y = at::empty({x.size(0), x.size(1)}, x.options());
  auto sum = at::empty({x.size(0), x.size(1)}, x.options());
  rms_norm_any(x, &residual, w, y, &sum, eps);
  return {y, sum};
}

// One head: y = rope(round_T(norm(x))), rotate-half layout; cos/sin rows of D/2 values (fp32). No weight
// (w null): no norm, y = rope(x).
template <typename T, typename W>
static inline void head_norm_rope(const T* x, const W* w, const float* c, const float* s, T* y, int64_t d,
                                  float eps, float* tmp) {
  if (w != nullptr) {
    norm_row(x, w, tmp, d, eps);
  } else {
    for (int64_t i = 0; i < d; ++i) tmp[i] = to_f(x[i]);
  }
  const int64_t h = d / 2;
  for (int64_t i = 0; i < h; ++i) {
    const float x1 = round_to<T>(tmp[i]), x2 = round_to<T>(tmp[i + h]);
    y[i] = from_f<T>(x1 * c[i] - x2 * s[i]);
    y[i + h] = from_f<T>(x2 * c[i] + x1 * s[i]);
  }
}

template <typename T, typename W>
static void qk_norm_rope_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& wq,
                              const at::Tensor& wk, const at::Tensor& cos, const at::Tensor& sin,
                              const at::Tensor& pos, at::Tensor& qo, at::Tensor& ko, float eps) {
  const int64_t t_n = q.size(0), hq = q.size(1), hk = k.size(1), d = q.size(2);
  const int64_t ldq = q.stride(0), ldk = k.stride(0), half = cos.size(1);
  const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>();
  const W *wqp = wq.numel() ? wq.data_ptr<W>() : nullptr, *wkp = wk.numel() ? wk.data_ptr<W>() : nullptr;
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const Index pp(pos);
  T *qop = qo.data_ptr<T>(), *kop = ko.data_ptr<T>();
  at::parallel_for(0, t_n, grain((hq + hk) * d), [&](int64_t b, int64_t e) {
    std::vector<float> tmp(d);
    for (int64_t t = b; t < e; ++t) {
      const float* c = cp + pp[t] * half;
      const float* s = sp + pp[t] * half;
      for (int64_t h = 0; h < hq; ++h)
        head_norm_rope(qp + t * ldq + h * d, wqp, c, s, qop + (t * hq + h) * d, d, eps, tmp.data());
      for (int64_t h = 0; h < hk; ++h)
        head_norm_rope(kp + t * ldk + h * d, wkp, c, s, kop + (t * hk + h) * d, d, eps, tmp.data());
    }
  });
}

std::vector<at::Tensor> qk_norm_rope(at::Tensor q, at::Tensor k, at::Tensor wq, at::Tensor wk,
                                        at::Tensor cos, at::Tensor sin, at::Tensor pos, double eps) {
  // q: [T, Hq, D], k: [T, Hkv, D] (views into the fused qkv output: rows strided, heads contiguous);
  // wq, wk: [D], or both empty (no norm: the rotary embedding alone); cos, sin: [max_positions, D/2] fp32;
  // pos: [T] int32/int64 -> contiguous q, k.
  const int64_t d = q.size(2);
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.size(0) == q.size(0) && k.size(2) == d && d % 2 == 0,
              "qk_norm_rope: q [T, Hq, D] and k [T, Hkv, D]");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == d && k.stride(2) == 1 && k.stride(1) == d,
              "qk_norm_rope: heads must be contiguous");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous() && cos.size(1) * 2 == d && pos.numel() == q.size(0),
              "qk_norm_rope: cos/sin [P, D/2] fp32 and [T] positions");
  const Index checked(pos);
  for (int64_t t = 0; t < pos.numel(); ++t)
    TORCH_CHECK(checked[t] >= 0 && checked[t] < cos.size(0), "qk_norm_rope: position ", checked[t],
                " is outside the table");
  TORCH_CHECK(wq.is_contiguous() && wk.is_contiguous() && wq.numel() == wk.numel() &&
              (wq.numel() == d || wq.numel() == 0) && wq.scalar_type() == wk.scalar_type() &&
              k.scalar_type() == q.scalar_type(), "qk_norm_rope: weights");
  auto qo = at::empty({q.size(0), q.size(1), d}, q.options());
  auto ko = at::empty({k.size(0), k.size(1), d}, k.options());
  pybind11::gil_scoped_release no_gil;
  const auto xt = q.scalar_type(), wt = wq.scalar_type();
  if (xt == at::kFloat && wt == at::kFloat)
    qk_norm_rope_impl<float, float>(q, k, wq, wk, cos, sin, pos, qo, ko, (float)eps);
  else if (xt == at::kBFloat16 && wt == at::kBFloat16)
    qk_norm_rope_impl<at::BFloat16, at::BFloat16>(q, k, wq, wk, cos, sin, pos, qo, ko, (float)eps);
  else if (xt == at::kHalf && wt == at::kHalf)
    qk_norm_rope_impl<at::Half, at::Half>(q, k, wq, wk, cos, sin, pos, qo, ko, (float)eps);
  else TORCH_CHECK(false, "qk_norm_rope: unsupported dtypes");
  return {qo, ko};
}

template <typename T>
static void silu_and_mul_impl(const at::Tensor& x, at::Tensor& y) {
  const int64_t rows = x.size(0), n = x.size(1) / 2, ldx = x.stride(0);
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  at::parallel_for(0, rows, grain(n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* gate = xp + r * ldx;
      const T* up = gate + n;
      T* out = yp + r * n;
      int64_t i = 0;
      for (; i + VW <= n; i += VW) {
        const vf g = loadv(gate + i);
        const vf s = round_v<T>(g / (1.f + expv(-g)));  // silu(g) = g / (1 + exp(-g)), in T (as torch)
        storev(out + i, s * loadv(up + i));
      }
      for (; i < n; ++i) {
        const float g = to_f(gate[i]);
        out[i] = from_f<T>(round_to<T>(g / (1.f + std::exp(-g))) * to_f(up[i]));
      }
    }
  });
}

at::Tensor silu_and_mul(at::Tensor x) {
  // x: [T, 2n] = gate | up (rows may be strided) -> [T, n] = silu(gate) * up, x's dtype.
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0 && x.stride(1) == 1, "silu_and_mul: x must be [T, 2n]");
  auto y = at::empty({x.size(0), x.size(1) / 2}, x.options());
  pybind11::gil_scoped_release no_gil;
  if (x.scalar_type() == at::kFloat) silu_and_mul_impl<float>(x, y);
  else if (x.scalar_type() == at::kBFloat16) silu_and_mul_impl<at::BFloat16>(x, y);
  else if (x.scalar_type() == at::kHalf) silu_and_mul_impl<at::Half>(x, y);
  else TORCH_CHECK(false, "silu_and_mul: unsupported dtype");
  return y;
}

void store_kv(at::Tensor key, at::Tensor value, at::Tensor k_cache, at::Tensor v_cache,
              at::Tensor slots) {
  // key, value: [T, Hkv, D] (rows may be strided; heads contiguous); caches [B, S, Hkv, D] contiguous;
  // slots: [T] int32/int64, -1 = do not store. Checked by the caller (rtp.kernels.kv_store).
  const int64_t t_n = key.size(0), width = key.size(1) * key.size(2), item = key.element_size();
  const int64_t ldk = key.stride(0) * item, ldv = value.stride(0) * item, row = width * item;
  const int64_t cap = k_cache.numel() / width;
  const char *kp = static_cast<const char*>(key.data_ptr()), *vp = static_cast<const char*>(value.data_ptr());
  char *kc = static_cast<char*>(k_cache.data_ptr()), *vc = static_cast<char*>(v_cache.data_ptr());
  TORCH_CHECK(slots.numel() == t_n, "store_kv: one slot per token");
  const Index sp(slots);
  for (int64_t t = 0; t < t_n; ++t) TORCH_CHECK(sp[t] < cap, "store_kv: slot ", sp[t], " is outside the cache");
  pybind11::gil_scoped_release no_gil;
  at::parallel_for(0, t_n, grain(width), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      if (sp[t] < 0) continue;
      std::memcpy(kc + sp[t] * row, kp + t * ldk, row);
      std::memcpy(vc + sp[t] * row, vp + t * ldv, row);
    }
  });
}
"""


@functools.lru_cache(maxsize=1)
def load() -> ModuleType | None:
    """Build (first use) and import the kernels; None where they cannot be built."""
    return build("cpu_ops", _SOURCE, ["rms_norm", "add_rms_norm", "qk_norm_rope", "silu_and_mul", "store_kv"])


def available() -> bool:
    """True when the kernels built on this machine."""
    return load() is not None


def _module() -> ModuleType:
    module = load()
    if module is None:
        raise RuntimeError("the CPU layer-op kernels are not available on this machine")
    return module


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of ``x [..., n]`` (last dim contiguous) with ``weight [n]``; x's dtype."""
    if x.dim() == 2:  # the hidden states' shape: skip the reshapes (a few us each at decode shapes)
        return _module().rms_norm(x, weight, eps)
    return _module().rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` for ``x, residual [T, n]`` of one dtype (the sum rounded to it,
    as torch adds), in one pass; both new contiguous tensors."""
    y, total = _module().add_rms_norm(x, residual, weight, eps)
    return y, total


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm then rotary embedding of ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` at ``positions [T]``.

    ``cos``/``sin``: ``[max_positions, D/2]`` float32 tables. Returns contiguous tensors.
    """
    qo, ko = _module().qk_norm_rope(q, k, q_weight, k_weight, cos, sin, positions, eps)
    return qo, ko


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary embedding alone (no norm) of ``q [T, Hq, D]`` and ``k [T, Hkv, D]``; as :func:`qk_norm_rope`."""
    none = q.new_empty(0)
    qo, ko = _module().qk_norm_rope(q, k, none, none, cos, sin, positions, 0.0)
    return qo, ko


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x [T, 2n]`` = gate ‖ up -> ``[T, n]``."""
    return _module().silu_and_mul(x)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Copy each token's K/V rows to its cache slot (slots of -1 are skipped); arguments already checked."""
    _module().store_kv(key, value, k_cache, v_cache, slot_mapping)
