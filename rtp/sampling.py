"""Sampling parameters of one request, with vLLM's field names."""

from __future__ import annotations

from dataclasses import dataclass, field

from rtp.errors import RequestError


@dataclass
class SamplingParams:
    """How to sample the completion of one prompt.

    Field names and meanings follow vLLM so that existing code ports unchanged.
    Every field is validated on construction; a bad value raises
    :class:`rtp.errors.RequestError` (a ``ValueError``) naming the field.
    """

    n: int = 1
    """Number of completions; only 1 is supported."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sum reaches top_p."""
    top_k: int = -1
    """Keep only the k most likely tokens; -1 (or 0) disables it."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely token's."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same output whatever else is batched."""
    stop: str | list[str] | None = None
    """Strings that end generation; the output is truncated before the stop string."""
    stop_token_ids: list[int] | None = None
    """Token ids that end generation (the stop token is kept in token_ids, not in text)."""
    max_tokens: int | None = 16
    """Maximum number of generated tokens; None means up to the model's context length."""
    min_tokens: int = 0
    """EOS and stop tokens are suppressed until this many tokens are generated."""
    ignore_eos: bool = False
    """Keep generating after the EOS token."""
    logprobs: int | None = None
    """Return the log-probabilities of the top-N tokens at every generated position."""
    skip_special_tokens: bool = True
    """Drop special tokens when detokenizing."""
    stop_strings: list[str] = field(init=False, repr=False)
    """Normalised copy of ``stop`` (always a list)."""

    def __post_init__(self) -> None:
        def bad(name: str, allowed: str) -> RequestError:
            return RequestError(f"SamplingParams.{name}={getattr(self, name)!r} is invalid: {allowed}")

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        if not is_int(self.n) or self.n != 1:
            raise bad("n", "only n=1 is supported")
        if not is_num(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", "expected a number in [0, 100]")
        if not is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "expected a number in (0, 1]")
        if not is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "expected -1 (disabled), 0 (disabled) or a positive integer")
        if not is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "expected a number in [0, 1]")
        if self.seed is not None and not is_int(self.seed):
            raise bad("seed", "expected an integer or None")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "expected a positive integer or None")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "expected a non-negative integer")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must not exceed max_tokens={self.max_tokens}")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "expected true or false")
        if not isinstance(self.skip_special_tokens, bool):
            raise bad("skip_special_tokens", "expected true or false")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", "expected an integer in [0, 20] or None")
        if self.stop is None:
            self.stop_strings = []
        elif isinstance(self.stop, str):
            self.stop_strings = [self.stop] if self.stop else []
        elif isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop):
            self.stop_strings = list(self.stop)
        else:
            raise bad("stop", "expected a non-empty string or a list of non-empty strings")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif not isinstance(self.stop_token_ids, list) or not all(
            is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids", "expected a list of non-negative integers")

    @property
    def greedy(self) -> bool:
        """True when sampling is deterministic argmax (temperatures this small would overflow)."""
        return self.temperature < 1e-5
