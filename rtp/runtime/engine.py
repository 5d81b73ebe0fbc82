"""The rank-0 engine: requests in, scheduler -> broadcast -> forward -> sample -> outputs.

Only rank 0 has an Engine. ``transport`` sends each StepPlan to the worker
ranks before rank 0 runs the same plan itself; with one rank it does nothing.
``add_request`` and ``abort`` may be called from any thread; ``step`` is called
by one thread at a time (the caller of ``generate``, or the server's engine thread).

A request with ``n > 1`` has one Sequence per sample. Sample 0 prefills the
prompt; the step that samples its first token samples every other sample's
first token from the same logits row, and the scheduler forks them (shared
prompt blocks, see rtp/core/scheduler.py). With ``seed=s``, sample ``i`` uses
seed ``s + i``, so it is the same as an n=1 request with seed ``s + i``.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer

from rtp.config import RtpConfig
from rtp.core.scheduler import Scheduler, SchedulerConfig
from rtp.core.sequence import Sequence, SequenceStatus
from rtp.core.step import StepPlan
from rtp.errors import RequestError
from rtp.log import get_logger
from rtp.outputs import CompletionOutput, RequestOutput
from rtp.runtime.detokenizer import IncrementalDetokenizer, TokenDecoder
from rtp.runtime.model_runner import ModelRunner
from rtp.runtime.sampler import PenaltyState, Sampler, SampleRow, bad_words_token_ids, is_plain_greedy
from rtp.sampling import SamplingParams, TokenConstraint

logger = get_logger(__name__)


@dataclass(eq=False)
class _Request:
    seq: Sequence  # sample 0's sequence (the only one when n == 1)
    detok: IncrementalDetokenizer  # sample 0's detokenizer
    out: RequestOutput
    samples: list[_Sample] = dataclasses.field(default_factory=list)  # one per sample, samples[0] first
    pending_forks: list[_Sample] = dataclasses.field(default_factory=list)  # samples 1.. not forked yet
    num_unfinished: int = 1
    last_step: int = -1  # engine step that last changed an n > 1 request
    sample_of: dict[int, _Sample] = dataclasses.field(default_factory=dict)  # the samples by sequence id
    special: bool = False  # n > 1 or a constraint: the per-token loop calls _advance_special


@dataclass(eq=False)
class _Sample:
    req: _Request
    seq: Sequence
    detok: IncrementalDetokenizer
    comp: CompletionOutput | None  # None when n == 1 (the request's flat fields hold it)
    penalty: PenaltyState | None
    constraint: TokenConstraint | None
    bad_words: list[list[int]] | None = None  # params.bad_words tokenized

    def row(self) -> SampleRow:
        seq = self.seq
        return SampleRow(seq.params, seq.num_completion_tokens, seq.token_ids, seq.num_prompt_tokens,
                         self.penalty, self.constraint, self.bad_words)


def load_eos_ids(model_dir: Path, tokenizer) -> list[int]:  # noqa: ANN001
    """EOS ids from generation_config.json (may be a list) and the tokenizer."""
    ids: set[int] = set()
    gen = model_dir / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


class Engine:
    """Scheduler, sampler and detokenizer around rank 0's ModelRunner."""

    def __init__(
        self, config: RtpConfig, runner: ModelRunner, model_dir: Path,
        transport: Callable[[StepPlan], None] | None = None,
    ) -> None:
        self.config = config
        self.runner = runner
        self.model_dir = model_dir
        self.transport = transport or (lambda plan: None)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self._token_decoder = TokenDecoder(self.tokenizer)  # shared by every request's detokenizer
        self.eos_token_ids = load_eos_ids(model_dir, self.tokenizer)
        self.max_model_len = runner.max_model_len
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                block_size=runner.block_size,
                num_blocks=runner.num_blocks,
                enable_prefix_caching=config.enable_prefix_caching,
            ),
            self.eos_token_ids,
        )
        self.sampler = Sampler(self.eos_token_ids, seed=config.seed)
        self._seq_ids = itertools.count()
        self._requests: dict[str, _Request] = {}  # by request id, owned by the stepping thread
        self._by_seq: dict[int, _Request] = {}  # the same requests by the sequence id of each sample
        self._num_steps = 0
        # Ids of the requests in _requests that are not plain greedy (sampler.is_plain_greedy); while
        # there are none, a step samples with one argmax and builds no SampleRow objects.
        self._full_sample_ids: set[str] = set()
        self._lock = threading.Lock()  # guards the inbox and the live ids
        # Adds (a _Request) and aborts (a request id) in the order they were submitted,
        # so an abort that follows an add in the same step is not lost.
        self._inbox: list[_Request | str] = []
        self._live_ids: set[str] = set()  # ids submitted and not yet finished (any thread)

    # ---- submission (any thread) ----

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt given as text or ids, validated."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise RequestError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise RequestError("the prompt is empty: give at least one token")
        bad = [t for t in ids if not 0 <= t < self.runner.spec.vocab_size]
        if bad:
            vocab = self.runner.spec.vocab_size
            raise RequestError(f"token id {bad[0]} is out of range: the vocabulary has {vocab} ids")
        return ids

    def _check_token_ids(self, params: SamplingParams) -> None:
        vocab = self.runner.spec.vocab_size
        for name, ids in (("logit_bias", list(params.logit_bias or {})),
                          ("allowed_token_ids", params.allowed_token_ids or [])):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise RequestError(f"SamplingParams.{name}={bad[0]} is invalid: token id {bad[0]} is out of range, "
                                   f"the vocabulary has {vocab} ids")

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queue a request; returns its id. Raises RequestError if it can never be served."""
        params = params or SamplingParams()
        ids = self.tokenize(prompt)
        self._check_token_ids(params)
        arrival = time.time()
        seq = Sequence(next(self._seq_ids), ids, params, arrival_time=arrival)
        self.scheduler.validate(seq)  # pure checks (length, cache size): reject now, not after queueing
        request_id = request_id or f"req-{seq.seq_id}"
        n = params.n
        req = _Request(
            seq,
            IncrementalDetokenizer(self._token_decoder, ids, params),
            RequestOutput(request_id, prompt if isinstance(prompt, str) else None, ids, arrival_time=arrival,
                          logprobs=[] if params.logprobs is not None else None,
                          prompt_logprobs=[None] * len(ids) if params.prompt_logprobs is not None else None),
            num_unfinished=n,
        )
        req.samples.append(self._new_sample(req, seq, req.detok, 0 if n > 1 else None))
        for i in range(1, n):
            # Sample i: seed s + i (an n=1 request with that seed gives the same tokens).
            sp = dataclasses.replace(params, seed=None if params.seed is None else params.seed + i,
                                     prompt_logprobs=None)
            s = Sequence(next(self._seq_ids), ids, sp, arrival_time=arrival)
            smp = self._new_sample(req, s, IncrementalDetokenizer(self._token_decoder, ids, sp), i)
            req.samples.append(smp)
            req.pending_forks.append(smp)
        if params.bad_words:
            bad_ids = bad_words_token_ids(params.bad_words, self.tokenizer)
            for smp in req.samples:
                smp.bad_words = bad_ids
        req.sample_of = {smp.seq.seq_id: smp for smp in req.samples}
        req.special = n > 1 or req.samples[0].constraint is not None
        if n > 1:
            req.out.samples = [smp.comp for smp in req.samples if smp.comp is not None]
            # Sample 0's lists are the request's flat fields (the same objects).
            first = req.out.samples[0]
            req.out.token_ids, req.out.logprobs = first.token_ids, first.logprobs
        with self._lock:  # reserve the id last: nothing after this can fail
            if request_id in self._live_ids:
                raise RequestError(f"request id {request_id!r} is already in use")
            self._live_ids.add(request_id)
            self._inbox.append(req)
        return request_id

    @staticmethod
    def _new_sample(req: _Request, seq: Sequence, detok: IncrementalDetokenizer, index: int | None) -> _Sample:
        p = seq.params
        comp = None
        if index is not None:
            comp = CompletionOutput(index, logprobs=[] if p.logprobs is not None else None)
        # The constraint factory runs here, in the caller's thread, not in the step loop.
        constraint = p.constraint() if p.constraint is not None else None
        return _Sample(req, seq, detok, comp, PenaltyState() if p.has_penalties else None, constraint)

    def abort(self, request_id: str) -> None:
        """Abort a request (from any thread); its blocks are freed at the next step."""
        with self._lock:
            if request_id in self._live_ids:
                self._inbox.append(request_id)

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._live_ids)

    # ---- stepping (one thread) ----

    def _drain_inbox(self) -> list[RequestOutput]:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        finished = []
        for item in inbox:
            if isinstance(item, _Request):
                try:
                    self.scheduler.add(item.seq)
                except RequestError as e:
                    item.out.finish_reason, item.out.error = "abort", str(e)
                    finished.append(self._finish(item))
                    continue
                self._requests[item.out.request_id] = item
                for smp in item.samples:
                    self._by_seq[smp.seq.seq_id] = item
                if not is_plain_greedy(item.seq.params) or item.seq.params.n > 1:
                    self._full_sample_ids.add(item.out.request_id)
                continue
            req = self._requests.get(item)
            if req is not None and not req.out.finished:
                for smp in req.samples:
                    self.scheduler.abort(smp.seq.seq_id)
                    if smp.comp is not None and smp.comp.finish_reason is None:
                        smp.comp.finish_reason = "abort"
                req.out.finish_reason = "abort"
                finished.append(self._finish(req))
        return finished

    def _finish(self, req: _Request) -> RequestOutput:
        req.out.finish_time = time.time()
        self._requests.pop(req.out.request_id, None)
        self._full_sample_ids.discard(req.out.request_id)
        req.pending_forks = []
        for smp in req.samples:
            self._by_seq.pop(smp.seq.seq_id, None)
        with self._lock:
            self._live_ids.discard(req.out.request_id)
        return req.out

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the outputs of requests that changed."""
        changed = self._drain_inbox()
        result = self.scheduler.schedule()
        plan = result.plan
        if not plan.new_seqs and not plan.cached_seqs and not plan.freed_seq_ids:
            return changed
        self._num_steps += 1
        self.transport(plan)
        logits = self.runner.execute(plan)
        if plan.prompt_logprob_seq_ids:
            self._record_prompt_logprobs()
        to_sample = list(itertools.compress(result.seqs, result.needs_sample))  # [S] in batch order, as the logits rows
        sampled_seqs = to_sample  # to_sample, then the forks of this step (n > 1)
        tokens: list[int] = []
        logprobs: list = []
        forks: dict[int, list[tuple[Sequence, int]]] | None = None
        if to_sample:
            assert logits is not None, "rank 0 gets logits whenever a sequence needs a sample"
            if self._full_sample_ids:
                samples = [self._by_seq[seq.seq_id].sample_of[seq.seq_id] for seq in to_sample]
                rows = [smp.row() for smp in samples]
                fork_rows = self._take_forks(samples)  # (logits row, sample) of each new fork
                if fork_rows:
                    # A fork's first token is drawn from its parent's logits row, with its own seed.
                    src = torch.tensor([j for j, _ in fork_rows], device=logits.device)
                    logits = torch.cat([logits, logits[src]])
                    rows += [smp.row() for _, smp in fork_rows]
                sampled = self.sampler.sample(logits, rows)
                tokens, logprobs = sampled.token_ids, sampled.logprobs
                if fork_rows:
                    forks = {}
                    for (j, smp), tok in zip(fork_rows, tokens[len(to_sample):]):
                        forks.setdefault(to_sample[j].seq_id, []).append((smp.seq, tok))
                    sampled_seqs = to_sample + [smp.seq for _, smp in fork_rows]
            else:  # every request is plain greedy: the same tokens, without per-row objects
                sampled = self.sampler.sample_greedy(logits)
                tokens, logprobs = sampled.token_ids, sampled.logprobs
        self.scheduler.postprocess(result, tokens if forks is None else tokens[: len(to_sample)], forks)
        now = time.time()
        by_seq, finished_status = self._by_seq, SequenceStatus.FINISHED
        for seq, token, lp in zip(sampled_seqs, tokens, logprobs):
            req = by_seq[seq.seq_id]
            if req.special and self._advance_special(req.sample_of[seq.seq_id], token, lp, now, changed):
                continue
            out, detok = req.out, req.detok
            out.new_token_ids = [token]
            out.token_ids.append(token)
            if out.logprobs is not None:
                out.logprobs.append(lp)
            if out.first_token_time is None:
                out.first_token_time = now
            delta = ""
            # A stop or EOS token that ended the request never reaches the text.
            if seq.status is not finished_status or seq.finish_reason != "stop":
                delta, stopped = detok.add(token)
                if stopped:  # a stop string wins over reaching max_tokens on the same token
                    self.scheduler.finish(seq.seq_id, "stop")
                    seq.finish_reason = "stop"
                if seq.status is not finished_status:  # the common case: still running
                    out.new_text = delta
                    out.text = detok.text
                    changed.append(out)
                    continue
            out.new_text = delta + detok.flush()
            out.text = detok.text
            out.finish_reason = seq.finish_reason
            out.num_cached_tokens = seq.num_cached_tokens
            changed.append(self._finish(req))
        return changed

    def _advance_special(self, smp: _Sample, token: int, lp: dict[int, float] | None, now: float,
                         changed: list[RequestOutput]) -> bool:
        """A token of a sample with a constraint or of an n > 1 request; False: the caller adds it as usual."""
        seq = smp.seq
        if seq.num_completion_tokens == 0:
            return True  # a fork the scheduler did not make (its parent ended in between)
        if smp.constraint is not None:
            smp.constraint.accept(token)
            if smp.constraint.is_terminated() and seq.status is not SequenceStatus.FINISHED:
                self.scheduler.finish(seq.seq_id, "stop")
        if smp.comp is None:
            return False
        self._advance_sample(smp, token, lp, now, changed)
        return True

    @staticmethod
    def _take_forks(samples: list[_Sample]) -> list[tuple[int, _Sample]]:
        """The forks to make this step: (logits row of the parent, fork) for every request whose
        first sample gets its first token now."""
        out: list[tuple[int, _Sample]] = []
        for j, smp in enumerate(samples):
            req = smp.req
            if req.pending_forks and smp is req.samples[0] and smp.seq.num_completion_tokens == 0:
                out.extend((j, fork) for fork in req.pending_forks)
                req.pending_forks = []
        return out

    def _advance_sample(self, smp: _Sample, token: int, lp: dict[int, float] | None, now: float,
                        changed: list[RequestOutput]) -> None:
        """Add one token to one sample of an n > 1 request."""
        req, seq, comp = smp.req, smp.seq, smp.comp
        out = req.out
        assert comp is not None and out.samples is not None
        if req.last_step != self._num_steps:  # first change of this request in this step
            req.last_step = self._num_steps
            for c in out.samples:
                c.new_text, c.new_token_ids = "", []
            out.new_text, out.new_token_ids = "", []
            changed.append(out)
        comp.new_token_ids = [token]
        comp.token_ids.append(token)
        if comp.logprobs is not None:
            comp.logprobs.append(lp)  # type: ignore[arg-type]
        if out.first_token_time is None:
            out.first_token_time = now
        delta = ""
        finished = SequenceStatus.FINISHED
        if seq.status is not finished or seq.finish_reason != "stop":
            delta, stopped = smp.detok.add(token)
            if stopped:
                self.scheduler.finish(seq.seq_id, "stop")
                seq.finish_reason = "stop"
        if seq.status is finished:
            delta += smp.detok.flush()
            comp.finish_reason = seq.finish_reason
            req.num_unfinished -= 1
        comp.new_text, comp.text = delta, smp.detok.text
        if comp.index == 0:
            out.text, out.new_text, out.new_token_ids = comp.text, comp.new_text, comp.new_token_ids
        if req.num_unfinished == 0:
            out.finish_reason = out.samples[0].finish_reason
            out.num_cached_tokens = req.seq.num_cached_tokens
            self._finish(req)  # already in changed

    def _record_prompt_logprobs(self) -> None:
        """Turn the runner's prompt-position logits of this step into RequestOutput.prompt_logprobs."""
        got = getattr(self.runner, "prompt_logits", None)
        if got is None:
            return
        spans, logits = got
        offset = 0
        for seq_id, first_pos, count in spans:
            rows = logits[offset : offset + count]  # row j: logits after position first_pos + j
            offset += count
            req = self._by_seq.get(seq_id)
            plp = None if req is None else req.out.prompt_logprobs
            if req is None or plp is None:
                continue
            smp = req.sample_of[seq_id]
            out = req.out
            prompt = out.prompt_token_ids
            m = min(count, len(prompt) - 1 - first_pos)  # rows that predict a prompt token
            if m <= 0:
                continue
            lp = torch.log_softmax(rows[:m], dim=-1)  # [m, vocab]
            targets = prompt[first_pos + 1 : first_pos + 1 + m]
            target_lp = lp.gather(1, torch.tensor(targets, device=lp.device)[:, None])[:, 0].tolist()
            k = min(smp.seq.params.prompt_logprobs or 0, lp.shape[1])
            top_vals: list[list[float]] = [[] for _ in range(m)]
            top_ids: list[list[int]] = [[] for _ in range(m)]
            if k > 0:
                top = torch.topk(lp, k, dim=-1)
                top_vals, top_ids = top.values.tolist(), top.indices.tolist()
            for j in range(m):
                entry = dict(zip(top_ids[j], top_vals[j]))
                entry[targets[j]] = target_lp[j]
                plp[first_pos + 1 + j] = entry

    def fail_all(self, message: str) -> list[RequestOutput]:
        """Finish every live request with an error (a rank died); returns their outputs."""
        self._drain_inbox()
        outs = []
        for req in list(self._requests.values()):
            req.out.finish_reason, req.out.error = "abort", message
            outs.append(self._finish(req))
        return outs

    def stats(self) -> dict[str, float]:
        """Scheduler counters for logs, progress bars and metrics."""
        return dataclasses.asdict(self.scheduler.stats)
