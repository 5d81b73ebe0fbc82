"""Rank 0 with API frontend processes: the engine loop that serves their requests, and the exits.

Process tree (``server.api_processes`` = N >= 1)::

    torchrun
    ├── rank 0: this loop (main thread) + the liveness threads; no HTTP, no text
    │   ├── frontend 0 ... N-1: uvicorn + FastAPI, tokenizer, chat templates, grammar checks,
    │   │                         detokenizer and stop strings, SSE/JSON (rtp.server.frontend)
    └── ranks 1..: workers

Each iteration reads what the frontends sent (ADD, ABORT; never blocking while
requests run), runs one engine step, and sends each frontend with changed
requests one OUTPUTS frame: the step's tokens of all its requests, as arrays
(rtp/server/frontend_wire.py). The engine makes no text
(``Engine.text_outputs`` is False): detokenization and stop strings are the
frontends'; a stop string that matched there comes back as an ABORT.

Exits, each ending the frontends and the workers, no segment left behind:

* SIGTERM/SIGINT: SHUTDOWN to every frontend; they drain like the
  single-process server (``server.shutdown_grace_s``, then the rest is aborted)
  and exit; the engine steps until they are gone, then returns 0. A signal that
  finds a rank already gone (torchrun stops the survivors when one dies) is a
  lost rank (below).
* A frontend dies (EOF on its socket, its process exited, or it read nothing for
  ``liveness_timeout_s``): its requests are aborted in the engine, the others get
  FAIL (their clients an error), and the server exits 1.
* A rank is lost (the runtime's watchdog): FAIL to every frontend, exit 1.

Data parallelism (``data_parallel_size`` > 1): every replica's coordinator runs
this loop over its own engine. Rank 0 starts the frontends and tells them, in
HELLO, the other replicas' endpoints (rtp/server/replica_sockets.py: an abstract
Unix socket on rank 0's node, TCP with a secret on another node); each frontend
connects to every replica and routes each request to one of them
(rtp/server/router.py). Another replica's loop accepts the frontends'
connections instead of starting them, and otherwise runs, stops and fails in
the same way: its FAIL reaches every frontend, which fails its clients and
exits 1, and rank 0 then exits 1 too.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from rtp.distributed.heartbeat import interval_for
from rtp.distributed.liveness import exit_deadline, stop_signals
from rtp.errors import RequestError, WorkerDiedError
from rtp.log import get_logger
from rtp.outputs import RequestOutput
from rtp.server.activity import ActivityLog
from rtp.server.frontend_procs import FrontendLink, spawn_frontends
from rtp.server.frontend_procs import metrics_dir as new_metrics_dir
from rtp.server.frontend_wire import EngineRequest, Kind, decode_abort, encode_hello, frame
from rtp.server.replica_sockets import Endpoint, Listener
from rtp.structured import GrammarCompiler

if TYPE_CHECKING:
    from rtp.runtime.coordinator import Runtime

logger = get_logger(__name__)

_READY_TIMEOUT_S = 300.0  # a frontend imports torch and transformers and loads the tokenizer
_STATS_EVERY_S = 0.5  # frontends without outputs still get the engine's stats this often (their /metrics)
_FAIL_WAIT_S = 3.0  # after a failure, frontends get this long to answer their clients and exit
_CANCEL_MARGIN_S = 5.0
_STOP_MARGIN_S = 30.0  # beyond the waits a stop is allowed: then the process exits 1 with its stacks logged


class EngineLoop:
    """Serve ``runtime`` (rank 0) to ``count`` frontends accepting on ``listen``."""

    def __init__(self, runtime: Runtime, listen: socket.socket | None, count: int, url: str, access_log: bool,
                 replicas: list[Endpoint] | None = None, accept_on: Listener | None = None) -> None:
        """``replicas``: (rank 0) the other replicas' endpoints, for the frontends' HELLO;
        ``accept_on``: (another replica) the socket the frontends connect to."""
        self.runtime, self.engine = runtime, runtime.engine
        self.replicas, self.accept_on = replicas or [], accept_on
        self.listen, self.count, self.url, self.access_log = listen, count, url, access_log
        self.grace_s = runtime.config.server.shutdown_grace_s
        self.links: list[FrontendLink] = []
        self.owners: dict[str, tuple[FrontendLink, int]] = {}  # engine request id -> (frontend, handle)
        self.exit_code = 0
        self.failure: str | None = None
        self.stopping = False
        self._signals = 0
        self._signals_in: list[int] = []  # noted by the signal handler, taken by the loop
        self._node_stop: int | None = None  # another node whose ranks got SIGTERM (the watchdog tells)
        self._stop_bound = contextlib.ExitStack()  # from a stop's start: its exit deadline
        self._stop_deadline = float("inf")
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._grammar_pool: ThreadPoolExecutor | None = None
        self._grammar: GrammarCompiler | None = None
        self._compiling: dict[str, bool] = {}  # request id -> still wanted (False once aborted)
        self._late_errors: list[tuple[FrontendLink, int, str]] = []  # from the grammar thread
        self._last_stats = 0.0
        self.activity = ActivityLog(runtime.config.server.log_stats_interval_s, time.monotonic())

    # ---- the run ----

    def run(self) -> int:
        """Start the frontends, serve until a stop or a failure; returns the exit code."""
        engine = self.engine
        engine.text_outputs = False
        info = self.runtime.model_info
        runner = engine.runner
        cfg = self.runtime.config
        hello: dict[str, Any] = {
            "server": _server_dict(cfg), "model_dir": str(engine.model_dir), "vocab_size": info.vocab_size,
            "max_model_len": info.max_model_len, "name": info.name, "sampling_defaults": info.sampling_defaults,
            "access_log": self.access_log,
            "log_level": cfg.log_level, "beat_interval_s": interval_for(cfg.liveness.timeout_s),
            "limits": {"block_size": runner.block_size, "num_blocks": runner.num_blocks,
                       "max_num_seqs": cfg.scheduler.max_num_seqs,
                       "max_num_batched_tokens": runner.max_num_batched_tokens,
                       "enable_prefix_caching": int(cfg.cache.enable_prefix_caching)},
        }
        # Several frontends sum their metrics through files; one keeps them in memory (rtp/server/metrics.py).
        metrics_dir = new_metrics_dir() if self.accept_on is None and self.count > 1 else None
        self.runtime.on_failure.append(self._on_runtime_failure)
        for sig in stop_signals():
            signal.signal(sig, self._on_signal)
        if self.accept_on is None:  # rank 0 (another replica's coordinator stops on its own node's signal)
            self.runtime.transport.watchdog.on_stop_request = self._stop_for_node
        try:
            if self.accept_on is not None:
                self._accept_frontends(hello)
            else:
                assert self.listen is not None
                hello["replicas"] = [e.to_json() for e in self.replicas]
                self.links = spawn_frontends(self.count, self.listen, hello, metrics_dir, cfg.liveness.timeout_s)
                # The frontends hold the listening socket now. Rank 0's copy would keep it listening after they
                # closed theirs at a stop: new clients would wait in its backlog, unanswered, until rank 0 exits.
                self.listen.close()
            if self.exit_code == 0 and self._wait_ready():
                if self.accept_on is None:
                    logger.info("serving on %s (%d API frontend process(es): pid %s)", self.url, self.count,
                                ", ".join(str(link.pid) for link in self.links))
                else:
                    logger.info("replica %d serving %d API frontend process(es)", self.runtime.dp_rank, self.count)
                self._serve()
            return self.exit_code
        finally:
            self._end_frontends()
            if self._grammar_pool is not None:
                self._grammar_pool.shutdown(wait=False, cancel_futures=True)
            if metrics_dir is not None:
                shutil.rmtree(metrics_dir, ignore_errors=True)
            self._wake_r.close()
            self._wake_w.close()
            self._stop_bound.close()

    def _accept_frontends(self, hello: dict[str, Any]) -> None:
        """Another replica: accept the ``count`` frontends' connections (rank 0 started them), HELLO to each."""
        assert self.accept_on is not None
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while len(self.links) < self.count:
            self._take_signals()
            if self.stopping or self.failure is not None:
                return
            if time.monotonic() > deadline:
                logger.error("the API frontends did not connect to replica %d within %.0f s", self.runtime.dp_rank,
                             _READY_TIMEOUT_S)
                self.exit_code = 1
                return
            accepted = self.accept_on.accept(0.2)
            if accepted is None:
                continue
            conn, pid = accepted  # pid None: a frontend on another node, watched through its connection only
            link = FrontendLink(len(self.links), None, conn, self.runtime.config.liveness.timeout_s, pid=pid)
            self.links.append(link)
            ps = self.runtime.transport.ps
            link.send(encode_hello({**hello, "index": link.index, "rank": ps.global_rank, "pid": os.getpid(),
                                    "host": socket.gethostname() if ps.node_rank != 0 else None}))
        self.accept_on.close()  # every frontend is in: nobody else may connect

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while not all(link.ready for link in self.links):
            if self.stopping or self.failure is not None:
                return False
            if time.monotonic() > deadline:
                logger.error("the API frontends did not start within %.0f s", _READY_TIMEOUT_S)
                self.exit_code = 1
                return False
            self._poll(0.2)
            self._check_procs()
        return True

    def _serve(self) -> None:
        engine = self.engine
        busy = False
        while True:
            self._poll(0.0 if busy else 0.5)
            self._check_procs()
            if self.activity.due(now := time.monotonic()):
                self.activity.log(engine.stats(), now)
            if self.failure is not None:
                self.exit_code = 1
                return
            if self.stopping and (all(link.closed for link in self.links) or time.monotonic() > self._stop_deadline):
                logger.info("the API frontends stopped")
                return
            busy = engine.has_unfinished()
            if busy:
                try:
                    outputs = self.runtime.step()
                except WorkerDiedError as e:  # the watchdog's hook has failed the frontends
                    self._on_runtime_failure(str(e))
                    self.exit_code = 1
                    return
                except Exception as e:  # noqa: BLE001 - every client must hear of it
                    logger.exception("the engine step failed")
                    self._on_runtime_failure(f"the engine failed ({type(e).__name__}; see the server log)")
                    self.exit_code = 1
                    return
                self._dispatch(outputs)
                if not engine.has_unfinished():
                    self._send_stats(force=True)  # idle: the gauges go back to 0 at once

    # ---- frames in ----

    def _poll(self, timeout: float) -> None:
        socks: list[socket.socket] = [link.sock for link in self.links if not link.closed]
        readable, _, _ = select.select([self._wake_r, *socks], [], [], timeout)
        if self._wake_r in readable:
            try:
                self._wake_r.recv(4096)
            except BlockingIOError:
                pass
        with_errors, self._late_errors = self._late_errors, []
        for link, handle, message in with_errors:
            link.pending.errors[handle] = message
        for link in self.links:
            if link.closed or link.sock not in readable:
                continue
            frames = link.recv_frames()
            if frames is None:
                self._lost(link, "closed its connection")
                continue
            for kind, payload in frames:
                if kind == Kind.ADD:
                    self._add(link, EngineRequest.decode(payload))
                elif kind == Kind.ABORT:
                    for handle in decode_abort(payload):
                        self._abort(link, handle)
                elif kind == Kind.READY:
                    link.ready = True
                elif kind == Kind.SHUTDOWN and self.accept_on is not None and not self.stopping:
                    # Another replica: rank 0 stopped the server gracefully (this replica got no signal if it is
                    # on another node). Rank 0 stops only on its own signals: a frontend that goes is lost.
                    logger.info("API frontend %d stopped with the server: stopping", link.index)
                    self._begin_stop()
        if any(link.pending.errors for link in self.links):  # refused now: answer without waiting for a step
            self._flush_errors()
        self._take_signals()

    def _add(self, link: FrontendLink, req: EngineRequest) -> None:
        link.live[req.handle] = req.request_id
        self.owners[req.request_id] = (link, req.handle)
        if req.grammar is not None:
            self._compiling[req.request_id] = True
            self._grammar_threads().submit(self._compile_and_add, link, req)
            return
        try:
            self.engine.add_request(req.prompt_token_ids, req.params, req.request_id)
        except RequestError as e:  # the frontend checked the same; a race with the cache, say
            self._refuse(link, req.handle, str(e))

    def _refuse(self, link: FrontendLink, handle: int, message: str) -> None:
        rid = link.live.pop(handle, None)
        if rid is not None:
            self.owners.pop(rid, None)
        link.pending.errors[handle] = message

    def _grammar_threads(self) -> ThreadPoolExecutor:
        if self._grammar_pool is None:
            self._grammar_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rtp-grammar")
        return self._grammar_pool

    def _compile_and_add(self, link: FrontendLink, req: EngineRequest) -> None:
        """On the grammar thread: the request's matcher factory, then the request into the engine."""
        info = self.runtime.model_info
        try:
            if self._grammar is None:
                self._grammar = GrammarCompiler(info.tokenizer, info.vocab_size, list(info.eos_token_ids))
            spec = req.grammar
            assert spec is not None
            req.params.constraint = self._grammar.constraint_factory(self._grammar.compile(spec), spec)
            if self._compiling.pop(req.request_id, False):
                self.engine.add_request(req.prompt_token_ids, req.params, req.request_id)
        except Exception as e:  # noqa: BLE001 - the client gets the message
            self._compiling.pop(req.request_id, None)
            self._late_errors.append((link, req.handle, str(e)))
        self._wake()

    def _abort(self, link: FrontendLink, handle: int) -> None:
        rid = link.live.pop(handle, None)
        if rid is None:
            return
        self.owners.pop(rid, None)
        link.prompt_logprobs_sent.discard(handle)
        if rid in self._compiling:
            self._compiling[rid] = False
        self.engine.abort(rid)

    # ---- frames out ----

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """One OUTPUTS frame per frontend with changed requests, from this step's outputs."""
        self.activity.count(outputs)
        owners = self.owners
        for out in outputs:
            owner = owners.get(out.request_id)
            if owner is None:
                continue  # aborted by its frontend, or its frontend is gone
            link, handle = owner
            msg = link.pending
            if out.finished and out.error is not None:
                msg.errors[handle] = out.error
            elif out.samples is None:
                new = out.new_token_ids
                lps = None if out.logprobs is None else out.logprobs[len(out.logprobs) - len(new):]
                msg.add(handle, 0, new, out.finish_reason, out.num_cached_tokens, lps)
            else:
                for c in out.samples:
                    if c.new_token_ids or c.finished:
                        new = c.new_token_ids
                        lps = None if c.logprobs is None else c.logprobs[len(c.logprobs) - len(new):]
                        msg.add(handle, c.index, new, c.finish_reason, out.num_cached_tokens, lps)
            if out.prompt_logprobs is not None and out.token_ids and handle not in link.prompt_logprobs_sent:
                link.prompt_logprobs_sent.add(handle)
                msg.prompt_logprobs[handle] = out.prompt_logprobs
            if out.finished:
                del owners[out.request_id]
                link.live.pop(handle, None)
                link.prompt_logprobs_sent.discard(handle)
        self._send_stats(force=False)

    def _send_stats(self, force: bool) -> None:
        """Send the pending frames; the frontends without any get the stats alone now and then."""
        now = time.monotonic()
        everyone = force or now - self._last_stats > _STATS_EVERY_S
        if everyone:
            self._last_stats = now
        stats = self.engine.stats()
        for link in self.links:
            if not link.closed and (len(link.pending) or everyone) and not link.flush(stats):
                self._lost(link, "stopped reading its connection")

    def _flush_errors(self) -> None:
        stats = self.engine.stats()
        for link in self.links:
            if not link.closed and len(link.pending) and not link.flush(stats):
                self._lost(link, "stopped reading its connection")

    # ---- failures and stops ----

    def _check_procs(self) -> None:
        now, timeout = time.monotonic(), self.runtime.config.liveness.timeout_s
        for link in self.links:
            if not link.closed and (code := link.returncode()) is not None:
                self._lost(link, f"exited with code {code}")
            elif not link.closed and link.ready and now - link.last_heard > timeout:
                self._lost(link, f"sent nothing for {now - link.last_heard:.0f} s (hung: killed)")
                link.kill()

    def _lost(self, link: FrontendLink, why: str) -> None:
        """A frontend is gone: its requests are aborted in the engine; unless stopping anyway, stop the server."""
        if link.closed:
            return
        link.close()
        try:  # a broken socket usually means the process died: say how
            why = f"exited with code {link.wait(0.5)}"
        except TimeoutError:  # still running
            pass
        for rid in link.live.values():
            self.owners.pop(rid, None)
            if rid in self._compiling:
                self._compiling[rid] = False
            self.engine.abort(rid)
        n, link.live = len(link.live), {}
        if self.stopping or self.failure is not None:
            return
        logger.error("API frontend %d (pid %d) %s: its %d request(s) were aborted; stopping the server",
                     link.index, link.pid, why, n)
        self.exit_code = 1
        self._begin_stop(fail=f"API frontend {link.index} of the server died; the server is stopping")

    def _begin_stop(self, fail: str | None = None) -> None:
        if self.stopping:
            return
        self.stopping = True
        wait = _FAIL_WAIT_S if fail else self.grace_s + _CANCEL_MARGIN_S
        self._stop_deadline = time.monotonic() + wait
        # The loop waits ``wait``, then the frontends get as long again to exit before they are killed.
        self._stop_bound.enter_context(exit_deadline(2 * wait + _STOP_MARGIN_S, "the server's stop"))
        data = frame(Kind.FAIL, fail.encode()) if fail else frame(Kind.SHUTDOWN)
        for link in self.links:
            link.send(data)

    def _on_runtime_failure(self, message: str) -> None:
        """A rank was lost (the watchdog's thread, or the loop): every frontend fails its clients."""
        if self.failure is not None:
            return
        self.failure = message
        data = frame(Kind.FAIL, message.encode())
        for link in self.links:
            link.send(data)
        self._wake()

    def _on_signal(self, signum: int, frame_: Any) -> None:  # noqa: ANN401
        # Runs on the main thread between two bytecodes, possibly inside ``link.send`` holding the
        # link's lock: sending SHUTDOWN from here deadlocked the server. Only note it; the loop acts.
        self._signals_in.append(signum)
        self._wake()

    def _stop_for_node(self, node: int) -> None:
        """Another node's ranks got SIGTERM (the watchdog's thread): stop as for a first SIGTERM here, without
        counting it as one (this node's own SIGTERM may follow: it must not cut the drain short)."""
        self._node_stop = node
        self._wake()

    def _take_signals(self) -> None:
        """Act on the signals the handler noted: the first stops gracefully, a second at once. A signal that
        finds a rank already gone (torchrun stops the other ranks when one dies) is that rank's loss: the
        frontends get FAIL naming it (through the runtime's failure hook), not a graceful SHUTDOWN."""
        if self._node_stop is not None and not self.stopping and self.failure is None:
            logger.warning("node %d's ranks got SIGTERM: running requests have %.0f s to finish", self._node_stop,
                           self.grace_s)
            self._begin_stop()
        while self._signals_in:
            signum = self._signals_in.pop(0)
            self._signals += 1
            if self.failure is None and self.runtime.report_lost_peer():
                logger.info("%s after a rank was lost: failing the requests, not draining them",
                            signal.Signals(signum).name)
                continue
            if self._signals > 1:
                logger.info("%s again: stopping now", signal.Signals(signum).name)
                self._stop_deadline = 0.0
            else:
                logger.info("received %s: running requests have %.0f s to finish", signal.Signals(signum).name,
                            self.grace_s)
            self._begin_stop()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def _end_frontends(self) -> None:
        """Every frontend gone: a few seconds to exit on their own, then killed; the zombies reaped."""
        wait = _FAIL_WAIT_S if self.failure is not None or self.exit_code else self.grace_s + _CANCEL_MARGIN_S
        deadline = time.monotonic() + (0.0 if self._stop_deadline == 0.0 else wait)
        for link in self.links:
            if not link.closed:
                link.send(frame(Kind.SHUTDOWN))
        for link in self.links:
            try:
                link.wait(max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                link.kill()
                if link.proc is not None:
                    link.proc.wait()
            link.close()


def _server_dict(cfg: Any) -> dict[str, Any]:  # noqa: ANN401 - RtpConfig
    import dataclasses

    return dataclasses.asdict(cfg.server)
