"""The rank-0 engine: one step is drain, schedule, send, execute, sample, postprocess, process outputs.

Requests come in through :class:`InputProcessor` (any thread) and leave as
RequestOutputs through :class:`OutputProcessor`; between the two, the engine
drives the scheduler, the transport to the workers, rank 0's ModelRunner and the
sampler. ``add_request`` and ``abort`` may be called from any thread; ``step``
by one thread at a time (the caller of ``generate``, or the server's engine
thread). ``transport`` sends each StepPlan to the worker ranks before rank 0
runs the same plan itself; with one rank it does nothing.

A request with ``n > 1`` has one Sequence per sample. Sample 0 prefills the
prompt; the step that samples its first token samples every other sample's
first token from the same logits row, and the scheduler forks them (shared
prompt blocks, see rtp/core/scheduler.py). With ``seed=s``, sample ``i`` uses
seed ``s + i``, so it is the same as an n=1 request with seed ``s + i``.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from rtp.config import RtpConfig
from rtp.core.scheduler import Scheduler, ScheduleResult, SchedulerLimits
from rtp.core.sequence import Sequence
from rtp.core.step import StepPlan
from rtp.errors import RequestError
from rtp.log import get_logger
from rtp.outputs import RequestOutput
from rtp.runtime.detokenizer import TokenDecoder
from rtp.runtime.in_flight import InFlightSteps
from rtp.runtime.input_processor import InputProcessor
from rtp.runtime.model_info import ModelInfo
from rtp.runtime.model_runner import ModelRunner, StepOutput
from rtp.runtime.output_processor import OutputProcessor, RequestState, SampleState
from rtp.runtime.sampler import Sampler
from rtp.sampling import SamplingParams
from rtp.spec.controller import SpecController
from rtp.spec.proposer import build_proposer
from rtp.spec.sampling import Runs, sample_runs
from rtp.spec.verify import grammar_prefix, supports_drafts

logger = get_logger(__name__)


@dataclass
class _Sampled:
    """One step's sampled tokens, in batch order, then those of the forks made in this step (n > 1)."""

    seqs: list[Sequence]
    tokens: list[int]
    logprobs: list[dict[int, float] | None]
    num_rows: int
    """Of them, the rows of the step's logits (the forks follow)."""
    forks: dict[int, list[tuple[Sequence, int]]] | None = None
    """Parent sequence id -> (fork, its first token), for Scheduler.postprocess."""


class Engine:
    """Scheduler, sampler and output processing around rank 0's ModelRunner."""

    def __init__(
        self, config: RtpConfig, runner: ModelRunner, model_dir: Path,
        transport: Callable[[StepPlan], None] | None = None,
    ) -> None:
        self.config = config
        self.runner = runner
        self.model_dir = model_dir
        self.transport = transport or (lambda plan: None)
        self.model_info = ModelInfo.load(model_dir, runner.spec.vocab_size, runner.max_model_len,
                                         name=config.server.served_model_name,
                                         generation_config=config.model.generation_config)
        self.tokenizer = self.model_info.tokenizer
        self.eos_token_ids = self.model_info.eos_token_ids
        self.max_model_len = self.model_info.max_model_len
        self.inputs = InputProcessor(self.model_info)
        self._token_decoder = TokenDecoder(self.tokenizer)  # shared by every request's detokenizer
        self.text_outputs = True
        """False: outputs carry token ids only, no text and no stop strings (the API frontends make the text)."""
        self.scheduler = Scheduler(
            SchedulerLimits(
                max_num_seqs=config.scheduler.max_num_seqs,
                max_num_batched_tokens=runner.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                block_size=runner.block_size,
                num_blocks=runner.num_blocks,
                enable_prefix_caching=config.cache.enable_prefix_caching,
                recompute_last_hit=config.speculative_config.method == "eagle3",
            ),
            self.eos_token_ids,
        )
        self.sampler = Sampler(self.eos_token_ids, seed=config.model.seed)
        spec = config.speculative_config
        self.spec = (SpecController(spec, self.max_model_len, build_proposer(config, runner, model_dir))
                     if spec.enabled else None)
        """Speculative decoding's draft policy and counters; None when it is off."""
        self._spec_logged = time.monotonic()
        self.outputs = OutputProcessor(self.scheduler.finish, self._release_id)  # owned by the stepping thread
        self._seq_ids = itertools.count()
        self._lock = threading.Lock()  # guards the inbox and the live ids
        # Adds (a RequestState) and aborts (a request id) in the order they were submitted,
        # so an abort that follows an add in the same step is not lost.
        self._inbox: list[RequestState | str] = []
        self._live_ids: set[str] = set()  # ids submitted and not yet finished (any thread)
        stages = config.parallel.pipeline_parallel_size
        depth = config.parallel.pipeline_steps_in_flight or stages
        self.in_flight = InFlightSteps(self, depth) if stages > 1 and depth > 1 and not self.spec else None
        """Pipeline stages: the steps in flight (None: one step at a time)."""

    # ---- submission (any thread) ----

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt given as text or ids, validated."""
        return self.inputs.tokenize(prompt)

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queue a request; returns its id. Raises RequestError if it can never be served."""
        params = params or self.model_info.default_params()
        ids = self.inputs.tokenize(prompt, params.truncate_prompt_tokens, params.max_tokens)
        self.inputs.check_params(params)
        arrival = time.time()
        seqs = [Sequence(next(self._seq_ids), ids, params, arrival_time=arrival)]
        self.scheduler.validate(seqs[0])  # pure checks (length, cache size): reject now, not after queueing
        request_id = request_id or f"req-{seqs[0].seq_id}"
        for i in range(1, params.n):
            # Sample i: seed s + i (an n=1 request with that seed gives the same tokens).
            sp = dataclasses.replace(params, seed=None if params.seed is None else params.seed + i,
                                     prompt_logprobs=None)
            seqs.append(Sequence(next(self._seq_ids), ids, sp, arrival_time=arrival))
        req = RequestState.create(request_id, prompt if isinstance(prompt, str) else None, seqs,
                                  self._token_decoder if self.text_outputs and params.detokenize else None,
                                  self.inputs.bad_words_ids(params), self.model_info.stop_reason_ids(params))
        with self._lock:  # reserve the id last: nothing after this can fail
            if request_id in self._live_ids:
                raise RequestError(f"request id {request_id!r} is already in use")
            self._live_ids.add(request_id)
            self._inbox.append(req)
        return request_id

    def abort(self, request_id: str) -> None:
        """Abort a request (from any thread); its blocks are freed at the next step."""
        with self._lock:
            if request_id in self._live_ids:
                self._inbox.append(request_id)

    def has_unfinished(self) -> bool:
        """True while a submitted request has not finished (any thread)."""
        with self._lock:
            return bool(self._live_ids)

    def _release_id(self, request_id: str) -> None:
        with self._lock:
            self._live_ids.discard(request_id)

    # ---- stepping (one thread) ----

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the outputs of requests that changed."""
        if self.in_flight is not None:
            return self.in_flight.step()
        changed = self.drain_inbox()
        drafts = (self.spec.propose(self.scheduler.running, self._can_draft, self._grammar_prefix)
                  if self.spec is not None else None)
        result = self.scheduler.schedule(drafts)
        plan = result.plan
        if not plan.new_seqs and not plan.cached_seqs and not plan.freed_seq_ids:
            return changed
        # Every request plain greedy: the ranks take the argmax of their vocabulary shards, no logits gathered.
        plan.sample_argmax = self.spec is None and not self.outputs.full_sample_ids
        self.transport(plan)
        out = self.runner.execute(plan)
        if self.spec is not None:
            self.spec.observe(out, len(self.scheduler.running))
        if result.drafts is not None:
            self._step_speculative(result, out, changed)
            return changed
        self.finish_step(result, out, changed)
        return changed

    def finish_step(self, result: ScheduleResult, out: StepOutput, changed: list[RequestOutput]) -> None:
        """Sample a computed step, postprocess it and add the requests it changed to ``changed``."""
        sampled = self._sample(result, out)
        self._postprocess(result, sampled)
        self.outputs.process(sampled.seqs, sampled.tokens, sampled.logprobs, out.prompt_logits, changed)

    def drain_inbox(self) -> list[RequestOutput]:
        """Hand the submitted requests to the scheduler and apply the aborts; returns what finished.

        An abort of a request with a sequence in a step still in flight waits for that step.
        """
        with self._lock:
            inbox, self._inbox = self._inbox, []
        finished = []
        deferred: list[RequestState | str] = []
        busy = self.in_flight.busy if self.in_flight is not None else None
        outputs = self.outputs
        for item in inbox:
            if isinstance(item, RequestState):
                try:
                    self.scheduler.add(item.samples[0].seq)
                except RequestError as e:
                    finished.append(outputs.abort(item, str(e)))
                    continue
                outputs.add(item)
                continue
            req = outputs.requests.get(item)
            if req is not None and busy and any(smp.seq.seq_id in busy for smp in req.samples):
                deferred.append(item)
                continue
            if req is not None and not req.output.finished:
                for smp in req.samples:
                    self.scheduler.abort(smp.seq.seq_id)
                finished.append(outputs.abort(req))
        if deferred:
            with self._lock:
                self._inbox[:0] = deferred
        return finished

    def _sample(self, result: ScheduleResult, out: StepOutput) -> _Sampled:
        """A token for every sequence the step samples (and for this step's forks, n > 1)."""
        to_sample = list(itertools.compress(result.seqs, result.needs_sample))  # [S] as the logits rows
        if not to_sample:
            return _Sampled([], [], [], 0)
        if out.sample_tokens is not None:  # a sample_argmax plan: the ranks chose the tokens
            return _Sampled(to_sample, out.sample_tokens.tolist(), [None] * len(to_sample), len(to_sample))
        logits = out.sample_logits
        assert logits is not None, "rank 0 gets logits whenever a sequence needs a sample"
        if not self.outputs.full_sample_ids:  # every request is plain greedy: no per-row objects
            greedy = self.sampler.sample_greedy(logits)
            return _Sampled(to_sample, greedy.token_ids, greedy.logprobs, len(to_sample))
        samples = [self.outputs.samples[seq.seq_id] for seq in to_sample]
        rows = [smp.row() for smp in samples]
        fork_rows = self._take_forks(samples)  # (logits row, sample) of each new fork
        if fork_rows:
            # A fork's first token is drawn from its parent's logits row, with its own seed.
            src = torch.tensor([j for j, _ in fork_rows], device=logits.device)
            logits = torch.cat([logits, logits[src]])
            rows += [smp.row() for _, smp in fork_rows]
        drawn = self.sampler.sample(logits, rows)
        sampled = _Sampled(to_sample, drawn.token_ids, drawn.logprobs, len(to_sample))
        if fork_rows:
            sampled.forks = {}
            for (j, smp), tok in zip(fork_rows, drawn.token_ids[len(to_sample):]):
                sampled.forks.setdefault(to_sample[j].seq_id, []).append((smp.seq, tok))
            sampled.seqs = to_sample + [smp.seq for _, smp in fork_rows]
        return sampled

    @staticmethod
    def _take_forks(samples: list[SampleState]) -> list[tuple[int, SampleState]]:
        """The forks to make this step: (logits row of the parent, fork) for every request whose
        first sample gets its first token now."""
        out: list[tuple[int, SampleState]] = []
        for j, smp in enumerate(samples):
            req = smp.request
            if req.pending_forks and smp is req.samples[0] and smp.seq.num_completion_tokens == 0:
                out.extend((j, fork) for fork in req.pending_forks)
                req.pending_forks = []
        return out

    def _postprocess(self, result: ScheduleResult, sampled: _Sampled) -> None:
        """The scheduler applies the step; then the forks it did not make (their parent ended in
        between) are left out of ``sampled``: no token was added to them."""
        if sampled.forks is None:
            self.scheduler.postprocess(result, sampled.tokens)
            return
        n = sampled.num_rows
        self.scheduler.postprocess(result, sampled.tokens[:n], sampled.forks)
        keep = [i for i in range(n, len(sampled.seqs)) if sampled.seqs[i].num_completion_tokens > 0]
        if len(keep) < len(sampled.seqs) - n:
            sampled.seqs = sampled.seqs[:n] + [sampled.seqs[i] for i in keep]
            sampled.tokens = sampled.tokens[:n] + [sampled.tokens[i] for i in keep]
            sampled.logprobs = sampled.logprobs[:n] + [sampled.logprobs[i] for i in keep]

    # ---- speculative decoding ----

    def _can_draft(self, seq: Sequence) -> bool:
        """Whether ``seq``'s drafts can be verified: its grammar, if any, can roll tokens back."""
        smp = self.outputs.samples.get(seq.seq_id)
        return smp is not None and supports_drafts(smp.constraint)

    def _grammar_prefix(self, seq: Sequence, drafts: list[int]) -> int:
        """How many leading ``drafts`` of ``seq`` its grammar (if any) accepts."""
        smp = self.outputs.samples.get(seq.seq_id)
        constraint = smp.constraint if smp is not None else None
        return len(drafts) if constraint is None else grammar_prefix(constraint, drafts, self.runner.spec.vocab_size)

    def _step_speculative(self, result: ScheduleResult, out: StepOutput, changed: list[RequestOutput]) -> None:
        """Sample, verify, postprocess and emit a step whose plan carries drafts."""
        assert self.spec is not None and result.drafts is not None
        logits = out.sample_logits
        if logits is None:
            assert not any(result.needs_sample), "rank 0 gets logits whenever a sequence needs a sample"
            runs = Runs([], [], [], 0, [])
        else:
            runs = sample_runs(self.sampler, self.outputs, result, logits, self._take_forks)
        for seq, run, num_drafts in zip(runs.seqs, runs.runs, runs.num_drafts):
            self.spec.record(seq.seq_id, num_drafts, len(run) - 1)
        n = runs.num_rows
        self.scheduler.postprocess_speculative(result, runs.runs[:n], runs.forks)  # cuts runs at stops
        keep = [i for i in range(len(runs.seqs)) if i < n or runs.seqs[i].num_completion_tokens > 0]
        seqs = [runs.seqs[i] for i in keep]
        token_runs = [runs.runs[i] for i in keep]
        logprobs = [runs.logprobs[i][: len(runs.runs[i])] for i in keep]
        self.outputs.process_runs(seqs, token_runs, logprobs, out.prompt_logits, changed)
        now = time.monotonic()
        if now - self._spec_logged > 10.0:
            self._spec_logged = now
            line = self.spec.log_line()
            if line is not None:
                logger.info("%s", line)

    def fail_all(self, message: str) -> list[RequestOutput]:
        """Finish every live request with an error (a rank died); returns their outputs."""
        if self.in_flight is not None:
            self.in_flight.busy.clear()  # the steps in flight are lost with the failed rank
        self.drain_inbox()
        return self.outputs.fail_all(message)

    def stats(self) -> dict[str, float]:
        """Scheduler counters for logs, progress bars and metrics (and speculative decoding's, when on)."""
        stats = dataclasses.asdict(self.scheduler.stats)
        if self.spec is not None:
            stats.update(self.spec.counters.as_stats())
        if self.in_flight is not None:
            stats["pipeline_overlapped_steps"] = self.in_flight.num_overlapped
        return stats
