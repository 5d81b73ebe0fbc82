"""Sampling parameters of one request, with vLLM's field names."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from rtp.errors import RequestError

if TYPE_CHECKING:
    import torch


class TokenConstraint(Protocol):
    """Restricts the tokens one output sequence may sample next (structured outputs).

    Lives on rank 0 only, where sampling happens (the batched sampler asks every constrained row for its mask
    before a step and tells it the sampled token after; rtp.structured.GrammarConstraint implements it).
    """

    def allowed_tokens(self, vocab_size: int) -> torch.Tensor | None:
        """Allowed next tokens: bool ``[vocab_size]`` (True = allowed), xgrammar's packed int32
        bitmask ``[ceil(vocab_size / 32)]``, or None for no restriction at this step."""
        ...

    def accept(self, token_id: int) -> None:
        """Advance past the token sampled for this sequence."""
        ...

    def is_terminated(self) -> bool:
        """True once the constraint is complete: the engine then finishes the sequence."""
        ...


LOGIT_BIAS_LIMIT = 100.0


@dataclass
class SamplingParams:
    """How to sample the completion of one prompt.

    Field names and meanings follow vLLM so that existing code ports unchanged.
    Every field is validated on construction; a bad value raises
    :class:`rtp.errors.RequestError` (a ``ValueError``) naming the field.
    """

    n: int = 1
    """Number of completions of the prompt, sharing one prefill. With ``seed=s``, completion ``i``
    uses seed ``s + i``: it equals a separate n=1 request with that seed."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sum reaches top_p."""
    top_k: int = -1
    """Keep only the k most likely tokens; -1 (or 0) disables it."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely token's."""
    seed: int | None = None
    """Per-request seed: the sampler's draws for a seed are the same whatever else is batched. The tokens are too
    where the logits are: another batch (n > 1, concurrent requests) changes a row's logits by rounding only, which
    in float32 practically never moves a sampled token, while in bfloat16 it can (as in vLLM without its
    batch-invariant mode); with ``model.batch_invariant`` the logits, and so the tokens, are the same too."""
    stop: str | list[str] | None = None
    """Strings that end generation; the output is truncated before the stop string."""
    include_stop_str_in_output: bool = False
    """Keep the stop string that ended the output at its end (vLLM's name)."""
    stop_token_ids: list[int] | None = None
    """Token ids that end generation (the stop token is kept in token_ids, not in text)."""
    max_tokens: int | None = 16
    """Maximum number of generated tokens; None means up to the model's context length. Offline, as in vLLM, a
    completion that reaches the context length (``max_model_len``) first ends there with "length"; the server
    refuses such a request instead (OpenAI's 400), unless max_tokens is left out."""
    min_tokens: int = 0
    """EOS and stop tokens are suppressed until this many tokens are generated."""
    ignore_eos: bool = False
    """Keep generating after the EOS token."""
    logprobs: int | None = None
    """Return the log-probabilities of the top-N tokens at every generated position."""
    skip_special_tokens: bool = True
    """Drop special tokens when detokenizing."""
    detokenize: bool = True
    """Produce text; False: token ids only (``text`` stays empty; no stop strings), as vLLM's flag."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token that occurs in the output so far (vLLM: [-2, 2])."""
    frequency_penalty: float = 0.0
    """Subtracted once per occurrence of the token in the output so far (vLLM: [-2, 2])."""
    repetition_penalty: float = 1.0
    """Tokens of the prompt or output: positive logits divided by it, negative ones multiplied (> 0)."""
    logit_bias: dict[int, float] | None = None
    """Token id -> bias added to its logit, clamped to [-100, 100] as OpenAI does."""
    allowed_token_ids: list[int] | None = None
    """Only these token ids may be sampled."""
    bad_words: list[str] | None = None
    """Words never generated (vLLM): each is tokenized with and without a leading space; the last token
    of such a sequence is banned whenever the output ends with the tokens before it."""
    prompt_logprobs: int | None = None
    """Return, for every prompt token but the first, its log-probability given the previous
    tokens plus the top-N; the first entry is None (vLLM semantics). Such a request does not use
    the prefix cache (every prompt position must be computed)."""
    truncate_prompt_tokens: int | None = None
    """Keep only the last k tokens of the prompt (vLLM's name; k < max_model_len); -1 fits the prompt to the
    model's context: its last max_model_len - max_tokens (max_model_len - 1 without max_tokens). The output's
    prompt_token_ids are those kept."""
    constraint: Callable[[], TokenConstraint] | None = field(default=None, repr=False, compare=False)
    """Factory of a fresh :class:`TokenConstraint`, called once per output sequence (see the protocol)."""
    stop_strings: list[str] = field(init=False, repr=False)
    """Normalised copy of ``stop`` (always a list)."""

    def __post_init__(self) -> None:
        def bad(name: str, allowed: str) -> RequestError:
            return RequestError(f"SamplingParams.{name}={getattr(self, name)!r} is invalid: {allowed}")

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        if not is_int(self.n) or not 1 <= self.n <= 128:
            raise bad("n", "expected an integer in [1, 128]")
        if not is_num(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", "expected a number in [0, 100]")
        if not is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "expected a number in (0, 1]")
        if not is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "expected -1 (disabled), 0 (disabled) or a positive integer")
        if not is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "expected a number in [0, 1]")
        if self.seed is not None and (not is_int(self.seed) or not -(2**63) <= self.seed < 2**64):
            raise bad("seed", "expected an integer in [-2**63, 2**64) or None")
        if self.seed is not None and self.seed + self.n > 2**64:
            raise bad("seed", f"with n={self.n} sample i uses seed + i: expected an integer below 2**64 - {self.n - 1}")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "expected a positive integer or None")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "expected a non-negative integer")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must not exceed max_tokens={self.max_tokens}")
        truncate = self.truncate_prompt_tokens
        if truncate is not None and (not is_int(truncate) or not (truncate >= 1 or truncate == -1)):
            raise bad("truncate_prompt_tokens", "expected a positive integer, -1 (the model's context) or None")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "expected true or false")
        if not isinstance(self.detokenize, bool):
            raise bad("detokenize", "expected true or false")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise bad("include_stop_str_in_output", "expected true or false")
        if not isinstance(self.skip_special_tokens, bool):
            raise bad("skip_special_tokens", "expected true or false")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", "expected an integer in [0, 20] or None")
        if self.prompt_logprobs is not None and (
            not is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= 20
        ):
            raise bad("prompt_logprobs", "expected an integer in [0, 20] or None")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_num(v) or not math.isfinite(v) or not -2.0 <= v <= 2.0:
                raise bad(name, "expected a number in [-2, 2]")
        rp = self.repetition_penalty
        if not is_num(rp) or not math.isfinite(rp) or not 0.0 < rp <= 100.0:
            raise bad("repetition_penalty", "expected a number in (0, 100]")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                is_int(k) and k >= 0 and is_num(v) and math.isfinite(v) for k, v in self.logit_bias.items()
            ):
                raise bad("logit_bias", "expected a mapping of non-negative token ids to finite numbers")
            self.logit_bias = {
                k: max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(v))) for k, v in self.logit_bias.items()
            }
        if self.allowed_token_ids is not None and (
            not isinstance(self.allowed_token_ids, list)
            or not self.allowed_token_ids
            or not all(is_int(t) and t >= 0 for t in self.allowed_token_ids)
        ):
            raise bad("allowed_token_ids", "expected a non-empty list of non-negative integers")
        if self.bad_words is not None and (
            not isinstance(self.bad_words, list) or not all(isinstance(w, str) and w for w in self.bad_words)
        ):
            raise bad("bad_words", "expected a list of non-empty strings")
        if self.constraint is not None and not callable(self.constraint):
            raise bad("constraint", "expected a zero-argument callable returning a TokenConstraint")
        if self.stop is None:
            self.stop_strings = []
        elif isinstance(self.stop, str):
            self.stop_strings = [self.stop] if self.stop else []
        elif isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop):
            self.stop_strings = list(self.stop)
        else:
            raise bad("stop", "expected a non-empty string or a list of non-empty strings")
        if not self.detokenize and self.stop_strings:
            raise bad("detokenize", "stop strings need the text: give stop_token_ids, or detokenize=True")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif not isinstance(self.stop_token_ids, list) or not all(
            is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids", "expected a list of non-negative integers")

    @property
    def has_penalties(self) -> bool:
        """True when any of presence, frequency or repetition penalty is active."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        """True when sampling is deterministic argmax (temperatures this small would overflow)."""
        return self.temperature < 1e-5
