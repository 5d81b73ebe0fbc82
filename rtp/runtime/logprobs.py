"""Log-probability dictionaries, as the outputs carry them: the top tokens of a row plus a chosen one.

One helper for the sampled tokens' logprobs (SamplingParams.logprobs) and the
prompt tokens' (SamplingParams.prompt_logprobs), so both report the same numbers
for the same logits: a log-softmax of the raw float32 logits, before any
temperature, penalty or mask.
"""

from __future__ import annotations

import torch


def top_logprobs(logits: torch.Tensor, chosen: torch.Tensor, num_top: list[int]) -> list[dict[int, float]]:
    """Per row ``i``: ``{token_id: logprob}`` of its ``num_top[i]`` most likely tokens and of ``chosen[i]``.

    ``logits`` is float ``[R, vocab]``, ``chosen`` int64 ``[R]`` on the same device. A token that is
    both among the top ones and the chosen one appears once; ``num_top[i]`` may be 0 (the chosen
    token only) or exceed the vocabulary (every token).
    """
    logprobs = torch.log_softmax(logits, dim=-1)  # [R, vocab]
    chosen_lp = logprobs.gather(1, chosen[:, None])[:, 0].tolist()  # [R]
    chosen_ids = chosen.tolist()
    max_n = min(max(num_top, default=0), logprobs.shape[1])
    top_lp: list[list[float]] = [[] for _ in chosen_ids]
    top_ids: list[list[int]] = [[] for _ in chosen_ids]
    if max_n > 0:
        top = torch.topk(logprobs, max_n, dim=-1)  # descending: [R, max_n]
        top_lp, top_ids = top.values.tolist(), top.indices.tolist()
    out: list[dict[int, float]] = []
    for j, n in enumerate(num_top):
        entry = dict(zip(top_ids[j][:n], top_lp[j][:n]))
        entry[chosen_ids[j]] = chosen_lp[j]
        out.append(entry)
    return out
