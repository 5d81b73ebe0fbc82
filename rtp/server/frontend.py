"""One API frontend process: the HTTP app on the server's shared socket, in front of rank 0's engine.

Started by rank 0 (rtp/server/frontend_procs.py) as
``python -m rtp.server.frontend --index I --listen-fd L --engine-fd E``: it
reads HELLO from the engine socket, loads the tokenizer, builds the same
FastAPI app as the single-process server around an
:class:`~rtp.server.engine_client.EngineClient`, and serves with uvicorn on
the inherited listening socket until SIGTERM/SIGINT or SHUTDOWN (a graceful
stop with the same bounded drain), FAIL or EOF from the engine (exit 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import socket
import sys
from pathlib import Path

import uvicorn

from rtp.config import RtpConfig, ServerConfig
from rtp.distributed.liveness import set_parent_death_signal
from rtp.heap import freeze_startup_heap
from rtp.log import get_logger, setup_logging
from rtp.runtime.model_info import ModelInfo
from rtp.server import replica_sockets
from rtp.server.api import build_app
from rtp.server.engine_client import EngineClient
from rtp.server.frontend_wire import FrameReader, Kind, decode_hello
from rtp.server.router import PrefixRouter, RoundRobinRouter
from rtp.server.runner import _CANCEL_MARGIN_S, GracefulServer, route_uvicorn_logs, stop_uvicorn_on_signals

logger = get_logger("rtp.server.frontend")  # run as __main__: a name in rtp's logger tree


def _read_hello(sock: socket.socket) -> dict:
    reader = FrameReader()
    while True:
        data = sock.recv(1 << 16)
        if not data:
            raise SystemExit(1)  # the engine went away before the start
        for kind, payload in reader.feed(data):
            if kind == Kind.HELLO:
                return decode_hello(payload)


class _FrontendServer(GracefulServer):
    """The graceful uvicorn server that tells the engine once it accepts connections."""

    def __init__(self, config: uvicorn.Config, client: EngineClient, grace_s: float) -> None:
        super().__init__(config, client, None, grace_s)
        self.client = client

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self.client.send_ready()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="an rtp API frontend process (started by rank 0)")
    ap.add_argument("--index", type=int, required=True)
    ap.add_argument("--listen-fd", type=int, required=True)
    ap.add_argument("--engine-fd", type=int, required=True)
    args = ap.parse_args(argv)
    # Never outlive rank 0, even if it is SIGKILLed before it could close the socket.
    set_parent_death_signal(signal.SIGTERM)
    engine_sock = socket.socket(fileno=args.engine_fd)
    listen = socket.socket(fileno=args.listen_fd)
    hello = _read_hello(engine_sock)
    setup_logging(0, hello["log_level"], label=f"api{args.index}")
    import torch  # imported by the tokenizer's helpers anyway; one thread: the engine's ranks need the cores

    torch.set_num_threads(1)
    server_cfg = ServerConfig(**hello["server"])
    info = dataclasses.replace(ModelInfo.load(Path(hello["model_dir"]), hello["vocab_size"], hello["max_model_len"],
                                              name=hello["name"]), sampling_defaults=hello["sampling_defaults"])
    # Data parallelism: one more engine per other replica, each with its own HELLO (its cache size).
    replicas = [replica_sockets.connect(replica_sockets.Endpoint.from_json(e)) for e in hello.get("replicas", [])]
    limits = dict(hello["limits"])
    who: list[str] = []  # each replica's engine, for the message when its socket closes
    for i, sock in enumerate(replicas, start=1):
        replica_hello = _read_hello(sock)
        host = f" on host {replica_hello['host']}" if replica_hello.get("host") else ""  # another node
        who.append(f"rank {replica_hello['rank']} (pid {replica_hello['pid']}{host}), "
                   f"data-parallel replica {i}'s engine,")
        for key, value in replica_hello["limits"].items():
            limits[key] = min(limits[key], value)
    router = None
    if replicas:
        num = len(replicas) + 1
        router = (RoundRobinRouter(num) if server_cfg.data_parallel_routing == "round_robin"
                  else PrefixRouter(num, limits["block_size"], limits["num_blocks"]))
    client = EngineClient(engine_sock, info, limits, replicas, router, names=who,
                          beat_interval_s=hello["beat_interval_s"])
    app = build_app(client, RtpConfig(server=server_cfg), info)
    route_uvicorn_logs()
    uv_config = uvicorn.Config(app, log_config=None, access_log=bool(hello["access_log"]), lifespan="on",
                               timeout_graceful_shutdown=int(server_cfg.shutdown_grace_s + _CANCEL_MARGIN_S))
    server = _FrontendServer(uv_config, client, server_cfg.shutdown_grace_s)
    exit_code = 0

    def engine_dead(message: str) -> None:
        nonlocal exit_code
        exit_code = 1
        logger.error("stopping: %s", message)
        server.should_exit = True

    def shutdown() -> None:
        server.should_exit = True

    client.on_dead.append(engine_dead)
    client.on_shutdown.append(shutdown)
    stop_uvicorn_on_signals(server)  # a graceful stop exits 0, as in the single-process server
    freeze_startup_heap(f"API frontend {args.index}")
    try:
        server.run(sockets=[listen])
        if exit_code == 0 and client.told_to_stop:
            client.say_goodbye()
    finally:
        listen.close()
        engine_sock.close()
        for sock in replicas:
            sock.close()
    return exit_code


if __name__ == "__main__":
    code = main()
    # Nothing is left to release (the engine owns every segment; the metrics files are the run's),
    # and tearing down torch and the tokenizer takes seconds that a stopping server waits for.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
