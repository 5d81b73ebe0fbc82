"""An API frontend's side of a request's outputs: token updates from the engine become RequestOutputs.

The engine (rank 0) sends token ids, logprobs and finish reasons only (see
rtp/server/frontend_wire.py); here each sample's
:class:`~rtp.runtime.detokenizer.IncrementalDetokenizer` turns them into
text and matches the stop strings, with the rules of the engine's own
OutputProcessor: an EOS or stop token that ends a sample never reaches the
text, a stop string wins over max_tokens on the same token, the held-back text
is flushed when a sample ends for another reason. A stop string that matches
here ends the sample with finish_reason "stop"; the caller then aborts the
request in the engine (n = 1 at once, n > 1 once every sample has ended).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from rtp.outputs import CompletionOutput, RequestOutput, clear_deltas, delta, follow_text, stop_reason
from rtp.runtime.detokenizer import IncrementalDetokenizer, TokenDecoder
from rtp.sampling import SamplingParams
from rtp.server.frontend_wire import SampleUpdate


@dataclass(eq=False)
class _Sample:
    out: CompletionOutput | RequestOutput
    detok: IncrementalDetokenizer
    done: bool = False


class FrontendRequest:
    """One request's outputs in a frontend, built from the engine's updates."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 decoder: TokenDecoder, stop_reason_ids: frozenset[int]) -> None:
        self.output = RequestOutput(request_id, None, list(prompt_token_ids), arrival_time=time.time(),
                                    logprobs=[] if params.logprobs is not None else None,
                                    prompt_logprobs=None)
        self.multi = params.n > 1
        comps = [CompletionOutput(i, logprobs=[] if params.logprobs is not None else None)
                 for i in range(params.n)] if self.multi else []
        if self.multi:
            self.output.samples = comps
            self.output.token_ids, self.output.logprobs = comps[0].token_ids, comps[0].logprobs
        self.samples = [_Sample(comps[i] if self.multi else self.output,
                                IncrementalDetokenizer(decoder, prompt_token_ids, params)) for i in range(params.n)]
        # The texts are read from the detokenizers (a stream gets the new text only).
        follow_text(self.output, [smp.detok for smp in self.samples])
        self.num_unfinished = params.n
        self.stop_reason_ids = stop_reason_ids  # ModelInfo.stop_reason_ids
        self.stopped_here = False
        """A stop string ended a sample here: the engine does not know, the request must be aborted there."""

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0

    def begin_step(self) -> None:
        """Before the updates of one OUTPUTS frame: the deltas of the last one are reset."""
        clear_deltas(self.output)

    def apply(self, upd: SampleUpdate, now: float) -> None:
        """Add what one step gave one sample: tokens, logprobs, text, the finish."""
        smp = self.samples[upd.sample]
        if smp.done:
            return  # a stop string ended it here; the engine's later tokens are not part of the output
        out, tokens, request_out = smp.out, upd.token_ids, self.output
        out.new_token_ids = tokens
        out.token_ids.extend(tokens)
        if out.logprobs is not None and upd.logprobs is not None:
            out.logprobs.extend(upd.logprobs)  # type: ignore[arg-type]  # entries exist where asked for
        if request_out.first_token_time is None and tokens:
            request_out.first_token_time = now
        reason = upd.finish_reason
        delta, detok = "", smp.detok
        for i, token in enumerate(detok.with_text(tokens, reason == "stop")):
            text, stopped = detok.add(token)
            delta += text
            if stopped:
                reason = "stop"
                self.stopped_here = True
                self._drop_after(out, upd, i + 1)
                break
        if reason is not None:
            if not detok.stopped:
                delta += detok.flush()
            out.finish_reason = reason
            if reason == "stop":
                out.stop_reason = stop_reason(detok.stop_string, out.token_ids, self.stop_reason_ids)
            smp.done = True
            self.num_unfinished -= 1
        out.new_text = delta
        if out is not request_out and upd.sample == 0:  # n > 1: sample 0 is the request's flat fields
            request_out.new_text = delta
            request_out.new_token_ids = out.new_token_ids
        if self.num_unfinished == 0:
            request_out.finish_reason = self.samples[0].out.finish_reason
            request_out.stop_reason = self.samples[0].out.stop_reason
            request_out.num_cached_tokens = upd.num_cached_tokens
            request_out.finish_time = now

    @staticmethod
    def _drop_after(out: RequestOutput | CompletionOutput, upd: SampleUpdate, keep: int) -> None:
        """A stop string ended the sample at this step's token ``keep - 1``: the step's later tokens (several
        per step with speculative decoding) and their logprobs are not part of the output."""
        drop = len(upd.token_ids) - keep
        if drop <= 0:
            return
        del out.token_ids[-drop:]
        if out.logprobs is not None and upd.logprobs is not None:
            del out.logprobs[-drop:]
        out.new_token_ids = upd.token_ids[:keep]

    def abort(self, message: str | None) -> None:
        """End every unfinished sample with "abort" (the engine refused or lost the request)."""
        self.begin_step()  # the abort adds nothing
        for smp in self.samples:
            if not smp.done:
                smp.out.finish_reason, smp.done = "abort", True
        self.num_unfinished = 0
        self.output.finish_reason, self.output.error = "abort", message
        self.output.finish_time = time.time()

    def delta(self) -> RequestOutput:
        """What the last OUTPUTS frame added, for the request's stream (see :func:`rtp.outputs.delta`)."""
        return delta(self.output)
