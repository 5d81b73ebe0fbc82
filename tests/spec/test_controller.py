"""The draft policy: batch-size cut-off, length limits, back-off on poor acceptance, counters."""

from __future__ import annotations

from rtp.config import SpeculativeConfig
from rtp.core.sequence import Sequence
from rtp.sampling import SamplingParams
from rtp.spec.controller import SpecController

LOOP = [1, 2, 3] * 5


def decoding(seq_id: int, tokens: list[int], max_tokens: int | None = 100, prompt: int = 6) -> Sequence:
    seq = Sequence(seq_id, tokens[:prompt], SamplingParams(temperature=0, max_tokens=max_tokens))
    for t in tokens[prompt:]:
        seq.append_token(t)
    seq.num_computed_tokens = len(tokens) - 1  # decoding: every token but the last has its KV
    return seq


def controller(**kw) -> SpecController:
    return SpecController(SpeculativeConfig(method="ngram", num_speculative_tokens=4, **kw), max_model_len=64)


def yes(_seq: Sequence) -> bool:
    return True


def test_drafts_only_for_decoding_sequences_and_within_the_length_limits():
    c = controller()
    prefill = decoding(2, LOOP)
    prefill.num_computed_tokens = 4
    last_chunk = decoding(6, LOOP, prompt=len(LOOP))  # the prompt's last token still to compute: no token yet
    seqs = [decoding(1, LOOP), prefill, last_chunk, decoding(3, LOOP, max_tokens=len(LOOP) - 6 + 2),
            decoding(4, LOOP, max_tokens=len(LOOP) - 6 + 1), decoding(5, [1, 2, 3] * 21)]
    drafts = c.propose(seqs, yes)
    # seq 3 may add 2 tokens: 1 draft + the token after it; seq 4 only its next token; seq 5 (63 tokens) none.
    assert drafts == {1: [1, 2, 3, 1], 3: [1]}
    assert c.propose(seqs, lambda s: s.seq_id != 1) == {3: [1]}


def test_no_drafts_above_the_batch_size_cut_off():
    c = controller(disable_by_batch_size=2)
    seen: list[object] = []
    c.proposer.observe = seen.append  # type: ignore[method-assign]
    seqs = [decoding(i, LOOP) for i in range(3)]
    assert c.propose(seqs, yes) == {}
    c.observe("above", 3)  # type: ignore[arg-type]  # not handed on: no sequence drafts in such a batch
    assert set(c.propose(seqs[:2], yes)) == {0, 1}
    c.observe("within", 2)  # type: ignore[arg-type]
    assert seen == ["within"]


def test_poorly_accepted_sequences_back_off_then_try_again():
    c = controller(min_acceptance_rate=0.5)
    seq = decoding(1, LOOP)
    steps_without = 0
    for _ in range(2):  # two steps of nothing accepted bring the average (1, 0.7, 0.49) below 0.5
        assert c.propose([seq], yes)
        c.record(1, 4, 0)
    for _ in range(20):
        if c.propose([seq], yes):
            break
        steps_without += 1
    assert steps_without == 7  # the back-off of 8 steps (counting the step that recorded the miss)
    c.record(1, 4, 0)  # a relapse at once: the back-off doubles
    steps_without = 0
    while not c.propose([seq], yes):
        steps_without += 1
    assert steps_without == 15
    c2 = controller(min_acceptance_rate=0.0)
    for _ in range(5):
        assert c2.propose([seq], yes)
        c2.record(1, 4, 0)


def test_counters_and_log_line():
    c = controller()
    c.record(1, 4, 4)
    c.record(2, 3, 1)
    c.record(3, 0, 0)  # no drafts: not a draft
    assert (c.counters.num_drafts, c.counters.num_draft_tokens, c.counters.num_accepted_tokens) == (2, 7, 5)
    assert c.counters.accepted_per_pos == [2, 1, 1, 1]
    assert c.counters.mean_acceptance_length == 3.5
    stats = c.counters.as_stats()
    assert stats["spec_accepted_pos_0"] == 2 and stats["spec_num_draft_tokens"] == 7
    line = c.log_line()
    assert line is not None and "mean acceptance length 3.50" in line
    assert c.log_line() is None  # nothing new since
