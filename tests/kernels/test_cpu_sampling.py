"""The C++ top-p boundary (rtp.kernels.cpu_sampling) against the sampler's sorting torch code."""

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
