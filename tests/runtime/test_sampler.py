"""Sampler: filters against a per-row reference, seeds, min_tokens, logprobs, RNG hygiene."""

from __future__ import annotations

import math

import pytest
import torch

from rtp.runtime import sampler as sampler_module
from rtp.runtime.sampler import (
    Sampler,
    SampleRow,
    argmax_rows,
    draw,
    filter_logits,
    inverse_cdf_sample,
    is_plain_greedy,
    step_seed,
    top_k_candidates,
)
from rtp.sampling import SamplingParams

EOS = 3


def ref_keep(row: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Which tokens survive the filters, written independently, one row at a time in float64.

    top-k keeps ties with the k-th value; top-p keeps a token when the mass of
    the strictly more likely tokens is still below top_p; min-p compares with
    the largest probability. Applied in that order, each on the renormalised
    survivors of the previous one.
    """
    x = row.double() / temperature
    vocab = x.numel()
    keep = torch.ones(vocab, dtype=torch.bool)
    if 0 < top_k < vocab:
        kth = sorted(x.tolist(), reverse=True)[top_k - 1]
        keep &= x >= kth
    if top_p < 1.0:
        probs = torch.softmax(x.masked_fill(~keep, -math.inf), dim=0)
        for t in range(vocab):
            if keep[t] and probs[probs > probs[t]].sum() >= top_p:
                keep[t] = False
    if min_p > 0.0:
        probs = torch.softmax(x.masked_fill(~keep, -math.inf), dim=0)
        keep &= probs >= min_p * probs.max()
    return keep


def random_params(gen: torch.Generator, num_rows: int, vocab: int) -> list[tuple[float, int, float, float]]:
    out = []
    for _ in range(num_rows):
        r = torch.rand(4, generator=gen).tolist()
        temperature = 0.3 + 1.5 * r[0]
        top_k = [-1, 0, 1, 2, 5, vocab // 3, vocab, vocab + 7][int(r[1] * 8)]
        top_p = [1.0, 0.95, 0.7 * r[2] + 0.05, 0.3 * r[2] + 0.01][int(r[3] * 4)]
        min_p = [0.0, 0.05, 0.3 * r[2]][int(r[0] * 3)]
        out.append((temperature, top_k, top_p, min_p))
    return out


def apply_filters(logits: torch.Tensor, params: list[tuple[float, int, float, float]]) -> torch.Tensor:
    temps, ks, ps, ms = (list(col) for col in zip(*params))
    return filter_logits(logits, temps, ks, ps, ms)


@pytest.mark.parametrize("head", [None, 4])
@pytest.mark.parametrize("ties", [False, True])
def test_filter_masks_match_reference(ties: bool, head: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    if head is not None:  # top-p's sorted head shorter than the vocabulary: covered rows and whole sorts
        monkeypatch.setattr(sampler_module, "TOP_P_HEAD", head)
    gen = torch.Generator().manual_seed(1 if ties else 2)
    num_rows, vocab = 300, 40
    if ties:
        # Few distinct values: many ties, also at the top-k and top-p boundaries.
        logits = torch.randint(-3, 4, (num_rows, vocab), generator=gen).float()
    else:
        logits = torch.randn(num_rows, vocab, generator=gen) * 3
    params = random_params(gen, num_rows, vocab)
    filtered = apply_filters(logits, params)
    for i, p in enumerate(params):
        expected = ref_keep(logits[i], *p)
        got = torch.isfinite(filtered[i])
        assert torch.equal(got, expected), (i, p, got.sum().item(), expected.sum().item())
        assert got.any()
    # Kept tokens carry the temperature-scaled logit.
    temps = torch.tensor([p[0] for p in params])[:, None]
    kept = torch.isfinite(filtered)
    torch.testing.assert_close(filtered[kept], (logits / temps)[kept])


def test_each_filter_narrows_the_mask() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(50, 64, generator=gen)
    base = torch.isfinite(apply_filters(logits, [(1.0, -1, 1.0, 0.0)] * 50))
    assert base.all()
    for p in [(1.0, 5, 1.0, 0.0), (1.0, -1, 0.5, 0.0), (1.0, -1, 1.0, 0.2)]:
        mask = torch.isfinite(apply_filters(logits, [p] * 50))
        assert (mask.sum(-1) < 64).all(), p


def test_top_p_keeps_boundary_token() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.2, 0.0]]).log()  # the last token is already -inf
    for top_p, expected in [(0.45, 1), (0.55, 2), (0.85, 3), (1.0, 3)]:
        kept = torch.isfinite(filter_logits(logits, [1.0], [-1], [top_p], [0.0]))
        assert kept.sum().item() == expected, top_p
        assert kept[0, :expected].all()


def test_top_k_and_min_p_exact() -> None:
    logits = torch.tensor([[4.0, 1.0, 3.0, 3.0, 2.0]])
    kept = torch.isfinite(filter_logits(logits, [1.0], [2], [1.0], [0.0]))
    assert kept.tolist() == [[True, False, True, True, False]]  # the tie with the 2nd is kept
    probs = torch.softmax(logits, -1)[0]
    min_p = (probs[4] / probs[0]).item() * 1.001  # just above token 4's ratio
    kept = torch.isfinite(filter_logits(logits, [1.0], [-1], [1.0], [min_p]))
    assert kept.tolist() == [[True, False, True, True, False]]


def test_sampled_tokens_stay_inside_the_mask() -> None:
    gen = torch.Generator().manual_seed(4)
    num_rows, vocab = 400, 30
    logits = torch.randn(num_rows, vocab, generator=gen) * 2
    params = random_params(gen, num_rows, vocab)
    seeds = torch.randint(0, 1000, (num_rows,), generator=gen).tolist()
    rows = [
        SampleRow(SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, seed=s if i % 2 else None), 0)
        for i, ((t, k, p, m), s) in enumerate(zip(params, seeds))
    ]
    out = Sampler([EOS], seed=5).sample(logits, rows)
    for i, tok in enumerate(out.token_ids):
        assert ref_keep(logits[i], *params[i])[tok], (i, params[i])


def test_greedy_is_argmax() -> None:
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(32, 100, generator=gen)
    rows = [SampleRow(SamplingParams(temperature=0.0, top_k=3, top_p=0.5), 0) for _ in range(32)]
    out = Sampler([EOS]).sample(logits, rows)
    assert out.token_ids == logits.argmax(-1).tolist()
    # Mixed with sampled rows, greedy rows are still the argmax.
    mixed = [SampleRow(SamplingParams(temperature=0.0 if i % 2 else 1.0), 0) for i in range(32)]
    out = Sampler([EOS]).sample(logits, mixed)
    assert out.token_ids[1::2] == logits.argmax(-1)[1::2].tolist()


def test_sample_greedy_equals_sample_for_plain_greedy_rows() -> None:
    gen = torch.Generator().manual_seed(16)
    logits = torch.randn(64, 50, generator=gen)
    logits[::4, 7] = logits[::4].max(dim=-1).values  # ties: the first index must win in both
    logits[1::4, EOS] = 100.0  # EOS is the argmax: no min_tokens, so plain greedy emits it
    params = SamplingParams(temperature=0.0, top_k=3, top_p=0.5, stop_token_ids=[5])
    assert is_plain_greedy(params)
    rows = [SampleRow(params, i) for i in range(64)]
    sampler = Sampler([EOS])
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype)
        fast, full = sampler.sample_greedy(x), sampler.sample(x, rows)
        assert fast.token_ids == full.token_ids == x.float().argmax(-1).tolist()
        assert fast.logprobs == full.logprobs == [None] * 64
    assert EOS in sampler.sample_greedy(logits).token_ids


def test_is_plain_greedy_only_when_sample_needs_no_row() -> None:
    """Every setting under which sample() looks at a row's params or progress excludes the fast path."""
    assert is_plain_greedy(SamplingParams(temperature=0.0, seed=3, max_tokens=5))
    assert not is_plain_greedy(SamplingParams(temperature=0.7))
    assert not is_plain_greedy(SamplingParams(temperature=0.0, logprobs=0))
    assert not is_plain_greedy(SamplingParams(temperature=0.0, min_tokens=1))


@pytest.mark.parametrize("seeded", [False, True])
def test_sampling_frequencies_follow_the_distribution(seeded: bool) -> None:
    gen = torch.Generator().manual_seed(7)
    vocab, temperature = 8, 0.7
    num = 4000 if seeded else 20000
    base = torch.randn(vocab, generator=gen)
    logits = base.expand(num, vocab).contiguous()
    rows = [SampleRow(SamplingParams(temperature=temperature, seed=i if seeded else None), 3) for i in range(num)]
    tokens = torch.tensor(Sampler([], seed=8).sample(logits, rows).token_ids)
    counts = torch.bincount(tokens, minlength=vocab).double()
    expected = torch.softmax(base.double() / temperature, 0) * num
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    # 7 degrees of freedom: P(chi2 > 30) is about 1e-4.
    assert chi2 < 30, (counts.tolist(), expected.tolist())


def test_filtered_sampling_frequencies() -> None:
    # top-k=3 then top-p=0.8 on known probabilities: the draw is from the renormalised survivors.
    probs = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    num = 20000
    logits = probs.log().expand(num, 5).contiguous()
    rows = [SampleRow(SamplingParams(top_k=3, top_p=0.6), 0) for _ in range(num)]
    tokens = torch.tensor(Sampler([], seed=9).sample(logits, rows).token_ids)
    counts = torch.bincount(tokens, minlength=5).double()
    # top-k keeps 0.4, 0.25, 0.2 -> renormalised 0.47, 0.29, 0.24; top-p 0.6 keeps the first two.
    kept = torch.tensor([0.4, 0.25, 0.0, 0.0, 0.0])
    expected = kept / kept.sum() * num
    assert counts[2:].sum() == 0
    assert abs(counts[0] - expected[0]) < 5 * math.sqrt(expected[0].item())


def run_steps(sampler: Sampler, batches: list[list[SampleRow]], logits_per_step: list[torch.Tensor]) -> list[list[int]]:
    return [sampler.sample(lg, rows).token_ids for lg, rows in zip(logits_per_step, batches)]


def test_seed_reproducible_across_batch_compositions() -> None:
    gen = torch.Generator().manual_seed(10)
    vocab, steps = 500, 6
    target_params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    # Flat-ish logits, so that different noise would give different tokens.
    target_logits = [torch.randn(vocab, generator=gen) * 0.5 for _ in range(steps)]

    def tokens_in(batch_size: int, position: int, sampler_seed: int) -> list[int]:
        sampler = Sampler([EOS], seed=sampler_seed)
        out = []
        for step in range(steps):
            logits = torch.randn(batch_size, vocab, generator=gen)
            logits[position] = target_logits[step]
            rows = [
                SampleRow(SamplingParams(temperature=1.0, seed=(100 + j) if j % 2 else None), step)
                for j in range(batch_size)
            ]
            rows[position] = SampleRow(target_params, step)
            out.append(sampler.sample(logits, rows).token_ids[position])
        return out

    alone = tokens_in(1, 0, 0)
    assert tokens_in(5, 3, 1) == alone
    assert tokens_in(9, 8, 2) == alone
    assert tokens_in(4, 0, 3) == alone
    assert len(set(alone)) > 1  # noise changes from step to step


def test_different_seeds_differ() -> None:
    gen = torch.Generator().manual_seed(11)
    vocab, steps, num_seeds = 1000, 4, 20
    logits = [torch.randn(vocab, generator=gen) * 0.1 for _ in range(steps)]
    sequences = set()
    for seed in range(num_seeds):
        sampler = Sampler([EOS])
        rows = [SampleRow(SamplingParams(seed=seed), s) for s in range(steps)]
        sequences.add(tuple(sampler.sample(logits[s][None], [rows[s]]).token_ids[0] for s in range(steps)))
    assert len(sequences) >= num_seeds - 1
    # The same seed and the same logits still give fresh noise at every step.
    sampler = Sampler([EOS])
    repeated = [sampler.sample(logits[0][None], [SampleRow(SamplingParams(seed=5), s)]).token_ids[0] for s in range(8)]
    assert len(set(repeated)) > 1
    assert len({step_seed(a, b) for a in range(30) for b in range(30)}) == 900


def test_unseeded_rows_follow_the_sampler_seed() -> None:
    gen = torch.Generator().manual_seed(12)
    logits = torch.randn(16, 300, generator=gen) * 0.2
    rows = [SampleRow(SamplingParams(), 0) for _ in range(16)]
    a = Sampler([EOS], seed=1).sample(logits, rows).token_ids
    assert Sampler([EOS], seed=1).sample(logits, rows).token_ids == a
    assert Sampler([EOS], seed=2).sample(logits, rows).token_ids != a
    sampler = Sampler([EOS], seed=1)
    sampler.sample(logits, rows)
    assert sampler.sample(logits, rows).token_ids != a  # the stream moves on


def test_min_tokens_masks_eos_and_stop_tokens() -> None:
    vocab = 20
    logits = torch.zeros(6, vocab)
    logits[:, EOS] = 50.0
    logits[:, 7] = 40.0
    logits[:, 11] = 30.0
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7, 99])
    sampled = SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[7])
    rows = [
        SampleRow(params, 0),
        SampleRow(params, 2),
        SampleRow(params, 3),  # min_tokens reached: EOS allowed again
        SampleRow(sampled, 1),
        SampleRow(SamplingParams(temperature=0.0), 0),  # no min_tokens
        SampleRow(sampled, 5),
    ]
    out = Sampler([EOS, 15]).sample(logits, rows)
    assert out.token_ids[:3] == [11, 11, EOS]
    assert out.token_ids[3] not in (EOS, 7, 15)
    assert out.token_ids[4] == EOS
    assert out.token_ids[5] == EOS  # 50 vs 0: overwhelmingly likely
    for _ in range(20):
        tok = Sampler([EOS, 15], seed=_).sample(logits[3:4], [rows[3]]).token_ids[0]
        assert tok not in (EOS, 7, 15)


def test_min_tokens_never_masks_every_token() -> None:
    logits = torch.tensor([[1.0, 2.0], [2.0, 1.0]])
    rows = [SampleRow(SamplingParams(temperature=t, min_tokens=2), 0) for t in (0.0, 1.0)]
    out = Sampler([0, 1]).sample(logits, rows)
    assert out.token_ids[0] == 1
    assert out.token_ids[1] in (0, 1)


def test_logprobs_are_raw_log_softmax() -> None:
    gen = torch.Generator().manual_seed(13)
    logits = torch.randn(5, 50, generator=gen) * 2
    rows = [
        SampleRow(SamplingParams(temperature=0.5, top_k=5, logprobs=3), 0),
        SampleRow(SamplingParams(temperature=0.0, logprobs=0), 0),
        SampleRow(SamplingParams(temperature=1.0), 0),
        SampleRow(SamplingParams(temperature=1.2, min_p=0.1, logprobs=20, min_tokens=1), 0),
        SampleRow(SamplingParams(temperature=0.8, seed=4, logprobs=1), 0),
    ]
    out = Sampler([EOS]).sample(logits, rows)
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert out.logprobs[2] is None
    for i, n in [(0, 3), (1, 0), (3, 20), (4, 1)]:
        entry = out.logprobs[i]
        assert entry is not None
        tok = out.token_ids[i]
        top = ref[i].topk(n).indices.tolist() if n else []
        assert set(entry) == set(top) | {tok}
        for t, lp in entry.items():
            assert abs(lp - ref[i, t].item()) < 1e-5


def test_no_global_rng_use_and_no_input_mutation() -> None:
    gen = torch.Generator().manual_seed(14)
    logits = torch.randn(6, 40, generator=gen)
    before_logits = logits.clone()
    rows = [
        SampleRow(SamplingParams(temperature=1.0, top_p=0.9, min_tokens=2), 0),
        SampleRow(SamplingParams(temperature=0.7, top_k=4, seed=3), 1),
        SampleRow(SamplingParams(temperature=0.0, logprobs=2), 0),
        SampleRow(SamplingParams(min_p=0.1), 2),
        SampleRow(SamplingParams(seed=9), 0),
        SampleRow(SamplingParams(), 0),
    ]
    state = torch.random.get_rng_state()
    Sampler([EOS, 1, 2]).sample(logits, rows)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(logits, before_logits)


@pytest.mark.parametrize("vocab", [1, 50, 128, 300, 1000])
@pytest.mark.parametrize("kernel", [True, False], ids=["cpu-kernel", "torch"])
def test_argmax_rows_is_argmax(vocab: int, kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not kernel:  # the blocked torch code other devices run
        monkeypatch.setattr(sampler_module.cpu_sampling, "argmax_rows", lambda x: None)
    gen = torch.Generator().manual_seed(15)
    x = torch.randn(12, vocab, generator=gen)
    x[::3, vocab // 2] = 9.0
    x[::3, vocab - 1] = 9.0  # a tie across blocks: the first index wins
    x[1::3, : vocab // 2] = float("-inf")
    x[2] = float("-inf")  # every token masked: index 0, as argmax
    for dtype in (torch.float32, torch.bfloat16):
        assert argmax_rows(x.to(dtype)).tolist() == x.to(dtype).argmax(dim=-1).tolist()


def test_inverse_cdf_sample_walks_the_cdf_exactly() -> None:
    # Against a float64 CDF walked in Python: the first token whose cumulative mass exceeds u * total.
    gen = torch.Generator().manual_seed(17)
    vocab = 700  # several blocks and a padded last one
    probs = torch.softmax(torch.randn(40, vocab, generator=gen) * 3, dim=-1)
    probs[:, 5:400] = 0.0  # whole blocks of zeros, and tokens that must never be drawn
    u = torch.rand(40, dtype=torch.float64, generator=gen)
    u[0], u[1] = 0.0, 1.0 - 2.0**-53
    tokens = inverse_cdf_sample(probs, u).tolist()
    for r in range(40):
        cdf = probs[r].double().cumsum(0)
        target = u[r].item() * cdf[-1].item()
        expected = int((cdf > target).nonzero()[0])
        assert probs[r, tokens[r]] > 0, r
        # float32 block sums may move a boundary by ~1e-7 of the mass: allow the neighbouring token then.
        assert tokens[r] == expected or abs(cdf[tokens[r]].item() - target) < 1e-6, (r, tokens[r], expected)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6, top_k=40),
    SamplingParams(temperature=1.3, top_p=0.7),
    SamplingParams(temperature=1.0, top_k=100, top_p=0.9, min_p=0.05),
])
@pytest.mark.parametrize("kernel", [True, False], ids=["cpu-kernel", "torch"])
def test_chi_square_over_several_blocks(params: SamplingParams, kernel: bool, monkeypatch: pytest.MonkeyPatch
                                        ) -> None:
    """Frequencies of 30000 draws over a 1000-token vocabulary follow the filtered target distribution: through
    the CPU's C++ draw, and through the torch path (softmax and inverse_cdf_sample) other devices take."""
    calls = []
    real = sampler_module.cpu_sampling.draw_rows
    monkeypatch.setattr(sampler_module.cpu_sampling, "draw_rows",
                        lambda *a: (calls.append(1), real(*a) if kernel else None)[1])
    assert_draws_follow_target(params, vocab=1000)
    assert calls  # the kernel was asked (and answered, or not)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.6, top_k=20),
    SamplingParams(temperature=1.0, top_k=30, top_p=0.9),
    SamplingParams(temperature=0.8, top_k=25, top_p=0.95, min_p=0.02),
])
def test_chi_square_top_k_candidates(params: SamplingParams, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same over a 4096-token vocabulary, where rows with these top_k take the candidate blocks."""
    monkeypatch.setattr(sampler_module, "CANDIDATE_SHARE", 1)  # candidates may be the whole vocabulary
    assert params.top_k * sampler_module.BLOCK <= 4096
    assert_draws_follow_target(params, vocab=4096)


def assert_draws_follow_target(params: SamplingParams, vocab: int) -> None:
    gen = torch.Generator().manual_seed(18)
    num = 30000
    base = torch.randn(vocab, generator=gen) * 2.5
    sampler, chunk = Sampler([], seed=19), 5000
    logits = base.expand(chunk, vocab).contiguous()
    tokens = torch.tensor([t for _ in range(num // chunk)
                           for t in sampler.sample(logits, [SampleRow(params, 0)] * chunk).token_ids])
    keep = ref_keep(base, params.temperature, params.top_k, params.top_p, params.min_p)
    target = torch.softmax((base.double() / params.temperature).masked_fill(~keep, -math.inf), 0)
    counts = torch.bincount(tokens, minlength=vocab).double()
    assert counts[~keep].sum() == 0  # nothing outside the filters
    # Pool the tokens into bins of >= 50 expected draws each (most likely first), then chi-square.
    order = torch.argsort(target, descending=True)
    bins: list[list[int]] = [[]]
    acc = 0.0
    for t in order.tolist():
        if target[t] == 0:
            break
        bins[-1].append(t)
        acc += target[t].item() * num
        if acc >= 50:
            bins.append([])
            acc = 0.0
    if not bins[-1] or acc < 50:  # fold a small last bin into the previous one
        last = bins.pop()
        bins[-1].extend(last)
    obs = torch.tensor([counts[b].sum().item() for b in bins])
    exp = torch.tensor([target[b].sum().item() * num for b in bins])
    chi2 = ((obs - exp) ** 2 / exp).sum().item()
    dof = len(bins) - 1
    # Wilson-Hilferty: the chi-square quantile at p = 1e-4 (z = 3.72) for dof degrees of freedom.
    bound = dof * (1 - 2 / (9 * dof) + 3.72 * math.sqrt(2 / (9 * dof))) ** 3 if dof > 0 else 1.0
    assert chi2 < bound, (chi2, bound, dof)


def test_top_k_candidates_hold_every_top_k_token_in_vocabulary_order() -> None:
    gen = torch.Generator().manual_seed(20)
    rows, vocab = 60, 3000  # not a multiple of the block: the last block is padded
    logits = torch.randint(-6, 7, (rows, vocab), generator=gen).float()  # many ties, also at the k-th value
    logits[5] = float("-inf")
    logits[5, [7, 2900]] = 1.0  # fewer finite tokens than k
    ks = [1 + (7 * i) % 12 for i in range(rows)]
    values, ids = top_k_candidates(logits, ks)
    for r, k in enumerate(ks):
        kth = torch.sort(logits[r], descending=True).values[k - 1]
        real = torch.isfinite(values[r])
        # every token tied with or above the k-th largest value is there, with its own logit
        wanted = set((logits[r] >= kth).nonzero()[:, 0].tolist()) if torch.isfinite(kth) else set()
        assert wanted <= set(ids[r][real].tolist()), r
        assert torch.equal(values[r][real], logits[r, ids[r][real]])
        picked = ids[r][real]
        assert bool((picked[1:] > picked[:-1]).all())  # vocabulary order, each token once
        assert bool((ids[r] < vocab).all())


def test_candidate_draw_equals_the_whole_vocabulary_draw() -> None:
    """The same token as filtering and walking the whole row, whatever the other rows ask."""
    gen = torch.Generator().manual_seed(21)
    rows, vocab = 200, 6000
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[::7] = torch.randint(-3, 4, (len(range(0, rows, 7)), vocab), generator=gen).float()  # ties
    params = [SamplingParams(temperature=0.5 + i % 5 * 0.3, top_k=[1, 3, 11, 9, -1, 0][i % 6],
                             top_p=[1.0, 0.9, 0.5][i % 3], min_p=[0.0, 0.1][i % 2]) for i in range(rows)]
    u = torch.rand(rows, dtype=torch.float64, generator=gen)
    whole = sampler_module._draw_filtered(logits, params, u)
    mixed = draw(logits, params, u)
    # float32 rounding of a softmax over fewer columns may move a CDF boundary by ~1e-7 of the mass
    assert int((mixed != whole).sum()) <= 1
    alone = torch.cat([draw(logits[i : i + 1], params[i : i + 1], u[i : i + 1]) for i in range(rows)])
    assert torch.equal(alone, mixed)  # a row's token does not depend on the batch
