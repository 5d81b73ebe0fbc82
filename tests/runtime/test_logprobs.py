"""Logprob entries: the values of a log-softmax, vLLM's ranks, and a Logprob that is also a float."""

from __future__ import annotations

import json
import pickle

import torch

from rtp.outputs import Logprob
from rtp.runtime.logprobs import name_tokens, top_logprobs


def test_entries_hold_the_top_tokens_and_the_chosen_one_with_their_ranks():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 300, generator=g) * 3
    chosen = torch.randint(0, 300, (5,), generator=g)
    chosen[1] = logits[1].argmax()  # the likeliest token: inside the top ones
    num_top = [0, 3, 5, 1, 400]
    ref = torch.log_softmax(logits.double(), dim=-1)
    for i, entry in enumerate(top_logprobs(logits, chosen, num_top)):
        order = ref[i].argsort(descending=True).tolist()  # no ties among random floats
        want = set(order[: num_top[i]]) | {int(chosen[i])}
        assert set(entry) == want
        for t, lp in entry.items():
            assert isinstance(lp, Logprob) and abs(lp.logprob - float(ref[i, t])) < 1e-5
            assert lp.rank == order.index(t) + 1
    assert top_logprobs(logits, chosen, num_top)[1][int(chosen[1])].rank == 1


def test_a_logprob_is_a_float_with_vllms_fields():
    lp = Logprob(-0.5, 3, "ab")
    assert lp == -0.5 and lp + 1.0 == 0.5 and lp.logprob == -0.5 and type(lp.logprob) is float
    assert json.dumps({7: lp}) == '{"7": -0.5}'
    back = pickle.loads(pickle.dumps(lp))
    assert (back, back.rank, back.decoded_token) == (-0.5, 3, "ab")
    entries = [{1: Logprob(-1.0, 1), 2: Logprob(-2.0, 2, "kept")}, None]
    name_tokens(entries, lambda t, skip: f"<{t}:{skip}>")
    assert [lp.decoded_token for lp in entries[0].values()] == ["<1:False>", "kept"]
