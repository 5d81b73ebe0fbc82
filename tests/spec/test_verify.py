"""Verification rows against the rows of the sequence as it would be after accepting each draft prefix,
and the accepted run against its definition."""

from __future__ import annotations

import torch

from rtp.runtime.sampler import PenaltyState, Sampler, SampleRow
from rtp.sampling import SamplingParams
from rtp.spec.verify import accepted_run, grammar_prefix, verification_rows

VOCAB = 64


def test_accepted_run_stops_at_the_first_mismatch():
    assert accepted_run([1, 2, 3], [1, 2, 3, 4]) == [1, 2, 3, 4]
    assert accepted_run([1, 2, 3], [1, 5, 3, 4]) == [1, 5]
    assert accepted_run([1, 2, 3], [7, 2, 3, 4]) == [7]
    assert accepted_run([], [9]) == [9]


class Counting:
    """A constraint that allows tokens > the last accepted one (mod VOCAB); records rollbacks."""

    def __init__(self) -> None:
        self.accepted: list[int] = []

    def allowed_tokens(self, vocab_size: int) -> torch.Tensor:
        last = self.accepted[-1] if self.accepted else -1
        return torch.arange(vocab_size) > last

    def accept(self, token_id: int) -> None:
        self.accepted.append(token_id)

    def is_terminated(self) -> bool:
        return False

    def rollback(self, n: int) -> None:
        del self.accepted[len(self.accepted) - n :]


def test_grammar_prefix_stops_at_the_first_refused_draft_and_leaves_the_grammar_as_it_was():
    constraint = Counting()
    constraint.accepted = [5, 30]
    assert grammar_prefix(constraint, [31, 35, 20, 40], VOCAB) == 2  # 20 is not above 35
    assert constraint.accepted == [5, 30]
    assert grammar_prefix(constraint, [30, 31], VOCAB) == 0
    assert grammar_prefix(constraint, [31, 32, 33], VOCAB) == 3
    assert constraint.accepted == [5, 30]


def test_each_row_is_the_sequence_after_its_draft_prefix():
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, VOCAB, (12,), generator=gen).tolist()
    output = [5, 9, 5, 30]
    drafts = [31, 35, 40]  # each allowed by the grammar below
    params = SamplingParams(temperature=0.7, seed=5, presence_penalty=0.5, frequency_penalty=0.3,
                            repetition_penalty=1.4, min_tokens=6, bad_words=["x"], logit_bias={3: 2.0})
    bad_words = [[31, 35]]  # bans 35 right after 31: only in the row after the first draft
    tokens = prompt + output
    sampler = Sampler([0])
    state = PenaltyState()
    row = SampleRow(params, len(output), tokens, len(prompt), state, Counting(), bad_words)
    row.constraint.accepted = list(output)  # type: ignore[union-attr]
    rows = verification_rows(row, drafts, VOCAB)
    logits = torch.randn(len(drafts) + 1, VOCAB, generator=gen) * 3
    got = sampler.process_logits(logits, rows)
    for j in range(len(drafts) + 1):
        constraint = Counting()
        constraint.accepted = output + drafts[:j]
        ref = SampleRow(params, len(output) + j, tokens + drafts[:j], len(prompt), PenaltyState(), constraint,
                        bad_words)
        assert torch.equal(sampler.process_logits(logits[j : j + 1], [ref]), got[j : j + 1]), j
    # The sequence's own state counted its own tokens only, and the grammar was left where it was.
    assert state.num_counted == len(output) and int(state.output_counts.sum()) == len(output)
    assert row.constraint.accepted == output  # type: ignore[union-attr]
    # Seeded rows draw the uniforms of generation steps g, g + 1, ...
    refs = [SampleRow(params, len(output) + j) for j in range(len(drafts) + 1)]
    assert torch.equal(sampler._uniforms(rows, logits.device), sampler._uniforms(refs, logits.device))
