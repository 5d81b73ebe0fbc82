"""Sampler: penalties, logit_bias, allowed tokens and constraints against per-row torch references."""

from __future__ import annotations

import math

import torch

from rtp.runtime.sampler import PenaltyState, Sampler, SampleRow, is_plain_greedy
from rtp.sampling import SamplingParams

EOS = 3
VOCAB = 50


def ref_process(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """vLLM's logit processing of one row, written independently, token by token in float64."""
    x = logits.double().clone()
    if params.allowed_token_ids is not None:
        for t in range(len(x)):
            if t not in params.allowed_token_ids:
                x[t] = -math.inf
    for tok, b in (params.logit_bias or {}).items():
        x[tok] += max(-100.0, min(100.0, b))
    for t in range(len(x)):
        n_out = output.count(t)
        if t in prompt or n_out:
            r = params.repetition_penalty
            x[t] = x[t] / r if x[t] > 0 else x[t] * r
        x[t] -= params.frequency_penalty * n_out
        if n_out:
            x[t] -= params.presence_penalty
    return x


def random_case(gen: torch.Generator, num_rows: int) -> tuple[list[SamplingParams], list[list[int]], list[list[int]]]:
    params, prompts, outputs = [], [], []
    for i in range(num_rows):
        r = torch.rand(6, generator=gen).tolist()
        kind = i % 4  # 0: nothing, 1: penalties, 2: logit_bias, 3: everything
        kw: dict = {"temperature": 0.0}
        if kind in (1, 3):
            kw.update(presence_penalty=round(4 * r[0] - 2, 3), frequency_penalty=round(4 * r[1] - 2, 3),
                      repetition_penalty=round(0.5 + 1.5 * r[2], 3))
        if kind in (2, 3):
            toks = torch.randint(0, VOCAB, (4,), generator=gen).tolist()
            kw["logit_bias"] = {t: round(300 * r[3] - 150, 2) if j == 0 else round(10 * r[4] - 5, 2)
                                for j, t in enumerate(toks)}
        if kind == 3 and r[5] > 0.5:
            kw["allowed_token_ids"] = torch.randint(0, VOCAB, (8,), generator=gen).tolist()
        params.append(SamplingParams(**kw))
        prompts.append(torch.randint(0, VOCAB, (int(3 + 10 * r[5]),), generator=gen).tolist())
        outputs.append(torch.randint(0, VOCAB, (int(12 * r[4]),), generator=gen).tolist())
    return params, prompts, outputs


def rows_for(params, prompts, outputs, states=None) -> list[SampleRow]:  # noqa: ANN001
    return [
        SampleRow(p, len(o), pr + o, len(pr), None if states is None else states[i])
        for i, (p, pr, o) in enumerate(zip(params, prompts, outputs))
    ]


def test_processed_logits_match_reference_in_mixed_batches() -> None:
    gen = torch.Generator().manual_seed(0)
    sampler = Sampler([EOS])
    for trial in range(5):
        params, prompts, outputs = random_case(gen, 9)
        logits = torch.randn(9, VOCAB, generator=gen) * 3
        got = sampler.process_logits(logits, rows_for(params, prompts, outputs))
        for i in range(9):
            want = ref_process(logits[i], params[i], prompts[i], outputs[i])
            assert torch.equal(torch.isinf(got[i]), torch.isinf(want)), (trial, i)
            fin = ~torch.isinf(want)
            torch.testing.assert_close(got[i][fin].double(), want[fin], atol=1e-4, rtol=1e-5)
        # The greedy tokens are the reference argmaxes (rows without anything: the raw argmax).
        tokens = sampler.sample(logits, rows_for(params, prompts, outputs)).token_ids
        for i in range(9):
            want = ref_process(logits[i], params[i], prompts[i], outputs[i])
            assert want[tokens[i]] == want.max(), (trial, i)


def test_each_penalty_alone() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(1, VOCAB, generator=gen) * 2
    prompt, output = [1, 2, 5, 5], [5, 7, 7, 7, 9]
    for kw in ({"presence_penalty": 1.5}, {"frequency_penalty": 0.7}, {"repetition_penalty": 1.8},
               {"repetition_penalty": 0.6}, {"frequency_penalty": -1.0}, {"logit_bias": {4: 250.0, 6: -3.5}}):
        p = SamplingParams(temperature=0.0, **kw)
        got = Sampler([EOS]).process_logits(logits, rows_for([p], [prompt], [output]))[0]
        torch.testing.assert_close(got.double(), ref_process(logits[0], p, prompt, output), atol=1e-5, rtol=1e-6)
    # The clamp is OpenAI's [-100, 100]; presence/frequency ignore prompt-only tokens (1, 2).
    assert SamplingParams(logit_bias={4: 250.0}).logit_bias == {4: 100.0}
    p = SamplingParams(presence_penalty=2.0, frequency_penalty=2.0)
    got = Sampler([EOS]).process_logits(logits, rows_for([p], [prompt], [output]))[0]
    assert got[1] == logits[0, 1] and got[2] == logits[0, 2]
    assert torch.isclose(got[7], logits[0, 7] - 2.0 - 6.0)


def test_incremental_penalty_state_equals_fresh_state() -> None:
    gen = torch.Generator().manual_seed(2)
    sampler = Sampler([EOS])
    p = SamplingParams(temperature=0.8, seed=5, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3)
    prompt = [1, 2, 3, 4]
    state = PenaltyState()
    output: list[int] = []
    tokens = prompt + output
    for _ in range(12):
        logits = torch.randn(1, VOCAB, generator=gen)
        row = SampleRow(p, len(output), tokens, len(prompt), state)  # the live list, as the engine passes it
        kept = sampler.process_logits(logits, [row])
        fresh = sampler.process_logits(logits, rows_for([p], [prompt], [list(output)]))
        assert torch.equal(kept, fresh)
        tok = sampler.sample(logits, [SampleRow(p, len(output), tokens, len(prompt), state)]).token_ids[0]
        output.append(tok)
        tokens.append(tok)
    assert int(state.output_counts.sum()) == len(output) - 1  # counted up to the last sampled step


def test_seeded_penalised_rows_do_not_depend_on_the_batch() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, VOCAB, generator=gen)
    p = SamplingParams(temperature=1.0, seed=11, frequency_penalty=0.5, logit_bias={0: 5.0})
    other = SamplingParams(temperature=1.3, repetition_penalty=1.5)
    alone = Sampler([EOS], seed=1).sample(logits[2:3], [SampleRow(p, 3, [1, 2, 3, 4, 5], 2)]).token_ids
    mixed_rows = [SampleRow(other, 1, [6, 7], 1), SampleRow(SamplingParams(), 0, [1], 1),
                  SampleRow(p, 3, [1, 2, 3, 4, 5], 2), SampleRow(other, 0, [8], 1)]
    mixed = Sampler([EOS], seed=99).sample(logits, mixed_rows).token_ids
    assert mixed[2] == alone[0]


def test_constraint_masks_bool_and_packed_bitmasks() -> None:
    class Fixed:
        def __init__(self, mask: torch.Tensor | None) -> None:
            self.mask = mask

        def allowed_tokens(self, vocab_size: int) -> torch.Tensor | None:
            return self.mask

        def accept(self, token_id: int) -> None:
            pass

        def is_terminated(self) -> bool:
            return False

    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(4, VOCAB, generator=gen)
    allowed_a = [3, 17, 40]
    bool_mask = torch.zeros(VOCAB, dtype=torch.bool)
    bool_mask[allowed_a] = True
    allowed_b = [0, 31, 32, 49]
    packed = torch.zeros((VOCAB + 31) // 32, dtype=torch.int32)
    for t in allowed_b:
        packed[t // 32] |= 1 << (t % 32)
    rows = [SampleRow(SamplingParams(temperature=1.0, seed=s), 0, [1], 1, None, c)
            for s, c in enumerate([Fixed(bool_mask), Fixed(packed), Fixed(None), None])]
    assert not is_plain_greedy(SamplingParams(temperature=0.0, constraint=lambda: Fixed(None)))
    out = Sampler([EOS]).process_logits(logits, rows)
    for i, allowed in ((0, allowed_a), (1, allowed_b)):
        finite = torch.nonzero(~torch.isinf(out[i])).flatten().tolist()
        assert finite == sorted(allowed)
        torch.testing.assert_close(out[i][allowed], logits[i][allowed])
    assert torch.equal(out[2:], logits[2:])
    for _ in range(20):
        toks = Sampler([EOS], seed=_).sample(logits, rows).token_ids
        assert toks[0] in allowed_a and toks[1] in allowed_b


def test_rows_without_features_are_untouched() -> None:
    logits = torch.randn(3, VOCAB)
    rows = rows_for([SamplingParams(temperature=0.7)] * 3, [[1, 2]] * 3, [[4, 4]] * 3)
    assert Sampler([EOS]).process_logits(logits, rows) is logits  # not even a copy


def test_bad_words_ban_the_last_token_after_a_matching_output() -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, VOCAB, generator=gen)
    bad = [[7], [4, 9], [1, 2, 30]]  # a single token; two-token and three-token sequences
    p = SamplingParams(temperature=1.0, bad_words=["unused: the ids are given"])
    prompt = [4]  # a prompt token does not count as output: [4, 9] must not trigger on it
    outputs = [[], [5, 4], [1, 2]]
    rows = [SampleRow(p, len(o), prompt + o, len(prompt), None, None, bad) for o in outputs]
    got = Sampler([EOS]).process_logits(logits, rows)
    for i, out in enumerate(outputs):
        banned = {ids[-1] for ids in bad if len(ids) == 1 or out[-(len(ids) - 1):] == ids[:-1]}
        for t in range(VOCAB):
            assert torch.isinf(got[i, t]).item() == (t in banned), (i, t)
    assert not is_plain_greedy(SamplingParams(temperature=0.0, bad_words=["x"]))


def test_a_row_whose_masks_leave_no_token_ends_with_eos() -> None:
    # allowed_token_ids={5} and a bad word that is token 5: nothing is left in row 0; row 1 is untouched.
    logits = torch.randn(2, 32)
    trapped = SamplingParams(temperature=1.0, seed=3, allowed_token_ids=[5], bad_words=["x"])
    rows = [SampleRow(trapped, 0, [1, 2], 2, None, None, [[5]]), SampleRow(SamplingParams(temperature=0.0), 0, [1], 1)]
    for _ in range(5):
        toks = Sampler([EOS]).sample(logits, rows).token_ids
        assert toks == [EOS, int(logits[1].argmax())]
