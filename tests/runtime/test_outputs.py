"""rtp.outputs.snapshot: a copy that the engine's later in-place updates leave alone."""

from __future__ import annotations

import copy

from rtp.outputs import CompletionOutput, Logprob, RequestOutput, snapshot


def _request(n: int) -> RequestOutput:
    samples = None
    if n > 1:
        samples = [CompletionOutput(i, f"s{i}", [i, i + 1], [{i: Logprob(-0.5)}, {i + 1: Logprob(-1.0)}],
                                    new_text=f"{i}", new_token_ids=[i + 1]) for i in range(n)]
    return RequestOutput("r", "prompt", [1, 2, 3], text="ab", token_ids=[4, 5], logprobs=[{4: -0.1}, {5: -0.2}],
                         new_text="b", new_token_ids=[5], prompt_logprobs=[None, {2: -0.3}], samples=samples)


def test_a_snapshot_equals_the_output_and_keeps_its_values_when_the_engine_appends():
    for n in (1, 3):
        out = _request(n)
        before = copy.deepcopy(out)
        snap = snapshot(out)
        assert type(snap) is RequestOutput and snap == before
        # What the engine does to its own object on the next steps: lists grow in place, fields are reassigned.
        out.token_ids.append(6)
        out.new_token_ids.append(6)
        assert out.logprobs is not None and out.prompt_logprobs is not None
        out.logprobs.append({6: -0.4})
        out.prompt_logprobs.append({3: -0.5})
        out.text, out.finish_reason = "abc", "length"
        for c in out.samples or []:
            c.token_ids.append(9)
            c.new_token_ids.append(9)
            assert c.logprobs is not None
            c.logprobs.append({9: Logprob(-2.0)})
            c.text = "changed"
        assert snap == before, n
        assert snap.outputs == before.outputs
        if n > 1:
            assert snap.samples is not None and all(type(c) is CompletionOutput for c in snap.samples)
