"""The sockets the API frontends reach other replicas' engines on: Unix on rank 0's node, TCP with a secret elsewhere.

The TCP listener must refuse a connection that does not open with its
secret (a wrong one, a short one, or none within the timeout), log it, and
keep accepting; a frontend's own connect() gets through, and a frontend on
another node (no pid) is known to be gone once its connection ends.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import pytest

from rtp.server import replica_sockets
from rtp.server.frontend_procs import FrontendLink
from rtp.server.replica_sockets import SECRET_BYTES, Endpoint, Listener, advertised_host, connect


def test_unix_listener_hands_out_the_peer_pid():
    listener = Listener(backlog=2)
    try:
        assert listener.endpoint.family == "unix" and listener.secret is None
        client = connect(Endpoint.from_json(listener.endpoint.to_json()))  # as it travels in HELLO
        accepted = listener.accept(5.0)
        assert accepted is not None
        conn, pid = accepted
        assert pid == os.getpid()
        client.sendall(b"ping")
        assert conn.recv(4) == b"ping"
        client.close()
        conn.close()
    finally:
        listener.close()


def test_tcp_listener_refuses_connections_without_the_secret(caplog, monkeypatch):
    monkeypatch.setattr(replica_sockets, "AUTH_TIMEOUT_S", 0.5)
    listener = Listener(backlog=4, master_addr="127.0.0.1")
    try:
        endpoint = Endpoint.from_json(listener.endpoint.to_json())
        host, port = endpoint.address.rsplit(":", 1)
        assert endpoint.family == "tcp" and host == "127.0.0.1" and len(bytes.fromhex(endpoint.secret)) == SECRET_BYTES
        wrong = bytes(b ^ 1 for b in bytes.fromhex(endpoint.secret))
        for opening in (wrong, wrong[:SECRET_BYTES // 2], b""):  # a wrong secret, half of one, nothing at all
            stranger = socket.create_connection((host, int(port)), timeout=5)
            stranger.sendall(opening)
            if opening:
                stranger.shutdown(socket.SHUT_WR)  # the short one ends early; the empty one just waits
            with caplog.at_level(logging.WARNING, logger="rtp.server.replica_sockets"):
                assert listener.accept(5.0) is None
            assert stranger.recv(16) == b""  # closed on it
            stranger.close()
        refusals = [r for r in caplog.records if "did not open with this replica's secret" in r.getMessage()]
        assert len(refusals) == 3, caplog.text
        # The frontend's own connection, after the strangers: accepted, no pid (another host's), data flows.
        frontend = connect(endpoint)
        accepted = listener.accept(5.0)
        assert accepted is not None
        conn, pid = accepted
        assert pid is None
        frontend.sendall(b"ADD")
        assert conn.recv(3) == b"ADD"
        # A frontend on another node is watched through its connection: gone once it ends.
        link = FrontendLink(0, None, conn, send_timeout_s=5.0, pid=None)
        assert link.returncode() is None
        with pytest.raises(TimeoutError):
            link.wait(0.2)
        threading.Timer(0.2, frontend.close).start()
        t0 = time.monotonic()
        assert link.wait(5.0) == -1 and time.monotonic() - t0 < 3.0
        link.close()
    finally:
        listener.close()


def test_advertised_host_is_the_source_address_towards_the_master():
    assert advertised_host("127.0.0.1") == "127.0.0.1"
    assert advertised_host("localhost") in ("127.0.0.1", "::1")
