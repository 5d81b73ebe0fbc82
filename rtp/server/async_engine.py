"""Drive the engine from a dedicated thread and hand its outputs to asyncio.

``Engine.step`` must be called from one thread, and it blocks for the length
of a forward pass, so it cannot run on the server's event loop. The engine
thread steps while any request is unfinished (continuous batching across HTTP
requests) and sleeps on an Event when idle. What each step added to an output is copied
(:func:`rtp.outputs.delta`: the engine mutates its RequestOutput objects in
place step after step) and a step's copies are handed to the event loop together
(:func:`put_all`: one ``loop.call_soon_threadsafe`` a step, not one a stream),
each into its request's own ``asyncio.Queue``; the stream builds the output
from those (:func:`rtp.outputs.merge`).

A consumer that stops early (a client disconnected, a task was cancelled)
closes its :class:`RequestStream`, which aborts the request in the engine so
its KV blocks are freed at the next step.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from rtp.errors import RequestError, RtpError, WorkerDiedError
from rtp.log import get_logger
from rtp.outputs import RequestOutput, delta, join_deltas, merge
from rtp.sampling import SamplingParams
from rtp.server.activity import ActivityLog
from rtp.server.router import check_pin

logger = get_logger(__name__)

_FAILED_JOIN_S = 2.0  # how long stop() waits for the engine thread once the runtime has failed


class SyncEngine(Protocol):
    """What AsyncEngine drives: :class:`rtp.runtime.engine.Engine`, or anything with its request methods.

    ``tokenize`` and ``add_request`` may be called from any thread, ``step`` from one thread at a time.
    """

    def tokenize(self, prompt: str | list[int]) -> list[int]: ...

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str: ...

    def abort(self, request_id: str) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished(self) -> bool: ...

    def stats(self) -> dict[str, float]: ...


class EngineDeadError(RtpError):
    """The runtime failed (a rank died or the engine thread crashed); no request can be served."""


class ServerShuttingDownError(RtpError):
    """The server is stopping and the request did not finish within the shutdown grace period."""


class StreamOwner(Protocol):
    """What a RequestStream reports to when it closes: AsyncEngine, or an API frontend's EngineClient."""

    def _forget(self, request_id: str, abort: bool) -> None: ...


class ServingEngine(StreamOwner, Protocol):
    """What the HTTP app serves from: AsyncEngine in rank 0's process, EngineClient in a frontend process."""

    failure: str | None

    @property
    def stats(self) -> dict[str, float]: ...

    @property
    def replica_stats(self) -> list[dict[str, float]]:
        """Per data-parallel replica (one entry without data parallelism)."""
        ...

    @property
    def running(self) -> bool: ...

    def start(self) -> None: ...

    def stop(self, timeout: float = 30.0) -> None: ...

    def abort_all(self, message: str = ...) -> int: ...

    def tokenize(self, prompt: str | list[int]) -> list[int]: ...

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                    replica: int | None = None) -> RequestStream: ...


Delivery = tuple["RequestStream", "RequestOutput | BaseException"]
"""An item for a stream: a step's :func:`~rtp.outputs.delta` of its output, or the error that ends it."""


def put_all(items: list[Delivery]) -> None:
    """Hand ``items`` to their streams' event loops, from any thread: one wake-up of each loop for them all.

    Each ``call_soon_threadsafe`` writes to the loop's wake-up socket and wakes it: with one call a stream and
    a step, 256 streams cost ~6 ms of CPU a step (hand-off and readers, 2-core host), against ~1.4 ms with one
    call a step.
    """
    by_loop: dict[asyncio.AbstractEventLoop, list[Delivery]] = {}
    for stream, item in items:
        by_loop.setdefault(stream.loop, []).append((stream, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_enqueue, batch)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


def _enqueue(items: list[Delivery]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)


class RequestStream:
    """The outputs of one request, as an async iterator; ``close()`` aborts it if unfinished.

    Each step yields the same output object, updated (as the engine updates its own): a step costs the stream
    what the step added, whatever the output's length. Keep one with :func:`rtp.outputs.snapshot`. A reader
    that fell behind gets the steps waiting for it as one update (their tokens and text in its ``new_*``
    fields), as vLLM's streams do; the first update is always the first step's alone.
    """

    def __init__(self, owner: StreamOwner, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False
        self.closed = False
        self._owner = owner
        self._output: RequestOutput | None = None  # built from the deltas, on the loop's thread
        self._error: BaseException | None = None  # taken from the queue behind deltas: raised after them

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self.closed:
            raise StopAsyncIteration
        item = self._error or await self.queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        # Behind by several steps (a busy loop): they make one update, one event for an SSE client. The first
        # update stays the first step's (the client's first token, no inter-token gap measured before it).
        parts = [item]
        while self._output is not None and not parts[-1].finished and not self.queue.empty():
            following = self.queue.get_nowait()
            if isinstance(following, BaseException):
                self._error = following
                break
            parts.append(following)
        self._output = out = merge(self._output, join_deltas(parts))
        if out.finished:
            self.finished = True
        return out

    def close(self) -> None:
        """Stop listening; abort the request in the engine unless it already finished. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._owner._forget(self.request_id, abort=not self.finished)

    async def aclose(self) -> None:
        self.close()


class AsyncEngine:
    """An Engine stepped by its own thread, with per-request async output streams.

    ``engine`` is a :class:`SyncEngine`. Call :meth:`start` once an event loop
    is about to serve, :meth:`stop` after the last request finished.
    """

    def __init__(self, engine: SyncEngine, idle_wait_s: float = 1.0,
                 step: Callable[[], list[RequestOutput]] | None = None, log_stats_interval_s: float = 0.0) -> None:
        self.engine = engine
        self.activity = ActivityLog(log_stats_interval_s, time.monotonic())  # written by the engine thread
        # Runtime.step by default in the server: it turns a failed collective into an error naming the dead rank.
        self._step = step  # None: engine.step, looked up at each step
        self.idle_wait_s = idle_wait_s
        self.on_dead: list[Callable[[str], None]] = []  # called once when the engine thread fails
        self.failure: str | None = None  # why the engine cannot serve any more
        self.stats: dict[str, float] = {}  # the last snapshot of engine.stats(), refreshed by the engine thread
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()  # guards _streams
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- lifecycle ----

    @property
    def replica_stats(self) -> list[dict[str, float]]:
        """One replica: the engine's stats."""
        return [self.stats]

    @property
    def running(self) -> bool:
        """True while the engine thread serves and nothing failed."""
        return self._thread is not None and self._thread.is_alive() and self.failure is None \
            and not self._stop.is_set()

    def start(self) -> None:
        """Start the engine thread (once)."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine.start() was already called")
        self.stats = dict(self.engine.stats())
        self._thread = threading.Thread(target=self._run, name="rtp-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the engine thread after its current step; end any stream still open. Idempotent.

        After a failure the thread may be stuck for good in a collective with
        a lost rank: it then gets a few seconds, not ``timeout``.
        """
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            wait_s = timeout if self.failure is None else min(timeout, _FAILED_JOIN_S)
            self._thread.join(wait_s)
            if self._thread.is_alive():
                logger.error("the engine thread did not stop within %.0f s", wait_s)
        self._end_all(ServerShuttingDownError("the server stopped before the request finished"))

    def fail(self, message: str) -> None:
        """End every stream with EngineDeadError and refuse new requests (the runtime's failure hook)."""
        if self.failure is None:
            self.failure = message
        self._end_all(EngineDeadError(message))
        self._wake.set()

    def abort_all(self, message: str = "the server is shutting down and the request did not finish in time") -> int:
        """End every open stream with ServerShuttingDownError (their requests are aborted as they close).

        Returns the number of streams ended.
        """
        return self._end_all(ServerShuttingDownError(message))

    # ---- requests (event loop thread) ----

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """The engine's token ids of ``prompt``, validated (any thread; it blocks for the tokenizer)."""
        return self.engine.tokenize(prompt)

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                    replica: int | None = None) -> RequestStream:
        """Submit a request and return its output stream.

        Raises RequestError (a ValueError) for a prompt the engine can never
        serve and EngineDeadError once the runtime has failed; nothing is
        queued in either case. Must be called from a running event loop.
        ``replica`` (a data-parallel pin) may only be None or 0 here: one engine.
        """
        check_pin(replica, 1)
        if self.failure is not None:
            raise EngineDeadError(self.failure)
        if self._stop.is_set():
            raise ServerShuttingDownError("the server is shutting down")
        stream = RequestStream(self, request_id, asyncio.get_running_loop())
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            if self.failure is not None:  # fail() may have run since the check above
                raise EngineDeadError(self.failure)
            self._streams[request_id] = stream
        try:
            self.engine.add_request(prompt, params, request_id)
        except BaseException:
            with self._lock:
                self._streams.pop(request_id, None)
            stream.closed = True
            raise
        self._wake.set()
        return stream

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str
                       ) -> AsyncIterator[RequestOutput]:
        """Yield the request's output after every step that changed it; abort it if the caller stops early."""
        stream = self.add_request(prompt, params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread (its stream, if open, ends without a final output)."""
        self._forget(request_id, abort=True)

    def _forget(self, request_id: str, abort: bool) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
        if abort:
            self.engine.abort(request_id)
            self._wake.set()

    def _end_all(self, error: BaseException) -> int:
        with self._lock:
            streams = list(self._streams.values())
        put_all([(stream, error) for stream in streams])
        return len(streams)

    # ---- the engine thread ----

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                # Clear before checking, so a request added after the check still wakes us.
                self._wake.clear()
                if self.activity.due(now := time.monotonic()):
                    self.activity.log(self.stats, now)
                if self.failure is not None or not self.engine.has_unfinished():
                    self._wake.wait(self.idle_wait_s)
                    continue
                outputs = self._step() if self._step is not None else self.engine.step()
                self.stats = dict(self.engine.stats())
                self.activity.count(outputs)
                put_all(self._deliveries(outputs))
        except BaseException as e:  # noqa: BLE001 - a crashed engine thread must fail every client
            if isinstance(e, WorkerDiedError):
                # A lost rank: the runtime logged the one line that says why; no traceback to add.
                logger.error("the engine thread stopped: %s", e)
                message = str(e)
            else:
                logger.exception("the engine thread failed")
                # Clients get the exception type only; the details are in the log above.
                message = f"the engine failed ({type(e).__name__}; see the server log)"
            self.fail(message)
            for hook in self.on_dead:
                try:
                    hook(message)
                except Exception:  # noqa: BLE001
                    logger.exception("on_dead hook raised")

    def _deliveries(self, outputs: list[RequestOutput]) -> list[Delivery]:
        """What the streams get of a step's ``outputs`` (nothing for a request whose client went away: it is
        being aborted)."""
        with self._lock:
            streams = [self._streams.get(out.request_id) for out in outputs]
            for out, stream in zip(outputs, streams):
                if stream is not None and out.finished:
                    del self._streams[out.request_id]
        items: list[Delivery] = []
        for out, stream in zip(outputs, streams):
            if stream is None:
                continue
            if out.finished and out.error is not None:
                # Without a runtime failure, a request-level error is the engine refusing this request.
                items.append((stream, EngineDeadError(out.error) if self.failure else RequestError(out.error)))
            else:
                items.append((stream, delta(out)))
        return items
