"""Sampler kernels for CPUs: the top-p boundary without sorting, and the draw from a softmax in one pass.

The draw (:func:`draw_rows`): torch's softmax then the inverse-CDF walk over its probabilities read and wrote
a row of Qwen3's 151,936 tokens five times (2.7 ms a step for 32 rows, ~6% of a bf16 Qwen3-0.6B decode step);
here each row is read twice (its maximum, then the exponentials' block sums, from L2) and nothing is written.

The top-p boundary of sampler rows on a CPU without sorting them.

Top-p keeps, in descending order of probability, every token while the mass before it is below
``top_p``; the sampler then keeps every token whose probability is at least the last kept one
(:func:`rtp.runtime.sampler._top_p_threshold`). Found by sorting, a row of Qwen3's 151,936 tokens
costs several milliseconds, and the 1024-token head that spares most rows the sort still costs a
``topk`` over the row (~12 ms for 32 rows); a flat row (random logits, a high temperature) is
sorted whole (~290 ms for 32 rows).

Here each row takes one pass: the probabilities' mass is summed per bucket of their float bits
(the exponent and 5 mantissa bits, so buckets descend with the value), the buckets are walked from
the top to the one where the mass reaches ``top_p``, and only that bucket's values are sorted to
find the boundary. The mass is summed in double, as torch's CPU ``cumsum`` of float32 accumulates,
so the boundary is the sort's: only a mass within a rounding of ``top_p`` could differ.
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
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

// Buckets of a non-negative float's bits >> 18: the exponent and 5 mantissa bits, descending with the value.
constexpr int SHIFT = 18;
constexpr int64_t NUM_BUCKETS = (int64_t{0x7FFFFFFF} >> SHIFT) + 1;
constexpr int64_t INF_BUCKET = int64_t{0x7F800000} >> SHIFT;  // this one and those above hold inf and NaN

static inline uint32_t key_of(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  return (bits & 0x7FFFFFFFu) >> SHIFT;  // -0.0 with +0.0
}

// probs [rows, V] float32 (a row's softmax), top_p [rows] float32 -> [rows] float32: the probability of each
// row's last kept token (0 where top_p >= 1: nothing dropped; NaN for a row whose mass is NaN, as the sort).
at::Tensor top_p_threshold(const at::Tensor& probs, const at::Tensor& top_p) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == at::kFloat && probs.is_contiguous(),
              "top_p_threshold: probs must be a contiguous [rows, vocab] float32 tensor");
  TORCH_CHECK(top_p.dim() == 1 && top_p.scalar_type() == at::kFloat && top_p.is_contiguous() &&
              top_p.size(0) == probs.size(0), "top_p_threshold: top_p must be a contiguous [rows] float32 tensor");
  const int64_t rows = probs.size(0), vocab = probs.size(1);
  TORCH_CHECK(vocab > 0, "top_p_threshold: empty rows");
  auto out = at::empty({rows}, probs.options());
  const float* pp = probs.data_ptr<float>();
  const float* tp = top_p.data_ptr<float>();
  float* op = out.data_ptr<float>();
  pybind11::gil_scoped_release no_gil;
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    std::vector<double> mass(NUM_BUCKETS);
    std::vector<int32_t> count(NUM_BUCKETS);
    std::vector<float> bucket;
    for (int64_t r = b; r < e; ++r) {
      const float* x = pp + r * vocab;
      const float p = tp[r];
      if (!(p < 1.f)) { op[r] = 0.f; continue; }
      std::fill(mass.begin(), mass.end(), 0.0);
      std::fill(count.begin(), count.end(), 0);
      for (int64_t i = 0; i < vocab; ++i) {
        const uint32_t k = key_of(x[i]);
        mass[k] += x[i];
        count[k] += 1;
      }
      bool broken = false;  // a NaN (or inf) probability: the buckets from inf's bits up
      for (int64_t k = INF_BUCKET; k < NUM_BUCKETS; ++k) broken = broken || count[k] > 0;
      if (broken) { op[r] = std::numeric_limits<float>::quiet_NaN(); continue; }
      // The bucket holding the last kept token: the first, from the top, whose mass takes the sum to top_p
      // (else the lowest: every token is kept).
      double above = 0.0;
      int64_t k = NUM_BUCKETS - 1, lowest = -1;
      for (; k >= 0; --k) {
        if (count[k] == 0) continue;
        lowest = k;
        if (static_cast<float>(above + mass[k]) >= p) break;
        above += mass[k];
      }
      if (k < 0) {  // the whole row's mass is below top_p: its smallest value is the boundary
        k = lowest;
        above -= mass[k];
      }
      bucket.clear();
      for (int64_t i = 0; i < vocab; ++i)
        if (key_of(x[i]) == static_cast<uint32_t>(k)) bucket.push_back(x[i]);
      std::sort(bucket.begin(), bucket.end(), std::greater<float>());
      float last = bucket.front();
      double before = above;
      for (const float v : bucket) {  // as the sorted walk: a token is kept while the mass before it is below top_p
        if (!(static_cast<float>(before) < p)) break;
        last = v;
        before += v;
      }
      op[r] = last;
    }
  });
  return out;
}

typedef int32_t vmask __attribute__((vector_size(sizeof(vf))));  // lane masks of comparisons

// x [rows, V] float32 or bf16 -> [rows] int64: torch's argmax of each row (the first index of the maximum; the
// first NaN where the row has one). Chunks of ARGMAX_CHUNK: their maxima in whole registers, then the first
// chunk holding the row's maximum is searched.
constexpr int64_t ARGMAX_CHUNK = 8 * VW;
template <typename T>
static void argmax_impl(const T* xp, int64_t rows, int64_t vocab, int64_t ldx, int64_t* op) {
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* row = xp + r * ldx;
      float best = -std::numeric_limits<float>::infinity();
      int64_t at_chunk = 0, nan_chunk = -1;
      int64_t c = 0;
      for (; c + ARGMAX_CHUNK <= vocab; c += ARGMAX_CHUNK) {
        vf mx = loadv(row + c);
        vmask nan = (vmask)(mx != mx);
        for (int64_t i = VW; i < ARGMAX_CHUNK; i += VW) {
          const vf v = loadv(row + c + i);
          mx = v > mx ? v : mx;
          nan |= (vmask)(v != v);
        }
        bool any_nan = false;
        float m = mx[0];
        for (int j = 0; j < VW; ++j) { m = std::max(m, mx[j]); any_nan = any_nan || nan[j] != 0; }
        if (any_nan) { nan_chunk = c; break; }
        if (m > best) { best = m; at_chunk = c; }
      }
      int64_t found = -1;
      if (nan_chunk < 0) {
        for (int64_t i = c; i < vocab; ++i) {  // the tail, one by one
          const float v = static_cast<float>(row[i]);
          if (v != v) { found = i; break; }
          if (v > best) { best = v; at_chunk = i; }
        }
        if (found < 0 && at_chunk < c) {
          for (int64_t i = at_chunk; found < 0; ++i) if (static_cast<float>(row[i]) == best) found = i;
        } else if (found < 0) {
          found = at_chunk;  // a tail value (or the first token of a row of -inf)
        }
      } else {
        for (int64_t i = nan_chunk; found < 0; ++i) if (row[i] != row[i]) found = i;
      }
      op[r] = found;
    }
  });
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0 &&
              (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "argmax_rows: x must be a [rows, vocab] float32 or bf16 tensor with contiguous rows");
  auto out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  pybind11::gil_scoped_release no_gil;
  if (x.scalar_type() == at::kFloat)
    argmax_impl(x.data_ptr<float>(), x.size(0), x.size(1), x.stride(0), out.data_ptr<int64_t>());
  else
    argmax_impl(x.data_ptr<at::BFloat16>(), x.size(0), x.size(1), x.stride(0), out.data_ptr<int64_t>());
  return out;
}

// The exponentials exp((x[i] - m) * s) of one block of n <= DRAW_BLOCK values into e[0 .. n) (0 past n and for
// x = -inf, a masked token; NaN for a NaN), in whole registers; both passes of draw_rows call this for a block,
// so they see the same values.
constexpr int64_t DRAW_BLOCK = 128;
static inline float block_exps(const float* x, int64_t n, float m, float s, float* e) {
  float pad[DRAW_BLOCK];
  if (n < DRAW_BLOCK) {  // the row's last block: padded with -inf
    std::fill(pad, pad + DRAW_BLOCK, -std::numeric_limits<float>::infinity());
    std::memcpy(pad, x, n * sizeof(float));
    x = pad;
  }
  vf sum = {};
  const vf ninf = vf{} - std::numeric_limits<float>::infinity(), mv = vf{} + m, sv = vf{} + s;
  for (int64_t i = 0; i < DRAW_BLOCK; i += VW) {
    const vf xv = loadv(x + i);
    const vf ev = (vf)((vmask)expv((xv - mv) * sv) & (vmask)(xv != ninf));
    storev(e + i, ev);
    sum += ev;
  }
  float total = 0.f;
  for (int j = 0; j < VW; ++j) total += sum[j];
  return total;
}

// x [rows, V] float32 logits, u [rows] float64 in [0, 1), inv_temp [rows] float32 (> 0) -> [rows] int64: the
// first token whose running sum of exp((x - max) * inv_temp) exceeds u times the row's total, i.e. a draw
// from softmax(x * inv_temp). Blocks of DRAW_BLOCK tokens are summed (float), the block is found on their
// running sums (double), then the token on the running sum (double) inside it; where rounding leaves none
// there, the block's last token of positive mass. Never a token of zero mass (x = -inf). -1 for a row whose
// total is not a positive finite number (all -inf, a NaN or +inf logit): the caller decides.
at::Tensor draw_rows(const at::Tensor& x, const at::Tensor& u, const at::Tensor& inv_temp) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "draw_rows: x must be a [rows, vocab] float32 tensor with contiguous rows");
  const int64_t rows = x.size(0), vocab = x.size(1), ldx = x.stride(0);
  TORCH_CHECK(u.dim() == 1 && u.scalar_type() == at::kDouble && u.is_contiguous() && u.size(0) == rows,
              "draw_rows: u must be a contiguous [rows] float64 tensor");
  TORCH_CHECK(inv_temp.dim() == 1 && inv_temp.scalar_type() == at::kFloat && inv_temp.is_contiguous() &&
              inv_temp.size(0) == rows, "draw_rows: inv_temp must be a contiguous [rows] float32 tensor");
  TORCH_CHECK(vocab > 0, "draw_rows: empty rows");
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  const double* up = u.data_ptr<double>();
  const float* tp = inv_temp.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t blocks = (vocab + DRAW_BLOCK - 1) / DRAW_BLOCK;
  pybind11::gil_scoped_release no_gil;
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    std::vector<float> block_sum(blocks);
    float ex[DRAW_BLOCK];
    for (int64_t r = b; r < e; ++r) {
      const float* row = xp + r * ldx;
      const float s = tp[r];
      vf mx = vf{} - std::numeric_limits<float>::infinity();
      int64_t i = 0;
      for (; i + VW <= vocab; i += VW) { const vf v = loadv(row + i); mx = v > mx ? v : mx; }
      float m = -std::numeric_limits<float>::infinity();
      for (int j = 0; j < VW; ++j) m = std::max(m, mx[j]);
      for (; i < vocab; ++i) m = std::max(m, row[i]);
      if (!(s > 0.f) || !std::isfinite(m)) { op[r] = -1; continue; }
      double total = 0.0;
      for (int64_t k = 0; k < blocks; ++k) {
        block_sum[k] = block_exps(row + k * DRAW_BLOCK, std::min(DRAW_BLOCK, vocab - k * DRAW_BLOCK), m, s, ex);
        total += block_sum[k];
      }
      if (!(total > 0.0) || !std::isfinite(total)) { op[r] = -1; continue; }  // a NaN logit
      const double target = up[r] * total;
      double before = 0.0;
      int64_t k = 0, last_positive = -1;
      for (; k < blocks; ++k) {
        if (block_sum[k] > 0.f) last_positive = k;
        if (before + block_sum[k] > target) break;
        before += block_sum[k];
      }
      const bool past = k == blocks;  // the target rounded up to the total (u -> 1): the row's last live token
      if (past) k = last_positive;
      const int64_t n = std::min(DRAW_BLOCK, vocab - k * DRAW_BLOCK);
      block_exps(row + k * DRAW_BLOCK, n, m, s, ex);
      int64_t token = -1, last = -1;
      double run = before;
      for (int64_t j = 0; j < n; ++j) {
        if (!(ex[j] > 0.f)) continue;
        last = j;
        run += ex[j];
        if (run > target && !past) { token = j; break; }
      }
      op[r] = k * DRAW_BLOCK + (token >= 0 ? token : last);
    }
  });
  return out;
}
"""


@functools.lru_cache(maxsize=1)
def load() -> ModuleType | None:
    """Build (first use) and import the kernel; None where it cannot be built (the sort stays)."""
    return build("cpu_sampling", _SOURCE, ["top_p_threshold", "argmax_rows", "draw_rows"])


def top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor | None:
    """``[rows, 1]``: each row's top-p boundary probability (see the module docstring), from ``probs``
    ``[rows, vocab]`` and ``top_p`` ``[rows, 1]`` (rows with top_p >= 1 get 0); None where the kernel
    does not apply (not a CPU tensor, or no kernel on this machine)."""
    if probs.device.type != "cpu":
        return None
    module = load()
    if module is None:
        return None
    out = module.top_p_threshold(probs.float().contiguous(), top_p.reshape(-1).float().contiguous())
    return out.unsqueeze(1)


def draw_rows(x: torch.Tensor, u: torch.Tensor, temperatures: list[float] | None = None) -> torch.Tensor | None:
    """One token per row of the logits ``x [rows, vocab]``, drawn from ``softmax(x / temperatures[row])`` with the
    uniforms ``u [rows]`` in one pass of C++ (the exponentials' running sums, no probabilities written): the
    token :func:`rtp.runtime.sampler.inverse_cdf_sample` picks, but for a ``u`` within a rounding of a boundary
    between two tokens. ``[rows]`` int64, -1 for a row without a positive finite mass (a NaN or +inf logit,
    every token -inf); None where the kernel does not apply (not a CPU tensor, or no kernel here)."""
    if x.device.type != "cpu":
        return None
    module = load()
    if module is None:
        return None
    rows = x.shape[0]
    inv = torch.ones(rows) if temperatures is None else 1.0 / torch.tensor(temperatures, dtype=torch.float32)
    xf = x if x.dtype == torch.float32 and x.stride(-1) == 1 else x.float().contiguous()
    return module.draw_rows(xf, u.reshape(-1).double().contiguous(), inv)


def argmax_rows(x: torch.Tensor) -> torch.Tensor | None:
    """``x.argmax(dim=-1)`` of ``x [rows, vocab]`` (float32 or bf16 rows with a contiguous last dim), as int64
    ``[rows]``, in one vectorised pass; None where the kernel does not apply (another device or dtype, no kernel).
    torch's CPU argmax does not vectorise: 0.2-0.7 ms for 8-24 bf16 rows of Qwen3's vocabulary, ~20 us here."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 2 or x.shape[1] == 0:
        return None
    module = load()
    if module is None:
        return None
    return module.argmax_rows(x if x.stride(-1) == 1 else x.contiguous())
