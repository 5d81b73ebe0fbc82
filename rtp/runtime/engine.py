"""The rank-0 engine: requests in, scheduler -> broadcast -> forward -> sample -> outputs.

Only rank 0 has an Engine. ``transport`` sends each StepPlan to the worker
ranks before rank 0 runs the same plan itself; with one rank it does nothing.
``add_request`` and ``abort`` may be called from any thread; ``step`` is called
by one thread at a time (the caller of ``generate``, or the server's engine thread).
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

from transformers import AutoTokenizer

from rtp.config import RtpConfig
from rtp.core.scheduler import Scheduler, SchedulerConfig
from rtp.core.sequence import Sequence, SequenceStatus
from rtp.core.step import StepPlan
from rtp.errors import RequestError
from rtp.log import get_logger
from rtp.outputs import RequestOutput
from rtp.runtime.detokenizer import IncrementalDetokenizer, TokenDecoder
from rtp.runtime.model_runner import ModelRunner
from rtp.runtime.sampler import Sampler, SampleRow, is_plain_greedy
from rtp.sampling import SamplingParams

logger = get_logger(__name__)


@dataclass
class _Request:
    seq: Sequence
    detok: IncrementalDetokenizer
    out: RequestOutput


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
        self._by_seq: dict[int, _Request] = {}  # the same requests by sequence id
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

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queue a request; returns its id. Raises RequestError if it can never be served."""
        params = params or SamplingParams()
        ids = self.tokenize(prompt)
        seq = Sequence(next(self._seq_ids), ids, params, arrival_time=time.time())
        self.scheduler.validate(seq)  # pure checks (length, cache size): reject now, not after queueing
        request_id = request_id or f"req-{seq.seq_id}"
        req = _Request(
            seq,
            IncrementalDetokenizer(self._token_decoder, ids, params),
            RequestOutput(request_id, prompt if isinstance(prompt, str) else None, ids, arrival_time=seq.arrival_time,
                          logprobs=[] if params.logprobs is not None else None),
        )
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
                self._by_seq[item.seq.seq_id] = item
                if not is_plain_greedy(item.seq.params):
                    self._full_sample_ids.add(item.out.request_id)
                continue
            req = self._requests.get(item)
            if req is not None and not req.out.finished:
                self.scheduler.abort(req.seq.seq_id)
                req.out.finish_reason = "abort"
                finished.append(self._finish(req))
        return finished

    def _finish(self, req: _Request) -> RequestOutput:
        req.out.finish_time = time.time()
        self._requests.pop(req.out.request_id, None)
        self._full_sample_ids.discard(req.out.request_id)
        self._by_seq.pop(req.seq.seq_id, None)
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
        self.transport(plan)
        logits = self.runner.execute(plan)
        to_sample = list(itertools.compress(result.seqs, result.needs_sample))  # [S] in batch order, as the logits rows
        tokens: list[int] = []
        logprobs: list = []
        if to_sample:
            if self._full_sample_ids:
                rows = [SampleRow(seq.params, seq.num_completion_tokens) for seq in to_sample]
                sampled = self.sampler.sample(logits, rows)
            else:  # every request is plain greedy: the same tokens, without per-row objects
                sampled = self.sampler.sample_greedy(logits)
            tokens, logprobs = sampled.token_ids, sampled.logprobs
        self.scheduler.postprocess(result, tokens)
        now = time.time()
        by_seq, finished_status = self._by_seq, SequenceStatus.FINISHED
        for seq, token, lp in zip(to_sample, tokens, logprobs):
            req = by_seq[seq.seq_id]
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
