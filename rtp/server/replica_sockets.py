"""Data-parallel serving: the Unix sockets the API frontends reach the other replicas' engines on.

Every replica's coordinator but rank 0 listens on an abstract Unix socket with
an address the kernel picks (autobind: unique, never a file, gone with the
process); the coordinators exchange the addresses over their gloo group, and
rank 0 passes them to the frontends in HELLO. The frames on these sockets are
those of rtp/server/frontend_wire.py, exactly as on rank 0's own socket pairs.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING

import torch.distributed as dist

from rtp.server.frontend_procs import SOCK_BUF_BYTES

if TYPE_CHECKING:
    from rtp.runtime.coordinator import Runtime


def exchange(runtime: Runtime, backlog: int) -> tuple[socket.socket | None, list[str]]:
    """Collective over the coordinators: this replica's listening socket (None on rank 0) and every other
    replica's address, as hex, by replica index 1.. (rank 0's frontends connect to them in that order)."""
    ps = runtime.transport.ps
    listen: socket.socket | None = None
    address = ""
    if ps.dp_rank > 0:
        listen = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listen.bind("")  # Linux autobind: a fresh abstract address
        listen.listen(backlog)
        address = bytes(listen.getsockname()).hex()
    names: list[str | None] = [None] * ps.dp_size
    dist.all_gather_object(names, address, group=ps.dp_group)
    return listen, [str(n) for n in names[1:]]


def connect(address: str) -> socket.socket:
    """A frontend's connection to a replica's engine (the address from HELLO)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCK_BUF_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCK_BUF_BYTES)
    sock.connect(bytes.fromhex(address))
    return sock
