"""The top-p boundary of sampler rows on a CPU without sorting them.

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

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
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
torch::Tensor top_p_threshold(const torch::Tensor& probs, const torch::Tensor& top_p) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == at::kFloat && probs.is_contiguous(),
              "top_p_threshold: probs must be a contiguous [rows, vocab] float32 tensor");
  TORCH_CHECK(top_p.dim() == 1 && top_p.scalar_type() == at::kFloat && top_p.is_contiguous() &&
              top_p.size(0) == probs.size(0), "top_p_threshold: top_p must be a contiguous [rows] float32 tensor");
  const int64_t rows = probs.size(0), vocab = probs.size(1);
  TORCH_CHECK(vocab > 0, "top_p_threshold: empty rows");
  auto out = torch::empty({rows}, probs.options());
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
"""


@functools.lru_cache(maxsize=1)
def load() -> ModuleType | None:
    """Build (first use) and import the kernel; None where it cannot be built (the sort stays)."""
    return build("cpu_sampling", _SOURCE, ["top_p_threshold"])


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
