"""The C++ sampling kernels (rtp.kernels.cpu_sampling): the top-p boundary against the sampler's sorting torch
code, the softmax draw against a float64 CDF walked in Python."""

from __future__ import annotations

import pytest
import torch

from rtp.kernels import cpu_sampling
from rtp.runtime.sampler import top_p_threshold_sorted
from tests.utils import HAS_CXX

pytestmark = pytest.mark.skipif(not HAS_CXX, reason="needs a C++ compiler")

TOP_PS = [0.01, 0.3, 0.5, 0.9, 0.95, 0.999, 1.0]


def rows_of(vocab: int, g: torch.Generator) -> torch.Tensor:
    """Logits of every kind of row: flat, peaked, very peaked, half masked, many ties, one token left."""
    flat = torch.randn(vocab, generator=g)
    peaked = torch.randn(vocab, generator=g) * 6
    spike = torch.randn(vocab, generator=g).index_fill(0, torch.tensor([vocab // 3]), 40.0)
    masked = torch.randn(vocab, generator=g).masked_fill(torch.rand(vocab, generator=g) < 0.5, float("-inf"))
    ties = (torch.randn(vocab, generator=g) * 2).round()  # a handful of distinct values, each many times
    one = torch.full((vocab,), float("-inf")).index_fill(0, torch.tensor([vocab - 1]), 0.0)
    return torch.stack([flat, peaked, spike, masked, ties, one])


@pytest.mark.parametrize("vocab", [1, 7, 1000, 151936])
def test_boundary_equals_the_sorted_walk(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    logits = rows_of(vocab, g)
    rows = logits.shape[0]
    for top_p in TOP_PS:
        for temperature in (0.5, 1.0, 2.0):
            probs = torch.softmax(logits / temperature, dim=-1)
            p = torch.full((rows, 1), top_p)
            got = cpu_sampling.top_p_threshold(probs, p)
            assert got is not None and got.shape == (rows, 1)
            want = top_p_threshold_sorted(probs, p).masked_fill(p >= 1.0, 0.0)
            assert torch.equal(got, want), (vocab, top_p, temperature, got.flatten(), want.flatten())
            kept = probs >= got
            if top_p < 1.0:  # the kept set is the smallest one reaching top_p, ties with its last token included
                mass = torch.where(kept, probs, 0.0).sum(-1, dtype=torch.float64)
                drop_last = torch.where(probs > got, probs, 0.0).sum(-1, dtype=torch.float64)
                assert bool(((mass >= top_p - 1e-5) | kept.all(-1)).all())
                assert bool((drop_last < top_p + 1e-5).all())


def test_mixed_top_p_per_row_and_nan_rows() -> None:
    g = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(5, 4096, generator=g) * 3, dim=-1)
    probs[2] = float("nan")  # broken rows (all NaN, one NaN) get a NaN boundary, as the sort gives them
    probs[3, 7] = float("nan")
    p = torch.tensor([[0.9], [1.0], [0.5], [0.2], [0.99]])
    got = cpu_sampling.top_p_threshold(probs, p)
    want = top_p_threshold_sorted(probs, p).masked_fill(p >= 1.0, 0.0)
    assert got is not None and torch.allclose(got, want, rtol=0.0, atol=0.0, equal_nan=True)
    assert bool(got[2:4].isnan().all()) and got[1].item() == 0.0 and bool(got[[0, 4]].isfinite().all())


def test_not_used_off_the_cpu() -> None:
    probs = torch.softmax(torch.randn(2, 10), -1).to("meta")
    assert cpu_sampling.top_p_threshold(probs, torch.full((2, 1), 0.9, device="meta")) is None
    assert cpu_sampling.draw_rows(probs, torch.rand(2, dtype=torch.float64).to("meta")) is None


@pytest.mark.parametrize("vocab", [1, 100, 700, 151936])
@pytest.mark.parametrize("temperature", [None, 0.7, 1.6])
def test_draw_walks_the_softmax_cdf(vocab: int, temperature: float | None) -> None:
    """The token is the first whose cumulative softmax mass exceeds u (a float64 walk in Python), but for a u
    within a rounding of the boundary; never a masked token, u = 0 and u -> 1 included."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.cat([rows_of(vocab, g), torch.randn(34, vocab, generator=g) * 3])
    logits[6:, 3:vocab // 2] = float("-inf")  # whole masked blocks between live ones
    logits[6:, 0] = 1.0  # a live token in every row
    rows = logits.shape[0]
    u = torch.rand(rows, dtype=torch.float64, generator=g)
    # u = 1 (past the range) stands for a target that rounds up to the row's total: the last live token
    u[0], u[1], u[6], u[7], u[8] = 0.0, 1.0 - 2.0**-53, 0.0, 1.0 - 2.0**-53, 1.0
    temps = None if temperature is None else [temperature] * rows
    tokens = cpu_sampling.draw_rows(logits, u, temps)
    assert tokens is not None and tokens.dtype == torch.int64 and tokens.shape == (rows,)
    scaled = logits.double() / (temperature or 1.0)
    for r in range(rows):
        mass = torch.exp(scaled[r] - scaled[r].max())
        cdf = mass.cumsum(0)
        target = u[r].item() * cdf[-1].item()
        expected = int((cdf > target).nonzero()[0]) if bool((cdf > target).any()) else int(mass.nonzero()[-1])
        t = int(tokens[r])
        assert logits[r, t] > float("-inf"), (r, t)
        assert t == expected or abs(cdf[t].item() - target) < 1e-5 * cdf[-1].item(), (r, t, expected)


def test_draw_rows_without_a_mass_are_minus_one() -> None:
    x = torch.randn(5, 300)
    x[1] = float("-inf")  # nothing left
    x[2, 7] = float("nan")
    x[3, 250] = float("inf")
    x[4, 1::2] = float("-inf")
    tokens = cpu_sampling.draw_rows(x, torch.full((5,), 0.5, dtype=torch.float64))
    assert tokens is not None
    assert tokens[1:4].tolist() == [-1, -1, -1] and tokens[0] >= 0 and tokens[4] % 2 == 0


def test_draw_reads_strided_rows_and_other_dtypes() -> None:
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(6, 1100, generator=g) * 2
    u = torch.rand(6, dtype=torch.float64, generator=g)
    x = wide[:, 50:1050]  # rows with a stride
    want = cpu_sampling.draw_rows(x.contiguous(), u)
    assert torch.equal(cpu_sampling.draw_rows(x, u), want)
    assert torch.equal(cpu_sampling.draw_rows(x.contiguous().bfloat16(), u),
                       cpu_sampling.draw_rows(x.contiguous().bfloat16().float(), u))


@pytest.mark.parametrize("vocab", [1, 5, 127, 128, 129, 1000, 151936])
def test_argmax_rows_is_torchs_argmax(vocab: int) -> None:
    """First index of the maximum, ties across and inside chunks, rows of -inf, NaN (the first one wins, as
    torch's argmax), the tail past the last whole chunk; float32 and bf16, strided rows."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(12, vocab + 3, generator=g)[:, 1:vocab + 1]  # strided rows
    x[::3, vocab // 2] = 9.0
    x[::3, vocab - 1] = 9.0
    x[1::3, : vocab // 2] = float("-inf")
    x[2] = float("-inf")
    x[4, vocab // 3] = float("nan")
    x[5, vocab - 1] = float("nan")
    x[7, vocab // 2:] = float("nan")
    x[8, -1] = 20.0  # the maximum in the tail
    for dtype in (torch.float32, torch.bfloat16):
        y = x.to(dtype)
        got = cpu_sampling.argmax_rows(y)
        assert got is not None and got.tolist() == y.argmax(dim=-1).tolist()
    assert cpu_sampling.argmax_rows(x.half()) is None  # other dtypes keep torch
