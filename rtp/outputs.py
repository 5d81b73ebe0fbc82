"""What a request produced: the result type of rtp.generate and the server.

As in vLLM, a :class:`RequestOutput` holds one :class:`CompletionOutput` per
sample in ``outputs`` (``n`` of them). The flat fields (``text``,
``token_ids``, ``logprobs``, ...) are those of the first sample, kept for the
common n = 1 case; ``finish_reason`` is the request's: set once every sample
finished.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Protocol


class Logprob(float):
    """A logprob as vLLM's outputs carry it (``.logprob``, ``.rank``, ``.decoded_token``) that is also the float
    itself, so that code written for either shape works: ``entry[t].logprob`` and ``entry[t] + 1.0`` alike."""

    __slots__ = ("rank", "decoded_token")
    rank: int | None  # 1 for the likeliest token
    decoded_token: str | None  # the token's own text (special tokens kept); None where the engine makes no text

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None) -> Logprob:
        self = super().__new__(cls, logprob)
        self.rank, self.decoded_token = rank, decoded_token
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    def __reduce__(self) -> tuple[Any, ...]:
        return Logprob, (float(self), self.rank, self.decoded_token)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"


class TextSource(Protocol):
    """What an output's text can follow while its request runs (the request's detokenizer)."""

    @property
    def text(self) -> str: ...


class _Text:
    """The ``text`` field of the outputs: a str, or a :class:`TextSource` whose text it reads when read.

    While a request runs, the engine points its outputs' text at the detokenizer (:func:`follow_text`) and sets
    the final str when it ends: a step then never builds the whole text again (that is a copy of every character
    so far, on every token of every request), only a reader of ``text`` does.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self.key = "_" + name

    def __get__(self, obj: Any, owner: type | None = None) -> str:  # noqa: ANN401
        if obj is None:
            return ""  # the dataclass default
        value = obj.__dict__[self.key]
        return value if type(value) is str else value.text

    def __set__(self, obj: Any, value: str) -> None:  # noqa: ANN401
        obj.__dict__[self.key] = value


def _samples(out: RequestOutput) -> list[CompletionOutput | RequestOutput]:
    """The outputs of ``out`` that hold a sample each: itself when n = 1, else its samples."""
    return [out] if out.samples is None else list(out.samples)


def follow_text(out: RequestOutput, sources: list[TextSource]) -> None:
    """Make the texts of ``out`` read ``sources`` (one per sample, in order; the request's flat fields are
    sample 0's) whenever they are read, until :func:`fix_text` (a copy, deep copy or pickle of an output takes
    the text as it reads then, never the source)."""
    for c, source in zip(_samples(out), sources):
        c.__dict__["_text"] = source
    out.__dict__["_text"] = sources[0]


def fix_text(out: RequestOutput) -> None:
    """Set the texts of ``out`` and of its samples to what they read now (the end of :func:`follow_text`)."""
    for c in [out, *(out.samples or ())]:
        c.text = c.text


def clear_deltas(out: RequestOutput) -> None:
    """A step begins for ``out``: no text and no tokens added yet, the request's nor any sample's."""
    for c in [out, *(out.samples or ())]:
        c.new_text, c.new_token_ids = "", []


def joined(pieces: list[str]) -> str:
    """The text of ``pieces``, left as one piece, so that the next read joins only what was added since (a piece
    appended meanwhile, from another thread, stays after it: one slice assignment)."""
    k = len(pieces)
    if k > 1:
        pieces[:k] = ["".join(pieces[:k])]
    return pieces[0] if pieces else ""


def _state(out: Any) -> dict[str, Any]:  # noqa: ANN401
    """What copy, deepcopy and pickle take of an output: its fields, the text as read now (not its source)."""
    state = dict(out.__dict__)
    state["_text"] = out.text
    return state


@dataclass
class CompletionOutput:
    """One sample of a request (vLLM's CompletionOutput, plus the streaming deltas)."""

    index: int
    text: _Text = _Text()
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    new_text: str = ""  # text added by the last step that changed this request
    new_token_ids: list[int] = field(default_factory=list)
    stop_reason: int | str | None = None  # see stop_reason()

    __getstate__ = _state

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float | None:
        return cumulative_logprob(self.token_ids, self.logprobs)


@dataclass
class RequestOutput:
    """The state of one request after a step (cumulative), plus what this step added."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: _Text = _Text()
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
    stop_reason: int | str | None = None
    """What ended a "stop": the stop string that matched, or the stop token id (a generation config's EOS id
    too); None otherwise (the tokenizer's EOS, a completed grammar, another finish reason). As vLLM's
    CompletionOutput.stop_reason."""

    __getstate__ = _state

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the generated tokens' logprobs (with SamplingParams.logprobs; else None)."""
        return cumulative_logprob(self.token_ids, self.logprobs)

    @property
    def outputs(self) -> list[CompletionOutput]:
        """One CompletionOutput per sample, as vLLM's RequestOutput.outputs."""
        if self.samples is not None:
            return self.samples
        return [CompletionOutput(0, self.text, self.token_ids, self.logprobs, self.finish_reason,
                                 self.new_text, self.new_token_ids, self.stop_reason)]

    @property
    def num_completion_tokens(self) -> int:
        """Generated tokens summed over the samples (OpenAI's usage.completion_tokens)."""
        if self.samples is None:
            return len(self.token_ids)  # (outputs would read the text)
        return sum(len(c.token_ids) for c in self.samples)


def cumulative_logprob(token_ids: list[int], logprobs: list[dict[int, float]] | None) -> float | None:
    """The sum of each token's logprob (its entry names it), None without logprobs."""
    return None if logprobs is None else sum(entry[t] for t, entry in zip(token_ids, logprobs))


def stop_reason(stop_string: str | None, token_ids: list[int], stop_token_ids: Collection[int] | None
                ) -> int | str | None:
    """The stop_reason of a sample that ended with "stop": the stop string that matched, else the last token
    where it is one of ``stop_token_ids`` (a request's are ModelInfo.stop_reason_ids), else None."""
    if stop_string is not None:
        return stop_string
    if token_ids and stop_token_ids and token_ids[-1] in stop_token_ids:
        return token_ids[-1]
    return None


def _copy(obj: Any, **fields: Any) -> Any:  # noqa: ANN401
    """A shallow copy of the output ``obj`` with the given fields replaced (``_text``: the text field's value; a
    plain ``__dict__`` copy: streams take one per request per step, and ``dataclasses.replace`` costs several
    times more)."""
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__)
    new.__dict__.update(fields)
    return new


def _copy_sample(c: CompletionOutput) -> CompletionOutput:
    return _copy(c, _text=c.text, token_ids=list(c.token_ids), new_token_ids=list(c.new_token_ids),
                 logprobs=None if c.logprobs is None else list(c.logprobs))


def snapshot(out: RequestOutput) -> RequestOutput:
    """A copy that later engine steps will not change (the engine appends to its lists in place)."""
    return _copy(
        out,
        _text=out.text,
        token_ids=list(out.token_ids),
        new_token_ids=list(out.new_token_ids),
        logprobs=None if out.logprobs is None else list(out.logprobs),
        prompt_logprobs=None if out.prompt_logprobs is None else list(out.prompt_logprobs),
        samples=None if out.samples is None else [_copy_sample(c) for c in out.samples],
    )


class _Pieces:
    """A :class:`TextSource` built from pieces, joined when read (a stream's text, see :func:`merge`)."""

    __slots__ = ("pieces",)

    def __init__(self, first: str) -> None:
        self.pieces = [first]

    @property
    def text(self) -> str:
        return joined(self.pieces)


def delta(out: RequestOutput) -> RequestOutput:
    """What the last step added to ``out``, for a stream whose reader builds the rest with :func:`merge`.

    A copy of ``out`` whose ``token_ids``, ``logprobs`` and ``text`` hold only the step's tokens, their logprobs
    and its text (``new_token_ids``, ``new_text``): it costs the step's size, where :func:`snapshot` copies the
    whole output, on every step of every stream. Every step's output of the request must reach :func:`merge`.
    """
    plp = out.prompt_logprobs  # filled in place while the prompt is read in chunks, final at the first token
    if plp is not None and len(out.token_ids) == len(out.new_token_ids):
        plp = list(plp)  # the first delivery
    return _step_part(out, prompt_logprobs=plp,
                      samples=None if out.samples is None else [_step_part(c) for c in out.samples])


def join_deltas(parts: list[RequestOutput]) -> RequestOutput:
    """The deltas (:func:`delta`) of consecutive steps of a request as one: a stream whose reader fell behind
    takes what is waiting at once (each part read once, however many wait)."""
    if len(parts) == 1:
        return parts[0]
    last = parts[-1]
    samples = None if last.samples is None else [
        _join_parts([p.samples[i] for p in parts]) for i in range(len(last.samples))]  # type: ignore[index]
    return _join_parts(parts, samples=samples)


def _join_parts(parts: list[Any], **extra: Any) -> Any:  # noqa: ANN401
    step: list[int] = []
    texts: list[str] = []
    lps: list | None = []
    for p in parts:
        step += p.new_token_ids
        texts.append(p.new_text)
        if lps is not None and p.logprobs is not None:
            lps += p.logprobs
        else:
            lps = None
    text = "".join(texts)
    return _copy(parts[-1], token_ids=step, new_token_ids=step, _text=text, new_text=text, logprobs=lps, **extra)


def merge(built: RequestOutput | None, part: RequestOutput) -> RequestOutput:
    """Add a :func:`delta` to the output built from the ones before (None for the first); returns it.

    The result is the output :func:`snapshot` would have taken at that step, updated in place at each call.
    """
    if built is None:
        built = part
        for c in _samples(built):
            c.token_ids = list(c.token_ids)
            c.__dict__["_text"] = _Pieces(c.__dict__["_text"])
    elif built.samples is None:
        _add_part(built, part)
    else:
        samples = built.samples
        built.__dict__.update(part.__dict__)  # the request's finish, times and flat deltas
        for c, p in zip(samples, part.samples or ()):
            _add_part(c, p)
        built.samples = samples
    if built.samples is not None:  # the flat fields are sample 0's
        first = built.samples[0]
        built.__dict__.update(token_ids=first.token_ids, logprobs=first.logprobs, _text=first.__dict__["_text"])
    if built.finished:
        fix_text(built)
    return built


def _step_part(obj: Any, **extra: Any) -> Any:  # noqa: ANN401
    step, lps = list(obj.new_token_ids), obj.logprobs
    return _copy(obj, token_ids=step, new_token_ids=step, _text=obj.new_text,
                 logprobs=None if lps is None else lps[len(lps) - len(step):], **extra)


def _add_part(built: Any, part: Any) -> None:  # noqa: ANN401
    """Everything but the growing fields is the part's (the step's finish, times, deltas)."""
    tokens, lps, text = built.token_ids, built.logprobs, built.__dict__["_text"]
    built.__dict__.update(part.__dict__)
    tokens.extend(part.token_ids)
    if lps is not None and part.logprobs is not None:
        lps.extend(part.logprobs)
    text.pieces.append(part.__dict__["_text"])
    built.__dict__.update(token_ids=tokens, logprobs=lps, _text=text)
