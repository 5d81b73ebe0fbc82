"""What a request produced: the result type of rtp.generate and the server."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def snapshot(out: RequestOutput) -> RequestOutput:
    """A copy that later engine steps will not change (the engine appends to its lists in place)."""
    return dataclasses.replace(
        out,
        token_ids=list(out.token_ids),
        new_token_ids=list(out.new_token_ids),
        logprobs=None if out.logprobs is None else list(out.logprobs),
    )
