"""N-gram (prompt lookup) proposer: draft the tokens that followed the last earlier occurrence of the
context's suffix.

For one sequence with tokens ``t[0..L)`` the proposer looks for the longest
suffix ``t[L-n..L)``, ``n`` in ``[min_n, max_n]``, that also ends at an earlier
position ``e < L - 1`` (``t[e-n+1..e] == t[L-n..L)``), and drafts the tokens
after it, ``t[e+1 .. e+1+k)`` (fewer when the context ends first). Among the
positions with the longest match the one leaving the most continuation wins
(up to ``k`` tokens), then the latest: a loop of period ``p`` drafts a whole
``k`` tokens instead of the ``p - 1`` the latest occurrence has.

Cost: one comparison per (earlier position, suffix offset), ``L * max_n``
element comparisons as a few numpy operations per sequence: linear in the
context for the fixed ``max_n``. Sequences are independent; a batch costs the
sum of its sequences.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def ngram_propose(tokens: Sequence[int] | np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` draft tokens continuing ``tokens`` by its longest recurring suffix (see the module doc).

    Returns [] when no suffix of at least ``min_n`` tokens occurs earlier, or when ``k`` is 0.
    """
    t = np.asarray(tokens, dtype=np.int64)
    length = len(t)
    if k <= 0 or length < min_n + 1:
        return []
    n_max = min(max_n, length - 1)
    # Candidate end positions e = 0 .. L-2 (an occurrence ending at L-1 is the suffix itself).
    # match[e] = how many of t[e], t[e-1], ... equal t[L-1], t[L-2], ... in a row, capped at n_max.
    ends = np.arange(length - 1)  # [L-1]
    match = np.zeros(length - 1, dtype=np.int64)  # [L-1]
    alive = np.ones(length - 1, dtype=bool)  # [L-1] still matching at this offset
    for off in range(n_max):
        pos = ends - off  # [L-1]
        ok = alive & (pos >= 0)
        ok[ok] = t[pos[ok]] == t[length - 1 - off]
        alive = ok
        match += alive
        if not alive.any():
            break
    best = int(match.max())
    if best < min_n:
        return []
    cand = np.flatnonzero(match == best)  # [C] ascending end positions with the longest match
    avail = np.minimum(length - 1 - cand, k)  # [C] continuation tokens each leaves (>= 1)
    # Most continuation first, then the latest occurrence (cand is ascending: the last of the maxima).
    choice = cand[np.flatnonzero(avail == avail.max())[-1]]
    return t[choice + 1 : choice + 1 + k].tolist()


def ngram_propose_reference(tokens: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The same choice by brute force over every (n, end position): for tests."""
    t = list(tokens)
    length = len(t)
    best: tuple[int, int, int] | None = None  # (n, continuation, end)
    for e in range(length - 1):
        n = 0
        while n < max_n and e - n >= 0 and t[e - n] == t[length - 1 - n]:
            n += 1
        if n < min_n:
            continue
        key = (n, min(length - 1 - e, k), e)
        if best is None or key > best:
            best = key
    if best is None or k <= 0:
        return []
    e = best[2]
    return t[e + 1 : e + 1 + k]
