"""Requests in: prompts to token ids, and the checks that refuse a request before it is queued.

Runs in the submitting thread (the caller of ``generate``, the server's
tokenizing thread), never in the step loop: everything that can fail because of
what the user sent fails here, with a RequestError that says what is allowed.
"""

from __future__ import annotations

from rtp.errors import RequestError
from rtp.runtime.model_info import ModelInfo
from rtp.runtime.sampler import bad_words_token_ids
from rtp.sampling import SamplingParams


def truncate_prompt(ids: list[int], truncate: int | None, max_model_len: int, max_tokens: int | None = None
                    ) -> list[int]:
    """The prompt ``ids`` as SamplingParams.truncate_prompt_tokens ``truncate`` leaves it: its last ``truncate``
    tokens; for -1 ("fit the context") its last ``max_model_len - max_tokens`` (at least one; without a
    ``max_tokens``: ``max_model_len - 1``, as vLLM's, and the default max_tokens then shrinks to fit); all of them
    for None. A ``truncate`` that leaves no room for a generated token is refused: no prompt that long can be
    served."""
    if truncate is None:
        return ids
    if truncate >= max_model_len:
        raise RequestError(f"SamplingParams.truncate_prompt_tokens={truncate} is invalid: it leaves no room in the "
                           f"model's context (max_model_len={max_model_len}) for a generated token; give at most "
                           f"{max_model_len - 1}, or -1 to fit the prompt to the context")
    keep = max(1, max_model_len - (max_tokens or 1)) if truncate == -1 else truncate
    return ids[-keep:]


class InputProcessor:
    """Tokenization and token-id checks against one model's tokenizer and vocabulary."""

    def __init__(self, info: ModelInfo) -> None:
        self.info = info

    def tokenize(self, prompt: str | list[int], truncate: int | None = None, max_tokens: int | None = None
                 ) -> list[int]:
        """Token ids of a prompt given as text or ids, validated, then truncated as
        SamplingParams.truncate_prompt_tokens ``truncate`` says (see :func:`truncate_prompt`)."""
        if isinstance(prompt, str):
            ids = self.info.tokenizer.encode(prompt, add_special_tokens=False)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise RequestError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise RequestError("the prompt is empty: give at least one token")
        vocab = self.info.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} is out of range: the vocabulary has {vocab} ids")
        return truncate_prompt(ids, truncate, self.info.max_model_len, max_tokens)

    def check_params(self, params: SamplingParams) -> None:
        """Refuse token ids in ``params`` (logit_bias, allowed_token_ids) that the vocabulary does not have."""
        vocab = self.info.vocab_size
        for name, ids in (("logit_bias", list(params.logit_bias or {})),
                          ("allowed_token_ids", params.allowed_token_ids or [])):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise RequestError(f"SamplingParams.{name}={bad[0]} is invalid: token id {bad[0]} is out of range, "
                                   f"the vocabulary has {vocab} ids")

    def bad_words_ids(self, params: SamplingParams) -> list[list[int]] | None:
        """``params.bad_words`` as the token sequences the sampler bans, or None without bad words."""
        if not params.bad_words:
            return None
        return bad_words_token_ids(params.bad_words, self.info.tokenizer)
