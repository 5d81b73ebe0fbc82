"""Log-probability dictionaries, as the outputs carry them: the top tokens of a row plus a chosen one.

One helper for the sampled tokens' logprobs (SamplingParams.logprobs) and the
prompt tokens' (SamplingParams.prompt_logprobs), so both report the same numbers
for the same logits: a log-softmax of the raw float32 logits, before any
temperature, penalty or mask.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from rtp.outputs import Logprob


def name_tokens(entries: Iterable[dict[int, float] | None], decode_one: Any) -> None:  # noqa: ANN401
    """Fill each entry's ``decoded_token`` with ``decode_one(token_id, False)`` (special tokens kept, as vLLM)."""
    for entry in entries:
        for token, lp in (entry or {}).items():
            if isinstance(lp, Logprob) and lp.decoded_token is None:
                lp.decoded_token = decode_one(token, False)


def top_logprobs(logits: torch.Tensor, chosen: torch.Tensor, num_top: list[int]) -> list[dict[int, float]]:
    """Per row ``i``: ``{token_id: Logprob}`` of its ``num_top[i]`` most likely tokens and of ``chosen[i]``.

    ``logits`` is float ``[R, vocab]``, ``chosen`` int64 ``[R]`` on the same device. A token that is
    both among the top ones and the chosen one appears once; ``num_top[i]`` may be 0 (the chosen
    token only) or exceed the vocabulary (every token). Ranks count from 1 (the likeliest token); the
    chosen token's is the number of tokens at least as likely as it, as vLLM counts (a tie shares the lower rank).
    """
    logprobs = torch.log_softmax(logits, dim=-1)  # [R, vocab]
    chosen_t = logprobs.gather(1, chosen[:, None])  # [R, 1]
    chosen_rank = (logprobs >= chosen_t).sum(dim=1, dtype=torch.int32).tolist()  # int32: 7x the int64 sum's rate
    chosen_lp = chosen_t[:, 0].tolist()
    chosen_ids = chosen.tolist()
    max_n = min(max(num_top, default=0), logprobs.shape[1])
    top_lp: list[list[float]] = [[] for _ in chosen_ids]
    top_ids: list[list[int]] = [[] for _ in chosen_ids]
    if max_n > 0:
        top = torch.topk(logprobs, max_n, dim=-1)  # descending: [R, max_n]
        top_lp, top_ids = top.values.tolist(), top.indices.tolist()
    out: list[dict[int, float]] = []
    for j, n in enumerate(num_top):
        top_j = zip(top_ids[j][:n], top_lp[j][:n])
        entry: dict[int, float] = {t: Logprob(lp, r + 1) for r, (t, lp) in enumerate(top_j)}
        entry[chosen_ids[j]] = Logprob(chosen_lp[j], chosen_rank[j])
        out.append(entry)
    return out
