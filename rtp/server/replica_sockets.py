"""Data-parallel serving: the sockets the API frontends reach the other replicas' engines on.

Every replica's coordinator but rank 0 listens, and the coordinators exchange
their :class:`Endpoint` over their gloo group; rank 0 passes them to the
frontends in HELLO. The frames on these sockets are those of
rtp/server/frontend_wire.py, exactly as on rank 0's own socket pairs.

Which socket, by the topology (never by trying what connects: the tests' two
simulated nodes share one network namespace, so either would work there):

* a replica on rank 0's node: an abstract Unix socket whose address the kernel
  picks (autobind: unique, never a file, gone with the process);
* a replica on another node: TCP, bound on every interface with a port the
  kernel picks, advertised at this host's address on the route to
  ``MASTER_ADDR`` (node 0's). A port is open to whoever reaches the host, so
  each such replica draws a random secret, sent with its address over the
  gloo group; a frontend opens every TCP connection with it, and a connection
  that does not within a few seconds is logged and closed. (The secret crosses
  the network in the clear, like gloo's own traffic: it keeps strangers out,
  not someone who can read the cluster's network.)
"""

from __future__ import annotations

import hmac
import os
import secrets
import socket
import struct
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from rtp.errors import RtpError
from rtp.log import get_logger
from rtp.server.frontend_procs import SOCK_BUF_BYTES

if TYPE_CHECKING:
    from rtp.runtime.coordinator import Runtime

logger = get_logger(__name__)

SECRET_BYTES = 32
AUTH_TIMEOUT_S = 5.0  # a TCP connection must send the secret within this long
_CONNECT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Endpoint:
    """Where a frontend reaches one replica's engine.

    ``family`` "unix": ``address`` is the abstract address, as hex. ``family``
    "tcp": ``address`` is "host:port" ("[v6]:port") and ``secret`` (hex) is
    what every connection must open with.
    """

    family: str
    address: str
    secret: str = ""

    def to_json(self) -> dict[str, str]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Endpoint:
        return cls(str(data["family"]), str(data["address"]), str(data.get("secret", "")))


def advertised_host(master_addr: str) -> str:
    """This host's address on the route to ``master_addr``: the local end of a UDP socket "connected" there
    (connecting a UDP socket sends nothing, the kernel only picks the route and the source address)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(master_addr, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(sockaddr)
        return str(probe.getsockname()[0])


def _buffers(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCK_BUF_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCK_BUF_BYTES)


class Listener:
    """A replica coordinator's listening socket: Unix (``master_addr`` None) or TCP with a secret.

    :meth:`accept` hands out only connections that passed the check, each with
    the frontend's pid where one can be known (the Unix peer's; None over TCP).
    """

    def __init__(self, backlog: int, master_addr: str | None = None) -> None:
        self.secret: bytes | None = None
        if master_addr is None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.bind("")  # Linux autobind: a fresh abstract address
            self.endpoint = Endpoint("unix", bytes(self.sock.getsockname()).hex())
        else:
            host = advertised_host(master_addr)
            v6 = ":" in host
            self.sock = socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_STREAM)
            _buffers(self.sock)  # before listen: accepted sockets inherit them, and the TCP window with them
            self.sock.bind(("::" if v6 else "0.0.0.0", 0))  # every interface, a port the kernel picks
            self.secret = secrets.token_bytes(SECRET_BYTES)
            port = self.sock.getsockname()[1]
            self.endpoint = Endpoint("tcp", f"[{host}]:{port}" if v6 else f"{host}:{port}", self.secret.hex())
        self.sock.listen(backlog)

    def accept(self, timeout: float) -> tuple[socket.socket, int | None] | None:
        """The next frontend's connection and its pid (None over TCP); None when none came within
        ``timeout`` s or the one that came was refused."""
        self.sock.settimeout(timeout)
        try:
            conn, peer = self.sock.accept()
        except TimeoutError:
            return None
        if self.secret is None:
            conn.setblocking(True)
            return conn, struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
        if not self._opens_with_secret(conn):
            logger.warning("refused a connection from %s:%s: it did not open with this replica's secret",
                           peer[0], peer[1])
            conn.close()
            return None
        conn.setblocking(True)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # one frame per step: no Nagle delay
        return conn, None

    def _opens_with_secret(self, conn: socket.socket) -> bool:
        assert self.secret is not None
        conn.settimeout(AUTH_TIMEOUT_S)
        got = b""
        try:
            while len(got) < SECRET_BYTES:
                chunk = conn.recv(SECRET_BYTES - len(got))
                if not chunk:
                    break
                got += chunk
        except OSError:  # the timeout too
            return False
        return hmac.compare_digest(got, self.secret)

    def close(self) -> None:
        self.sock.close()


def exchange(runtime: Runtime, backlog: int) -> tuple[Listener | None, list[Endpoint]]:
    """Collective over the coordinators: this replica's listener (None on rank 0) and every other
    replica's endpoint, by replica index 1.. (rank 0's frontends connect to them in that order)."""
    ps = runtime.transport.ps
    listener: Listener | None = None
    if ps.dp_rank > 0:
        master_addr = None
        if ps.node_rank != 0:  # another node than rank 0's (rank 0 leads node 0)
            master_addr = os.environ.get("MASTER_ADDR")
            if not master_addr:
                raise RtpError("a data-parallel replica on another node than rank 0's needs torchrun's MASTER_ADDR")
        listener = Listener(backlog, master_addr)
        logger.info("replica %d: the API frontends connect over %s", ps.dp_rank,
                    "TCP " + listener.endpoint.address if master_addr else "a Unix socket")
    mine = listener.endpoint.to_json() if listener is not None else None
    endpoints: list[dict[str, str] | None] = [None] * ps.dp_size
    dist.all_gather_object(endpoints, mine, group=ps.dp_group)
    return listener, [Endpoint.from_json(e) for e in endpoints[1:] if e is not None]


def connect(endpoint: Endpoint) -> socket.socket:
    """A frontend's connection to a replica's engine (the endpoint from HELLO), the secret sent first over TCP."""
    if endpoint.family == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        _buffers(sock)
        sock.connect(bytes.fromhex(endpoint.address))
        return sock
    host, port = endpoint.address.rsplit(":", 1)
    host = host.strip("[]")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    _buffers(sock)  # before connect: the TCP window is agreed then
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(_CONNECT_TIMEOUT_S)
    sock.connect((host, int(port)))
    sock.sendall(bytes.fromhex(endpoint.secret))
    sock.settimeout(None)
    return sock
