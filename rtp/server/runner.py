"""Run the HTTP server on rank 0 with uvicorn, with a bounded graceful shutdown.

SIGTERM or SIGINT: uvicorn stops accepting connections and waits for the
running requests; after ``server.shutdown_grace_s`` the ones still running
are ended with an error (a 503 body, or an error event in a stream) and
aborted in the engine. Then the engine thread stops, and only then may the
caller run ``rtp.shutdown()``: the engine thread is the single writer of the
step channel, so it must be gone before the shutdown message is written.

With ``server.api_processes`` >= 1 uvicorn runs in the frontend processes
instead and rank 0 runs :class:`rtp.server.engine_loop.EngineLoop`; the same
socket serves, the same exits hold.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import uvicorn

from rtp.distributed.liveness import stop_signals
from rtp.errors import ConfigError, RtpError
from rtp.heap import freeze_startup_heap
from rtp.log import RtpLogHandler, get_logger
from rtp.server.api import build_app
from rtp.server.async_engine import AsyncEngine, ServingEngine
from rtp.server.frontend_procs import default_api_processes

if TYPE_CHECKING:
    from rtp.runtime.coordinator import Runtime

logger = get_logger(__name__)

# Extra seconds uvicorn waits after the grace period before it cancels request tasks
# outright; by then every stream was already ended cleanly by AsyncEngine.abort_all.
_CANCEL_MARGIN_S = 3.0


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); port 0 lets the OS pick a free port."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise RtpError(f"cannot listen on {host}:{port}: {e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
        sock.set_inheritable(False)
    except OSError as e:
        sock.close()
        raise RtpError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def socket_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class GracefulServer(uvicorn.Server):
    """uvicorn's server, plus the "serving on" line (when ``url`` is given) and the bounded drain of
    running requests.

    ``lost_peer`` (rank 0's server: :meth:`Runtime.report_lost_peer`) is asked first when the server stops:
    torchrun sends SIGTERM to the other ranks when one dies, and a stop that finds a rank already gone is
    that rank's loss (the runtime's failure hooks give every request an error naming it, the exit code is
    1), not a graceful drain.
    """

    def __init__(self, config: uvicorn.Config, engine: ServingEngine, url: str | None, grace_s: float,
                 lost_peer: Callable[[], bool] | None = None) -> None:
        super().__init__(config)
        self.engine, self.url, self.grace_s, self.lost_peer = engine, url, grace_s, lost_peer

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.url is not None:
            logger.info("serving on %s", self.url)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.lost_peer is not None and self.lost_peer():
            logger.error("stopping after a rank was lost: the running requests failed, none drains")
        else:
            logger.info("stopping: running requests have %.0f s to finish", self.grace_s)
        timer = asyncio.get_running_loop().call_later(self.grace_s, self._abort_running)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _abort_running(self) -> None:
        n = self.engine.abort_all()
        if n:
            logger.warning("aborted %d request(s) still running after the %.0f s grace period", n, self.grace_s)


def route_uvicorn_logs() -> None:
    """Send uvicorn's log lines through rtp's handler (same format, rank prefix)."""
    handlers = [h for h in logging.getLogger("rtp").handlers if isinstance(h, RtpLogHandler)]
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        log = logging.getLogger(name)
        log.handlers = list(handlers) if name == "uvicorn" else []
        log.propagate = name != "uvicorn"
        log.setLevel(logging.INFO)


def _run_replica_server(runtime: Runtime, sock: socket.socket | None, frontends: int, access_log: bool) -> int:
    """Data parallelism: every replica's coordinator serves its engine to the frontends rank 0 starts."""
    from rtp.server import replica_sockets
    from rtp.server.engine_loop import EngineLoop

    if frontends < 1:
        raise ConfigError("data_parallel_size > 1 needs API frontend processes: server.api_processes >= 1 "
                          "(--api-server-count), not 0")
    runtime.replicas = None  # the offline batch protocol is not used: each replica stops on its own
    listen, endpoints = replica_sockets.exchange(runtime, frontends)
    if runtime.dp_rank > 0:
        assert listen is not None
        try:
            return EngineLoop(runtime, None, frontends, "", access_log, accept_on=listen).run()
        finally:
            listen.close()
    server_cfg = runtime.config.server
    sock = sock if sock is not None else bind_socket(server_cfg.host, server_cfg.port)
    logger.info("model %r (max_model_len=%d), %d data-parallel replicas, API key %s", runtime.model_info.name,
                runtime.model_info.max_model_len, runtime.dp_size, "required" if server_cfg.api_key else "not required")
    try:
        return EngineLoop(runtime, sock, frontends, socket_url(sock), access_log, replicas=endpoints).run()
    finally:
        sock.close()


def run_server(runtime: Runtime, sock: socket.socket | None = None, access_log: bool = False) -> int:
    """Serve ``runtime`` (rank 0's Runtime) until SIGTERM/SIGINT; returns the exit code (0 after a clean stop).

    ``sock`` is a listening socket from :func:`bind_socket`; None binds
    ``config.server.host``/``port`` now. The socket is closed on return.
    """
    config = runtime.config
    server_cfg = config.server
    info = runtime.model_info
    frontends = server_cfg.api_processes if server_cfg.api_processes is not None else default_api_processes()
    freeze_startup_heap("rank 0's server")  # the model, tokenizer and runtime: alive until the process ends
    if runtime.dp_size > 1:
        return _run_replica_server(runtime, sock, frontends, access_log)
    sock = sock if sock is not None else bind_socket(server_cfg.host, server_cfg.port)
    if frontends > 0:
        from rtp.server.engine_loop import EngineLoop

        logger.info("model %r (max_model_len=%d), API key %s", info.name, info.max_model_len,
                    "required" if server_cfg.api_key else "not required")
        try:
            return EngineLoop(runtime, sock, frontends, socket_url(sock), access_log).run()
        finally:
            sock.close()
    engine = AsyncEngine(runtime.engine, step=runtime.step, log_stats_interval_s=server_cfg.log_stats_interval_s)
    app = build_app(engine, config, info)
    route_uvicorn_logs()
    uv_config = uvicorn.Config(
        app, log_config=None, access_log=access_log, lifespan="on",
        timeout_graceful_shutdown=int(server_cfg.shutdown_grace_s + _CANCEL_MARGIN_S),
    )
    server = GracefulServer(uv_config, engine, socket_url(sock), server_cfg.shutdown_grace_s,
                            lost_peer=runtime.report_lost_peer)
    exit_code = 0

    def engine_died(message: str) -> None:
        nonlocal exit_code
        exit_code = 1
        server.should_exit = True  # a server without an engine only answers errors: stop it

    # A lost rank (the runtime's watchdog, any thread): first every open and queued request gets
    # its error, then the server stops and the process exits non-zero. The engine thread may be
    # idle or stuck in a collective, so this must not wait for it to notice.
    runtime.on_failure.append(engine.fail)
    runtime.on_failure.append(engine_died)
    engine.on_dead.append(engine_died)
    stop_uvicorn_on_signals(server)
    logger.info("model %r (max_model_len=%d), API key %s", info.name, info.max_model_len,
                "required" if server_cfg.api_key else "not required")
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        engine.stop()  # normally done by the app's lifespan already; not after a forced exit
    return exit_code


def stop_uvicorn_on_signals(server: uvicorn.Server) -> None:
    """uvicorn captures SIGTERM/SIGINT while it runs and re-raises them to the previous handlers once it
    stopped: make those inert, so that a graceful stop ends with exit code 0 instead of the runtime's
    SystemExit(128 + signum) (they stay replaced: the shutdown is under way by then). SIGHUP, which uvicorn
    does not capture, starts the same graceful stop (unless ignored: nohup)."""
    for sig in stop_signals():
        signal.signal(sig, server.handle_exit if sig == signal.SIGHUP else _ignore_late_signal)


def _ignore_late_signal(signum: int, frame: Any) -> None:  # noqa: ANN401
    logger.info("%s: already shutting down", signal.Signals(signum).name)
