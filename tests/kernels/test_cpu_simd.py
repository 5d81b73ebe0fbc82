"""The shared SIMD header's exponentials (exp8, and expv in whole registers) against torch.exp, edges included:
the online softmaxes of the attention kernels and the SwiGLUs of the GEMM and ops kernels rest on them."""

import math

import pytest
import torch

from rtp.kernels.cpu_build import build
from rtp.kernels.cpu_simd import SIMD_HEADER

_SOURCE = SIMD_HEADER + r"""

// y = exp8(x) (eight lanes) or expv(x) (a whole register) over x [n], n a multiple of VW.
at::Tensor exps(at::Tensor x, bool whole) {
  x = x.contiguous();
  auto y = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); i += whole ? VW : 8) {
    if (whole) storev(yp + i, expv(loadv(xp + i)));
    else store8(yp + i, exp8(load8(xp + i)));
  }
  return y;
}
"""


@pytest.fixture(scope="module")
def module():
    m = build("cpu_simd_test", _SOURCE, ["exps"])
    if m is None:
        pytest.skip("no C++ toolchain for the CPU kernels")
    return m


@pytest.mark.parametrize("whole", [False, True], ids=["exp8", "expv"])
def test_exp_matches_torch(module, whole):
    x = torch.cat([torch.linspace(-90.0, 88.3, 4096), torch.randn(4096) * 10, torch.rand(4096) * -30])
    got = module.exps(x, whole)
    want = torch.exp(x.double())
    normal = want > torch.finfo(torch.float32).tiny  # denormal results may flush: compare normal ones closely
    rel = ((got.double() - want) / want)[normal].abs().max().item()
    assert rel < 4e-7, rel
    assert (got[~normal] >= 0).all() and (got[~normal] < 1e-37).all()


@pytest.mark.parametrize("whole", [False, True], ids=["exp8", "expv"])
def test_exp_edges(module, whole):
    edges = [-math.inf, -1e30, -200.0, -104.0, 0.0, -0.0, 88.3, 89.0, 200.0, 1e30, math.inf, math.nan]
    x = torch.tensor(edges + [0.0] * (16 - len(edges)))
    got = module.exps(x, whole)[: len(edges)]
    assert got[:4].tolist() == pytest.approx([0.0] * 4, abs=1e-38)  # far below the range: 0
    assert got[4].item() == 1.0 and got[5].item() == 1.0
    assert got[6].item() == pytest.approx(math.exp(x[6].item()), rel=1e-6)  # near FLT_MAX (exp8 saturates from 88.38)
    assert all(math.isinf(v) and v > 0 for v in got[7:11].tolist())  # above it: +inf, as std::exp
    assert math.isnan(got[11].item())  # a NaN stays one
