"""Requests out: the sampled tokens of each step become RequestOutputs (tokens, logprobs, text, finish).

A request is one :class:`RequestState` holding one :class:`SampleState` per
sample (n = 1 is one sample). Every token of every sample takes one path,
:meth:`OutputProcessor.append_tokens`, which accepts several tokens of a sample
per step (speculative decoding emits 1..k+1): tokens and logprobs appended, the
first-token time, the detokenizer with its stop strings, the finish and the
flush of held-back text.

With n = 1 a sample writes straight into the request's RequestOutput (its flat
fields are the sample). With n > 1 each sample has its own CompletionOutput;
sample 0's token and logprob lists are the request's flat lists (the same
objects) and its text and deltas are copied there, and a sample that did not
change in a step shows empty deltas.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rtp.core.sequence import Sequence, SequenceStatus
from rtp.outputs import CompletionOutput, RequestOutput, clear_deltas, fix_text, follow_text, stop_reason
from rtp.runtime.detokenizer import IncrementalDetokenizer, TokenDecoder
from rtp.runtime.logprobs import name_tokens, top_logprobs
from rtp.runtime.model_runner import PromptLogits
from rtp.runtime.sampler import PenaltyState, SampleRow, is_plain_greedy
from rtp.sampling import TokenConstraint

_FINISHED = SequenceStatus.FINISHED


@dataclass(eq=False)
class SampleState:
    """One sample of a request: its sequence, detokenizer and the per-sequence sampler state."""

    request: RequestState
    seq: Sequence
    detok: IncrementalDetokenizer | None
    """None when the engine makes no text (API frontends detokenize and match stop strings)."""
    out: CompletionOutput | RequestOutput
    """Where this sample's tokens and text go: the request's own output when n == 1."""
    penalty: PenaltyState | None
    constraint: TokenConstraint | None
    bad_words: list[list[int]] | None = None
    """``params.bad_words`` tokenized."""
    plain: bool = False
    """n = 1, no grammar, no logprobs, no stop strings: a token that does not end the sequence only appends
    (:meth:`OutputProcessor.process` takes it without :meth:`OutputProcessor.append_tokens`)."""

    def row(self) -> SampleRow:
        """What the sampler needs of this sample's sequence at this step."""
        seq = self.seq
        return SampleRow(seq.params, seq.num_completion_tokens, seq.token_ids, seq.num_prompt_tokens,
                         self.penalty, self.constraint, self.bad_words)


@dataclass(eq=False)
class RequestState:
    """A request's output and its samples, owned by the stepping thread once it is queued."""

    output: RequestOutput
    samples: list[SampleState]
    """One per sample, sample 0 (the one that prefills the prompt) first."""
    pending_forks: list[SampleState]
    """Samples 1.. not forked from sample 0 yet (n > 1, until sample 0's first token)."""
    num_unfinished: int
    multi: bool
    """n > 1: the samples have CompletionOutputs of their own."""
    needs_rows: bool
    """The sampler needs this request's SampleRows (not plain greedy, or n > 1)."""
    last_step: int = -1
    """The output step that last changed the request (n > 1: its samples' deltas are reset once per step)."""
    decoder: TokenDecoder | None = None
    """The engine's decoder where it makes text: names the logprobs' tokens (Logprob.decoded_token)."""
    stop_reason_ids: frozenset[int] = frozenset()
    """The token ids a "stop" names as its stop_reason (ModelInfo.stop_reason_ids)."""

    @property
    def request_id(self) -> str:
        return self.output.request_id

    @classmethod
    def create(cls, request_id: str, prompt: str | None, seqs: list[Sequence], decoder: TokenDecoder | None,
               bad_words: list[list[int]] | None, stop_reason_ids: frozenset[int]) -> RequestState:
        """The state of a request whose samples are ``seqs`` (one per sample, all with the same prompt).

        With ``decoder`` None the outputs carry token ids only: no text, no stop strings.

        Each sample's constraint factory runs here, in the submitting thread, not in the step loop.
        """
        first = seqs[0]
        params, ids = first.params, first.token_ids
        multi = len(seqs) > 1
        output = RequestOutput(request_id, prompt, list(ids), arrival_time=first.arrival_time or time.time(),
                               logprobs=[] if params.logprobs is not None else None,
                               prompt_logprobs=[None] * len(ids) if params.prompt_logprobs is not None else None)
        req = cls(output, [], [], len(seqs), multi, multi or not is_plain_greedy(params), decoder=decoder,
                  stop_reason_ids=stop_reason_ids)
        comps = [CompletionOutput(i, logprobs=[] if s.params.logprobs is not None else None)
                 for i, s in enumerate(seqs)] if multi else []
        for i, seq in enumerate(seqs):
            p = seq.params
            out: CompletionOutput | RequestOutput = comps[i] if multi else output
            constraint = p.constraint() if p.constraint is not None else None
            detok = IncrementalDetokenizer(decoder, ids, p) if decoder is not None else None
            plain = not multi and constraint is None and p.logprobs is None and not p.stop_strings
            req.samples.append(SampleState(req, seq, detok, out, PenaltyState() if p.has_penalties else None,
                                           constraint, bad_words, plain))
        req.pending_forks = req.samples[1:]
        if multi:
            output.samples = comps
            output.token_ids, output.logprobs = comps[0].token_ids, comps[0].logprobs
        if decoder is not None:  # the texts are read from the detokenizers
            follow_text(output, [smp.detok for smp in req.samples if smp.detok is not None])
        return req


class OutputProcessor:
    """The live requests of rank 0's engine and the outputs their tokens produce.

    ``finish_seq(seq_id, reason)`` ends a sequence in the scheduler (a stop string, a finished
    grammar); ``on_finished(request_id)`` is told when a request's final output is ready.
    """

    def __init__(self, finish_seq: Callable[[int, str], None], on_finished: Callable[[str], None]) -> None:
        self._finish_seq, self._on_finished = finish_seq, on_finished
        self.requests: dict[str, RequestState] = {}
        self.samples: dict[int, SampleState] = {}  # by sequence id, every sample of every live request
        # Ids of the live requests whose samples need SampleRows; while there are none, a step
        # samples with one argmax and builds no SampleRow objects.
        self.full_sample_ids: set[str] = set()
        self._step = 0

    def add(self, req: RequestState) -> None:
        """Track a request the scheduler accepted."""
        self.requests[req.request_id] = req
        for smp in req.samples:
            self.samples[smp.seq.seq_id] = smp
        if req.needs_rows:
            self.full_sample_ids.add(req.request_id)

    def finish(self, req: RequestState) -> RequestOutput:
        """Stop tracking ``req``; returns its final output (its texts fixed: no longer read from the
        detokenizers)."""
        req.output.finish_time = time.time()
        fix_text(req.output)
        self.requests.pop(req.request_id, None)
        self.full_sample_ids.discard(req.request_id)
        req.pending_forks = []
        for smp in req.samples:
            self.samples.pop(smp.seq.seq_id, None)
        self._on_finished(req.request_id)
        return req.output

    def abort(self, req: RequestState, message: str | None = None) -> RequestOutput:
        """Finish ``req`` with finish_reason "abort" (and ``message`` as its error, if given)."""
        for smp in req.samples:
            if smp.out.finish_reason is None:
                smp.out.finish_reason = "abort"
        req.output.finish_reason, req.output.error = "abort", message
        clear_deltas(req.output)  # the abort adds nothing
        return self.finish(req)

    def process(self, seqs: list[Sequence], tokens: list[int], logprobs: list[dict[int, float] | None],
                prompt_logits: list[PromptLogits], changed: list[RequestOutput]) -> None:
        """Add one step's prompt logprobs, then its sampled token of each of ``seqs``; every request that
        changed joins ``changed``."""
        if prompt_logits:  # first: a request that finishes below leaves the live set
            self.record_prompt_logprobs(prompt_logits)
        self._step += 1
        now = time.time()
        samples, append = self.samples, self.append_tokens
        for seq, token, lp in zip(seqs, tokens, logprobs):
            smp = samples[seq.seq_id]
            if smp.plain and seq.status is not _FINISHED and (out := smp.request.output).first_token_time is not None:
                # The common step of the common request: append_tokens' work without its branches (this loop
                # runs for every sequence on every step).
                changed.append(out)
                out.new_token_ids = [token]
                out.token_ids.append(token)
                if smp.detok is not None:
                    out.new_text = smp.detok.add(token)[0]  # (no stop strings: it never stops)
                continue
            append(smp, [token], [lp], now, changed)

    def process_runs(self, seqs: list[Sequence], runs: list[list[int]],
                     logprobs: list[list[dict[int, float] | None]], prompt_logits: list[PromptLogits],
                     changed: list[RequestOutput]) -> None:
        """As :meth:`process`, for a step that gave each of ``seqs`` a run of tokens (speculative decoding:
        its accepted drafts and the token after them; empty for a sequence that got none)."""
        if prompt_logits:
            self.record_prompt_logprobs(prompt_logits)
        self._step += 1
        now = time.time()
        for seq, run, lps in zip(seqs, runs, logprobs):
            if run:
                self.append_tokens(self.samples[seq.seq_id], run, lps, now, changed)

    def append_tokens(self, smp: SampleState, tokens: list[int], logprobs: list[dict[int, float] | None],
                      now: float, changed: list[RequestOutput]) -> None:
        """Add the tokens ``smp`` got in this step (the scheduler has appended them to its sequence).

        ``logprobs`` has one entry per token (None where none were asked for). Only the
        last token may have ended the sequence; an EOS or stop token that did never reaches the text.
        """
        req, seq, out = smp.request, smp.seq, smp.out
        request_out = req.output
        if not req.multi:
            changed.append(request_out)
        elif req.last_step != self._step:  # the request's first change in this step
            req.last_step = self._step
            clear_deltas(request_out)
            changed.append(request_out)
        constraint = smp.constraint
        if constraint is not None:
            for token in tokens:
                constraint.accept(token)
            if constraint.is_terminated() and seq.status is not _FINISHED:
                self._finish_seq(seq.seq_id, "stop")
        out.new_token_ids = tokens
        out.token_ids.extend(tokens)
        if out.logprobs is not None:
            out.logprobs.extend(logprobs)  # type: ignore[arg-type]  # not None where logprobs are asked for
            if req.decoder is not None:
                name_tokens(logprobs, req.decoder.decode_one)
        if request_out.first_token_time is None:
            request_out.first_token_time = now
        delta = ""
        detok = smp.detok
        finished = seq.status is _FINISHED
        if detok is not None:
            for i, token in enumerate(detok.with_text(tokens, finished and seq.finish_reason == "stop")):
                text, stopped = detok.add(token)
                delta += text
                if stopped:  # a stop string wins over reaching max_tokens on the same token
                    self._finish_seq(seq.seq_id, "stop")
                    seq.finish_reason, finished = "stop", True
                    if i + 1 < len(tokens):  # several tokens this step: those after the stop never existed
                        tokens = self._drop_after_stop(out, tokens, i + 1)
                    break
        if finished:
            if detok is not None:
                delta += detok.flush()
            out.finish_reason = seq.finish_reason
            if seq.finish_reason == "stop":
                matched = detok.stop_string if detok is not None else None
                out.stop_reason = stop_reason(matched, out.token_ids, req.stop_reason_ids)
            req.num_unfinished -= 1
        if detok is not None:
            out.new_text = delta  # (out.text reads the detokenizer's)
        if out is not request_out and smp is req.samples[0]:  # n > 1: sample 0 is the request's flat fields
            request_out.new_text, request_out.new_token_ids = delta, tokens
        if finished and req.num_unfinished == 0:
            first = req.samples[0]
            request_out.finish_reason, request_out.stop_reason = first.out.finish_reason, first.out.stop_reason
            request_out.num_cached_tokens = first.seq.num_cached_tokens
            self.finish(req)  # already in changed

    @staticmethod
    def _drop_after_stop(out: CompletionOutput | RequestOutput, tokens: list[int], keep: int) -> list[int]:
        """Remove the tokens of this step past the first ``keep`` from ``out`` (a stop string ended them)."""
        drop = len(tokens) - keep
        del out.token_ids[-drop:]
        if out.logprobs is not None:
            del out.logprobs[-drop:]
        out.new_token_ids = tokens[:keep]
        return tokens[:keep]

    def record_prompt_logprobs(self, prompt_logits: list[PromptLogits]) -> None:
        """Turn one step's prompt-position logits into RequestOutput.prompt_logprobs entries."""
        for chunk in prompt_logits:
            smp = self.samples.get(chunk.seq_id)
            plp = None if smp is None else smp.request.output.prompt_logprobs
            if smp is None or plp is None:
                continue
            prompt, first = smp.request.output.prompt_token_ids, chunk.first_pos
            m = min(len(chunk.logits), len(prompt) - 1 - first)  # rows that predict a prompt token
            if m <= 0:
                continue
            targets = torch.tensor(prompt[first + 1 : first + 1 + m], device=chunk.logits.device)  # [m]
            k = smp.seq.params.prompt_logprobs or 0
            entries = top_logprobs(chunk.logits[:m], targets, [k] * m)
            if smp.request.decoder is not None:
                name_tokens(entries, smp.request.decoder.decode_one)
            plp[first + 1 : first + 1 + m] = entries

    def fail_all(self, message: str) -> list[RequestOutput]:
        """Finish every live request with ``message`` as its error; returns their outputs."""
        return [self.abort(req, message) for req in list(self.requests.values())]

