"""What a request produced: the result type of rtp.generate and the server.

As in vLLM, a :class:`RequestOutput` holds one :class:`CompletionOutput` per
sample in ``outputs`` (``n`` of them). The flat fields (``text``,
``token_ids``, ``logprobs``, ...) are those of the first sample, kept for the
common n = 1 case; ``finish_reason`` is the request's: set once every sample
finished.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One sample of a request (vLLM's CompletionOutput, plus the streaming deltas)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    new_text: str = ""  # text added by the last step that changed this request
    new_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after a step (cumulative), plus what this step added."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    logprobs: list[dict[int, float]] | None = None
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    new_text: str = ""  # text added by the last step (streaming)
    new_token_ids: list[int] = field(default_factory=list)
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    error: str | None = None  # set when the runtime failed underneath the request
    prompt_logprobs: list[dict[int, float] | None] | None = None
    """With SamplingParams.prompt_logprobs: per prompt token, None for the first, else
    ``{token_id: logprob}`` holding the prompt token and the top-N (computed from the raw logits)."""
    samples: list[CompletionOutput] | None = None
    """Every sample when n > 1 (samples[0] mirrors the flat fields); None when n == 1."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def outputs(self) -> list[CompletionOutput]:
        """One CompletionOutput per sample, as vLLM's RequestOutput.outputs."""
        if self.samples is not None:
            return self.samples
        return [CompletionOutput(0, self.text, self.token_ids, self.logprobs, self.finish_reason,
                                 self.new_text, self.new_token_ids)]

    @property
    def num_completion_tokens(self) -> int:
        """Generated tokens summed over the samples (OpenAI's usage.completion_tokens)."""
        return sum(len(c.token_ids) for c in self.outputs)


def _copy_sample(c: CompletionOutput) -> CompletionOutput:
    return dataclasses.replace(c, token_ids=list(c.token_ids), new_token_ids=list(c.new_token_ids),
                               logprobs=None if c.logprobs is None else list(c.logprobs))


def snapshot(out: RequestOutput) -> RequestOutput:
    """A copy that later engine steps will not change (the engine appends to its lists in place)."""
    return dataclasses.replace(
        out,
        token_ids=list(out.token_ids),
        new_token_ids=list(out.new_token_ids),
        logprobs=None if out.logprobs is None else list(out.logprobs),
        prompt_logprobs=None if out.prompt_logprobs is None else list(out.prompt_logprobs),
        samples=None if out.samples is None else [_copy_sample(c) for c in out.samples],
    )
