"""The n-gram proposer against a brute-force reference over every (length, end position)."""

from __future__ import annotations

import random

import pytest

from rtp.spec.ngram import ngram_propose, ngram_propose_reference


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Independent of the module: try every n from longest down, every earlier end, pick by the stated rule."""
    length = len(tokens)
    if k <= 0:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        ends = [e for e in range(n - 1, length - 1) if tokens[e - n + 1 : e + 1] == suffix]
        # only ends whose match is exactly n long when n < max_n would be found at a longer n otherwise
        if not ends:
            continue
        best = max(ends, key=lambda e: (min(length - 1 - e, k), e))
        return tokens[best + 1 : best + 1 + k]
    return []


def test_drafts_the_continuation_of_the_longest_match():
    assert ngram_propose([1, 2, 3, 4, 9, 2, 3], 2, 5, 3) == [4, 9, 2]
    assert ngram_propose([7, 1, 2, 3, 8, 5, 2, 3], 2, 5, 2) == [8, 5]  # "2 3" recurs; "1 2 3" does not matter
    # the longest suffix wins over a shorter one with more continuation
    assert ngram_propose([4, 3, 9, 9, 5, 3, 6, 4, 3], 1, 2, 4) == [9, 9, 5, 3]
    assert ngram_propose([1, 2, 3], 1, 3, 4) == []  # nothing recurs
    assert ngram_propose([5, 5], 2, 3, 4) == []  # too short for min_n = 2
    assert ngram_propose([5, 5, 5], 2, 3, 0) == []


def test_a_loop_drafts_k_tokens_not_the_rest_of_the_last_period():
    loop = [1, 2, 3] * 4  # the latest occurrence of the suffix leaves 3 tokens; an earlier one leaves k
    assert ngram_propose(loop, 2, 4, 5) == [1, 2, 3, 1, 2]


@pytest.mark.parametrize("seed", range(4))
def test_equals_brute_force_on_random_contexts(seed: int):
    rng = random.Random(seed)
    for _ in range(800):
        vocab = rng.randint(1, 6)
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 60))]
        lo = rng.randint(1, 4)
        hi = rng.randint(lo, 7)
        k = rng.randint(0, 6)
        want = brute_force(tokens, lo, hi, k)
        assert ngram_propose(tokens, lo, hi, k) == want, (tokens, lo, hi, k)
        assert ngram_propose_reference(tokens, lo, hi, k) == want
