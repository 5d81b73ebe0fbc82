"""Sampled speculative decoding keeps the target's distribution: a chi-square test of homogeneity, for
n-gram drafts and for a draft model's (the target as its own draft: greedy drafts of the unpenalised
logits, so the penalties and the temperature make the target reject many of them).

A small vocabulary (six allowed tokens of the random tiny Qwen3), temperature 1, top-p 0.9, presence and
repetition penalties, a repetitive prompt and ``prompt_lookup_min = 1``, so most steps verify drafts and
both accepted and rejected drafts occur. 480 seeded requests without speculation against 480 unseeded
ones with it (independent draws); at each of the 6 output positions the two token histograms are
compared with Pearson's chi-square test of homogeneity. The test fails if any position's p-value is
below 0.001 / 6 (Bonferroni: a family-wise significance of 0.001, so a correct implementation fails one
run in a thousand; this one is deterministic, the unseeded draws come from the engine's seeded generator).
"""

from __future__ import annotations

import pytest
import torch

from rtp.config import SpeculativeConfig
from rtp.sampling import SamplingParams
from rtp.testing import default_model_dir
from tests.spec.test_spec_engine import make_engine, run

ALLOWED = [10, 11, 12, 13, 14, 15]
N, LENGTH, ALPHA = 480, 6, 0.001


def chi_square_p(a: list[int], b: list[int]) -> float:
    """p-value of Pearson's chi-square homogeneity test of two histograms over the same categories."""
    table = torch.tensor([a, b], dtype=torch.float64)
    table = table[:, table.sum(0) > 0]  # categories neither sample drew carry no information
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    df = table.shape[1] - 1
    if df == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))  # chi2 survival


def histograms(outputs: list) -> list[list[int]]:
    """[LENGTH][len(ALLOWED)] counts of each allowed token at each output position."""
    counts = [[0] * len(ALLOWED) for _ in range(LENGTH)]
    for out in outputs:
        assert len(out.token_ids) == LENGTH
        for pos, tok in enumerate(out.token_ids):
            counts[pos][ALLOWED.index(tok)] += 1
    return counts


PROMPT = [10, 11, 12] * 4


def params(seed: int | None) -> SamplingParams:
    return SamplingParams(temperature=0.7, top_p=0.9, frequency_penalty=0.7, repetition_penalty=1.2,
                          allowed_token_ids=ALLOWED, max_tokens=LENGTH, ignore_eos=True, seed=seed)


@pytest.fixture(scope="module")
def without_speculation() -> list[list[int]]:
    plain = make_engine(default_model_dir(), max_num_seqs=32, budget=512, blocks=256)
    return histograms(run(plain, [(PROMPT, params(i)) for i in range(N)]))


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_chi_square_token_distribution_with_and_without_speculation(without_speculation, method):
    model = default_model_dir()
    if method == "ngram":
        spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3,
                                 disable_by_batch_size=None, min_acceptance_rate=0.0)
    else:
        spec = SpeculativeConfig(method="draft_model", model=str(model), num_speculative_tokens=3,
                                 disable_by_batch_size=None, min_acceptance_rate=0.0)
    engine = make_engine(model, spec, max_num_seqs=32, budget=512, blocks=256)
    got = run(engine, [(PROMPT, params(None)) for _ in range(N)])
    stats = engine.stats()
    assert stats["spec_num_accepted_tokens"] > 100  # drafts were accepted ...
    assert stats["spec_num_draft_tokens"] - stats["spec_num_accepted_tokens"] > 100  # ... and rejected
    p_values = [chi_square_p(a, b) for a, b in zip(without_speculation, histograms(got))]
    assert min(p_values) > ALPHA / LENGTH, p_values
