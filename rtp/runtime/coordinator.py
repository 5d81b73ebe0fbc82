"""Rank 0's offline API: ``generate`` and ``generate_stream`` over the engine and its step transport.

A :class:`Runtime` is what ``rtp.init()`` returns on rank 0 (see
:mod:`rtp.runtime.startup` for how every rank gets there): it steps the engine
through the transport, which turns a lost peer into one error naming it, until
the requests it was given are done. ``shutdown`` stops the workers and releases
everything.
"""

from __future__ import annotations

import atexit
import time
from collections.abc import Callable, Iterator
from numbers import Integral
from typing import Any

from tqdm import tqdm

from rtp.config import RtpConfig
from rtp.errors import RequestError
from rtp.log import get_logger
from rtp.outputs import RequestOutput, snapshot
from rtp.runtime.engine import Engine
from rtp.runtime.model_info import ModelInfo
from rtp.runtime.replicas import ReplicaGroup
from rtp.runtime.step_transport import StepTransport
from rtp.sampling import SamplingParams

logger = get_logger(__name__)


class Runtime:
    """Rank 0's handle on the running world: the engine, stepped through the step transport."""

    def __init__(self, engine: Engine, transport: StepTransport) -> None:
        self.engine, self.transport = engine, transport
        self.closed = False
        # The open generate() batches and streams share the engine: each one's steps run every request, so a
        # step's outputs go to the mailbox of the call that owns them (request id -> (whether it wants every
        # output, a stream's, or only the finished one; the outputs not yet taken)).
        self._mailboxes: dict[str, tuple[bool, list[RequestOutput]]] = {}
        ps = transport.ps
        # Data parallelism: rank 0 spreads generate() batches over every replica's coordinator.
        self.replicas: ReplicaGroup | None = None
        if ps.dp_size > 1 and ps.dp_rank == 0 and ps.dp_group is not None:
            self.replicas = ReplicaGroup(ps.dp_group, ps.dp_size)

    @property
    def dp_rank(self) -> int:
        """This runtime's replica (0 without data parallelism)."""
        return self.transport.ps.dp_rank

    @property
    def dp_size(self) -> int:
        return self.transport.ps.dp_size

    @property
    def config(self) -> RtpConfig:
        return self.transport.config

    @property
    def model_info(self) -> ModelInfo:
        """The served model (name, tokenizer, vocabulary, EOS ids, max_model_len)."""
        return self.engine.model_info

    @property
    def on_failure(self) -> list[Callable[[str], None]]:
        """Hooks called with the message when a peer is lost (the server fails its clients)."""
        return self.transport.on_failure

    def check_alive(self) -> None:
        """Raise the liveness failure, if one was reported."""
        self.transport.check_alive()

    def report_lost_peer(self) -> bool:
        """Report a peer process already gone (see :meth:`StepTransport.report_lost_peer`); True if one is."""
        return self.transport.report_lost_peer()

    def step(self) -> list[RequestOutput]:
        """One engine step. A step that fails because a peer was lost becomes a WorkerDiedError naming it."""
        return self.transport.run_step(self.engine.step, self.engine.fail_all)

    def _step_to_mailboxes(self) -> None:
        """One step, its outputs delivered to the generate() or generate_stream() calls that own them."""
        for out in self.step():
            box = self._mailboxes.get(out.request_id)
            if box is not None and (box[0] or out.finished):
                box[1].append(snapshot(out) if box[0] else out)  # the engine keeps updating its own object

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate completions for a batch; outputs come back in prompt order."""
        batch: list  # of strings and token-id lists
        single = _token_ids(prompts)
        if single is not None:
            batch = [single]
        elif isinstance(prompts, (str, dict)):
            batch = [_as_prompt(prompts, "prompt 0")]
        elif isinstance(prompts, (list, tuple)):
            batch = [_as_prompt(p, f"prompt {i}") for i, p in enumerate(prompts)]
        else:
            raise TypeError("prompts must be a string, a list of token ids, or a list of either")
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(batch):
                raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(batch)} prompts")
            params = sampling_params
        else:
            params = [sampling_params or self.engine.model_info.default_params()] * len(batch)
        for i, sp in enumerate(params):
            if not isinstance(sp, SamplingParams):
                raise TypeError(f"sampling_params[{i}] is a {type(sp).__name__}; expected rtp.SamplingParams")
        if self.replicas is not None and len(batch) > 1:
            return self.replicas.generate(self, batch, params, use_tqdm)
        return self.generate_local(batch, params, use_tqdm)

    def generate_local(self, batch: list, params: list[SamplingParams], use_tqdm: bool,
                       indices: list[int] | None = None) -> list[RequestOutput]:
        """Generate a checked batch on this replica's engine; ``indices`` name the prompts in errors."""
        ids: list[str] = []
        try:
            for i, (p, sp) in enumerate(zip(batch, params)):
                try:
                    ids.append(self.engine.add_request(p, sp))
                except RequestError as e:
                    raise RequestError(f"prompt {i if indices is None else indices[i]}: {e}") from None
            return self._run_until_done(ids, use_tqdm)
        except BaseException:
            for rid in ids:  # leave nothing behind to run in a later call
                self.engine.abort(rid)
            raise

    def _run_until_done(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished = self._mailbox(ids, every=False)  # one for the batch: a step's scan is of its finished requests
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        start = self.engine.stats()
        last = (time.perf_counter(), start)
        try:  # the bar ends its line on every exit, so that an error printed next starts a line of its own
            while len(done) < len(ids):
                self._step_to_mailboxes()
                for out in finished:
                    done[out.request_id] = out
                    del self._mailboxes[out.request_id]
                    bar.update(1)
                finished.clear()
                now = time.perf_counter()
                if use_tqdm and now - last[0] > 0.5:
                    stats = self.engine.stats()
                    dt = now - last[0]
                    prefill = (stats["num_prefill_tokens_computed"] - last[1]["num_prefill_tokens_computed"]) / dt
                    decode = (stats["num_decode_tokens"] - last[1]["num_decode_tokens"]) / dt
                    bar.set_postfix_str(f"prefill {prefill:.0f} tok/s, decode {decode:.0f} tok/s")
                    last = (now, stats)
        finally:
            bar.close()
            for rid in ids:
                self._mailboxes.pop(rid, None)
        end = self.engine.stats()
        logger.info(
            "generated %d requests: %d prompt tokens computed, %d prefix-cache hits, %d decode tokens, %d preemptions",
            len(ids), end["num_prefill_tokens_computed"] - start["num_prefill_tokens_computed"],
            end["prefix_hit_tokens"] - start["prefix_hit_tokens"],
            end["num_decode_tokens"] - start["num_decode_tokens"],
            end["num_preemptions"] - start["num_preemptions"],
        )
        if self.engine.spec is not None:
            line = self.engine.spec.log_line()
            if line is not None:
                logger.info("%s", line)
        return [done[i] for i in ids]

    def generate_stream(self, prompt: str | list[int], sampling_params: SamplingParams | None = None
                        ) -> Iterator[RequestOutput]:
        """Yield the request's output after every step that changed it, until it finishes."""
        if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params is a {type(sampling_params).__name__}; expected rtp.SamplingParams")
        rid = self.engine.add_request(_as_prompt(prompt, "the prompt"), sampling_params)
        box = self._mailbox([rid], every=True)
        finished = False
        try:
            while not finished:
                if not box:  # (another call's steps may have run this request meanwhile)
                    self._step_to_mailboxes()
                while box and not finished:
                    out = box.pop(0)
                    finished = out.finished
                    yield out
        finally:
            self._mailboxes.pop(rid, None)
            if not finished:  # closed early by the caller
                self.engine.abort(rid)

    def _mailbox(self, rids: list[str], every: bool) -> list[RequestOutput]:
        """The list that collects the outputs of requests ``rids`` (``every`` one, else the finished ones)."""
        box: list[RequestOutput] = []
        for rid in rids:
            self._mailboxes[rid] = (every, box)
        return box

    def shutdown(self) -> None:
        """Tell the workers to exit, then release the channel and the process group. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.replicas is not None and self.transport.failed is None and self.transport.watchdog.failure is None:
            try:
                self.replicas.shutdown(self.config.liveness.timeout_s)
            except RuntimeError as e:  # a replica is gone: the liveness reports it; release ours anyway
                logger.warning("the other replicas did not confirm the shutdown: %s", e)
        self.transport.close()
        atexit.unregister(self.shutdown)  # registered at start-up: it held the whole runtime (its KV cache) alive
        logger.info("shut down")


def _token_ids(p: Any) -> list | None:  # noqa: ANN401
    """``p`` as a list when it is one prompt's token ids (a list, tuple or array of integers, numpy's included:
    those become ints), else None."""
    ids = p.tolist() if hasattr(p, "tolist") and not isinstance(p, str) else p  # a numpy array or a tensor
    if not (isinstance(ids, (list, tuple)) and ids and isinstance(ids[0], Integral) and not isinstance(ids[0], bool)):
        return None
    return [int(t) if isinstance(t, Integral) and not isinstance(t, bool) else t for t in ids]


def _as_prompt(p: Any, name: str) -> Any:  # noqa: ANN401
    """One prompt as the engine takes it (text, or a list of token ids) from vLLM's offline forms too: a
    ``{"prompt": text}`` or ``{"prompt_token_ids": ids}`` dict, ids in a tuple or an array, numpy integers.
    Anything else is passed on as it is, for the engine's checks to name."""
    if isinstance(p, dict):
        keys = [k for k in ("prompt", "prompt_token_ids") if k in p]
        others = sorted(set(p) - {"prompt", "prompt_token_ids"})
        if len(keys) != 1 or others:
            raise RequestError(f"{name}: a dict prompt holds one of 'prompt' (text) or 'prompt_token_ids', got "
                               f"the keys {sorted(p)}")
        p = p[keys[0]]
    ids = _token_ids(p)
    return p if ids is None else ids
