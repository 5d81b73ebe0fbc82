"""An API frontend's handle on rank 0's engine: requests out as frames, step outputs in as frames.

:class:`EngineClient` has the request interface of
:class:`rtp.server.async_engine.AsyncEngine` (``tokenize``, ``add_request``
returning a :class:`RequestStream`, ``abort``, ``running``, ``failure``,
``stats``), so the same FastAPI app serves either. Here, though, the engine
is another process: ``add_request`` validates the request as the engine would
(prompt, token ids, lengths against the cache) and sends an ADD frame; the
engine's OUTPUTS frame of each step is decoded on the event loop and turned
into text (:mod:`rtp.server.frontend_outputs`), and each changed request's
output goes to its stream. Closing a stream early sends an ABORT; so does a
stop string that matched here.

The socket is read and written only on the event loop, never blocking it:
what the kernel does not take at once waits in a buffer until the socket is
writable. FAIL (the runtime failed) ends every stream with EngineDeadError;
SHUTDOWN (SIGTERM on rank 0) and the engine's socket closing stop the server.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable

from rtp.core.schedule_types import SchedulerLimits
from rtp.core.scheduler import Scheduler
from rtp.core.sequence import Sequence
from rtp.errors import RequestError
from rtp.log import get_logger
from rtp.runtime.detokenizer import TokenDecoder
from rtp.runtime.input_processor import InputProcessor
from rtp.runtime.model_info import ModelInfo
from rtp.sampling import SamplingParams
from rtp.server.async_engine import Delivery, EngineDeadError, RequestStream, ServerShuttingDownError, put_all
from rtp.server.frontend_outputs import FrontendRequest
from rtp.server.frontend_wire import (
    EngineRequest,
    FrameReader,
    Kind,
    decode_outputs,
    encode_abort,
    frame,
)
from rtp.server.router import PrefixRouter, check_pin
from rtp.structured import GrammarSpec

logger = get_logger(__name__)

_RECV_BYTES = 1 << 18


class _EngineConn:
    """One engine's socket seen from the frontend: its frame reader, unsent bytes and last stats."""

    def __init__(self, index: int, sock: socket.socket) -> None:
        self.index, self.sock = index, sock
        self.reader = FrameReader()
        self.out = bytearray()  # frames the socket did not take yet
        self.stats: dict[str, float] = {}
        self.in_flight = 0  # this frontend's requests running there
        self.routed = 0  # requests sent there since the start


class EngineClient:
    """The engines seen from one frontend process: rank 0's over ``sock`` (and, with data parallelism, the
    other replicas' coordinators over ``replicas``), the request going to the one ``router`` picks.

    ``limits`` are the engine's numbers the frontend validates with (HELLO's
    "limits": block_size, num_blocks, max_num_seqs, max_num_batched_tokens,
    enable_prefix_caching); with several replicas, the smallest of each.
    """

    def __init__(self, sock: socket.socket, info: ModelInfo, limits: dict[str, int],
                 replicas: list[socket.socket] | None = None, router: PrefixRouter | None = None,
                 names: list[str] | None = None, beat_interval_s: float | None = None) -> None:
        self.conns = [_EngineConn(i, s) for i, s in enumerate([sock, *(replicas or [])])]
        self._names = ["the engine process (rank 0)", *(names or [])]  # "... is gone"
        self.router = router
        if len(self.conns) > 1 and router is None:
            raise ValueError("several engines need a router")
        self.info = info
        self.inputs = InputProcessor(info)
        # Only for Scheduler.validate (pure checks of length and cache size): the engine's own
        # scheduler would refuse the same requests, but after the 200 of a stream was sent.
        self._validator = Scheduler(SchedulerLimits(
            max_num_seqs=limits["max_num_seqs"], max_num_batched_tokens=limits["max_num_batched_tokens"],
            max_model_len=info.max_model_len, block_size=limits["block_size"], num_blocks=limits["num_blocks"],
            enable_prefix_caching=bool(limits["enable_prefix_caching"])), info.eos_token_ids)
        self._decoder = TokenDecoder(info.tokenizer)
        self.failure: str | None = None
        self.on_dead: list[Callable[[str], None]] = []  # the engine failed or went away: stop serving
        self.on_shutdown: list[Callable[[], None]] = []  # the engine asked for a graceful stop
        # by handle: the request, its stream, the engine it runs on
        self._requests: dict[int, tuple[FrontendRequest, RequestStream, _EngineConn]] = {}
        self._handles: dict[str, int] = {}  # request id -> handle
        self._next_handle = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started = False
        self._stopping = False
        self._beat_interval_s = beat_interval_s  # None: no BEAT frames (an engine that watches none)
        self._send_lock = threading.Lock()  # the loop's writes and the beat thread's
        self.told_to_stop = False  # rank 0's engine sent SHUTDOWN (the server stops gracefully)

    @property
    def stats(self) -> dict[str, float]:
        """The engines' stats summed (kv_usage: the mean), for /metrics."""
        if len(self.conns) == 1:
            return self.conns[0].stats
        total: dict[str, float] = {}
        for conn in self.conns:
            for k, v in conn.stats.items():
                total[k] = total.get(k, 0.0) + v
        if "kv_usage" in total:
            total["kv_usage"] /= len(self.conns)
        return total

    @property
    def replica_stats(self) -> list[dict[str, float]]:
        """Each replica's last stats, with the requests this frontend routed there ("routed_requests")."""
        return [{**c.stats, "routed_requests": float(c.routed)} for c in self.conns]

    # ---- lifecycle (the app's lifespan) ----

    @property
    def running(self) -> bool:
        """True while the engine serves and this frontend is not stopping."""
        return self._started and self.failure is None and not self._stopping

    def start(self) -> None:
        """Start reading the engines' frames on the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.current_thread()
        for conn in self.conns:
            conn.sock.setblocking(False)
            self._loop.add_reader(conn.sock.fileno(), self._on_readable, conn)
        self._started = True
        if self._beat_interval_s is not None:
            threading.Thread(target=self._beat, args=(self._beat_interval_s,), name="rtp-frontend-beat",
                             daemon=True).start()

    def say_goodbye(self) -> None:
        """After a graceful stop that rank 0 asked for: tell the other replicas' engines, which got no signal (on
        another node), that this frontend stopped, not died. The event loop has ended: blocking writes."""
        for conn in self.conns[1:]:
            try:
                conn.sock.settimeout(1.0)
                conn.sock.sendall(bytes(conn.out) + frame(Kind.SHUTDOWN))
            except OSError:
                pass

    def _beat(self, interval_s: float) -> None:
        """A thread: tell the engines every ``interval_s`` that this process runs (one stopped or hung is killed);
        a thread, so that a long piece of work on the event loop (a big response body) does not pass for a hang.
        A beat waits while the loop has bytes queued for that engine (it must not land inside a frame)."""
        beat = frame(Kind.BEAT)
        while self.failure is None:
            for conn in self.conns:
                with self._send_lock:
                    if conn.out:
                        continue
                    try:
                        sent = conn.sock.send(beat)
                    except OSError:  # full (the engine reads nothing) or gone: the engine tells either
                        continue
                    if sent < len(beat):  # (a nearly full buffer) the rest goes out before anything else
                        conn.out += beat[sent:]
                        assert self._loop is not None
                        self._loop.call_soon_threadsafe(self._loop.add_writer, conn.sock.fileno(),
                                                        self._on_writable, conn)
            time.sleep(interval_s)

    def send_ready(self) -> None:
        """Tell the engines this frontend accepts connections."""
        for conn in self.conns:
            self._send(conn, frame(Kind.READY))

    def stop(self, timeout: float = 30.0) -> None:
        """End every stream still open (the server stops). Idempotent; any thread."""
        self._stopping = True
        self._end_all(ServerShuttingDownError("the server stopped before the request finished"))

    def fail(self, message: str) -> None:
        """End every stream with EngineDeadError and refuse new requests."""
        if self.failure is None:
            self.failure = message
        self._end_all(EngineDeadError(message))

    def abort_all(self, message: str = "the server is shutting down and the request did not finish in time") -> int:
        """End every open stream with ServerShuttingDownError (their requests are aborted as they close)."""
        return self._end_all(ServerShuttingDownError(message))

    def _end_all(self, error: BaseException) -> int:
        streams = [stream for _, stream, _ in list(self._requests.values())]
        put_all([(stream, error) for stream in streams])
        return len(streams)

    # ---- requests (event loop) ----

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of ``prompt``, validated (any thread; it blocks for the tokenizer)."""
        return self.inputs.tokenize(prompt)

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                    replica: int | None = None) -> RequestStream:
        """Validate and send a request; returns its output stream (see AsyncEngine.add_request).

        ``replica`` pins it to one data-parallel replica; otherwise the router picks one.
        """
        if self.failure is not None:
            raise EngineDeadError(self.failure)
        if self._stopping or not self._started:
            raise ServerShuttingDownError("the server is shutting down")
        if request_id in self._handles:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.inputs.tokenize(prompt, params.truncate_prompt_tokens, params.max_tokens)
        self.inputs.check_params(params)
        self._validator.validate(Sequence(0, ids, params))
        grammar: GrammarSpec | None = getattr(params.constraint, "grammar_spec", None)
        if params.constraint is not None and grammar is None:
            raise RequestError("a constraint needs its grammar spec to reach the engine process")
        if self.router is not None:
            conn = self.conns[self.router.choose(ids, [c.in_flight for c in self.conns], replica)]
        else:
            check_pin(replica, 1)
            conn = self.conns[0]
        handle = self._next_handle
        self._next_handle = (self._next_handle + 1) & 0xFFFFFFFF
        stream = RequestStream(self, request_id, asyncio.get_running_loop())
        self._requests[handle] = (FrontendRequest(request_id, ids, params, self._decoder,
                                                  self.info.stop_reason_ids(params)), stream, conn)
        self._handles[request_id] = handle
        conn.in_flight += 1
        conn.routed += 1
        self._send(conn, EngineRequest(handle, request_id, ids, params, grammar).encode())
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (its stream, if open, ends without a final output)."""
        self._forget(request_id, abort=True)

    def _forget(self, request_id: str, abort: bool) -> None:
        if self._thread is not None and threading.current_thread() is not self._thread:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._forget, request_id, abort)
            return
        handle = self._handles.pop(request_id, None)
        if handle is None:
            return
        entry = self._requests.pop(handle, None)
        if entry is None:
            return
        conn = entry[2]
        conn.in_flight -= 1
        if abort and self.failure is None:
            self._send(conn, encode_abort([handle]))

    def _drop(self, handle: int) -> _EngineConn:
        """Forget a request that ended (finished or refused); returns its engine."""
        req, _, conn = self._requests.pop(handle)
        self._handles.pop(req.output.request_id, None)
        conn.in_flight -= 1
        return conn

    # ---- the sockets (event loop) ----

    def _send(self, conn: _EngineConn, data: bytes) -> None:
        with self._send_lock:
            if conn.out:
                conn.out += data
                return
            try:
                sent = conn.sock.send(data)
            except BlockingIOError:
                sent = 0
            except OSError:
                return  # the engine is gone: the reader sees EOF
            if sent < len(data):
                conn.out += data[sent:]
                assert self._loop is not None
                self._loop.add_writer(conn.sock.fileno(), self._on_writable, conn)

    def _on_writable(self, conn: _EngineConn) -> None:
        with self._send_lock:
            try:
                sent = conn.sock.send(conn.out)
            except BlockingIOError:
                return
            except OSError:
                sent = len(conn.out)
            del conn.out[:sent]
            if not conn.out:
                assert self._loop is not None
                self._loop.remove_writer(conn.sock.fileno())

    def _name(self, conn: _EngineConn) -> str:
        if conn.index < len(self._names):
            return self._names[conn.index]
        return f"the engine of data-parallel replica {conn.index}"

    def _on_readable(self, conn: _EngineConn) -> None:
        try:
            data = conn.sock.recv(_RECV_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            assert self._loop is not None
            self._loop.remove_reader(conn.sock.fileno())
            if not self._stopping:
                self._dead(f"{self._name(conn)} is gone")
            return
        for kind, payload in conn.reader.feed(data):
            if kind == Kind.OUTPUTS:
                self._on_outputs(conn, payload)
            elif kind == Kind.FAIL:
                message = bytes(payload).decode()
                self._dead(message if len(self.conns) == 1 else f"replica {conn.index}: {message}")
            elif kind == Kind.SHUTDOWN:
                self.told_to_stop = self.told_to_stop or conn.index == 0
                if not self._stopping:
                    self._stopping = True
                    for hook in self.on_shutdown:
                        hook()

    def _dead(self, message: str) -> None:
        if self.failure is not None:
            return
        self.fail(message)
        for hook in self.on_dead:
            hook(message)

    def _on_outputs(self, conn: _EngineConn, payload: memoryview) -> None:
        stats, updates, errors, prompt_lps = decode_outputs(payload)
        conn.stats = stats
        now = time.time()
        changed: dict[int, FrontendRequest] = {}
        for upd in updates:
            entry = self._requests.get(upd.handle)
            if entry is None:
                continue  # aborted here; the engine had not heard yet
            req = entry[0]
            if upd.handle not in changed:
                req.begin_step()
                changed[upd.handle] = req
            req.apply(upd, now)
        for handle, entries in prompt_lps.items():
            entry = self._requests.get(handle)
            if entry is not None:
                entry[0].output.prompt_logprobs = entries
        items: list[Delivery] = []  # handed to the event loop together (put_all)
        for handle, message in errors.items():
            entry = self._requests.get(handle)
            if entry is None:
                continue
            entry[0].abort(message)
            self._drop(handle)
            items.append((entry[1], EngineDeadError(message) if self.failure else RequestError(message)))
        for handle, req in changed.items():
            entry = self._requests.get(handle)
            if entry is None:
                continue
            stream = entry[1]
            if req.finished:
                self._drop(handle)
                if req.stopped_here:  # a stop string matched here: the engine still runs the request
                    self._send(conn, encode_abort([handle]))
            items.append((stream, req.delta()))
        put_all(items)
