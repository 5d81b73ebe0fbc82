"""Shared-memory segments that every rank of a node maps once and that nothing can leak.

The CPU all-reduce and the heartbeat region both need memory that all ranks
of a node map for the whole run. The node's leader (rank 0 on a single node)
creates a segment under a fresh name, tells the node's other ranks the name
over the control group, every rank maps it, and the leader unlinks the name
as soon as all have: the mappings live on until the processes exit, so a
crash at any later point leaves nothing in /dev/shm.
(A crash in the short window before the unlink leaves a ``rtp_<pid>_`` name,
which :func:`rtp.distributed.shm_segment.cleanup_stale_segments` reaps.)
"""

from __future__ import annotations

import _posixshmem
import mmap

from rtp.distributed.shm_segment import make_segment_name, map_segment
from rtp.errors import RtpError


def share_segment(ps, size: int, what: str) -> mmap.mmap:  # noqa: ANN001 - a ParallelState (import cycle)
    """Collective over this node's ranks: a zero-filled segment of ``size`` bytes mapped on each of them.

    The name is unlinked before this returns on any rank. ``what`` names the
    segment in errors ("CPU all-reduce", "heartbeat region"). Each node has a
    segment of its own: nodes share no /dev/shm.
    """
    name = None
    creator = ps.rank == ps.node_leader
    if creator:
        name = make_segment_name()
        try:
            mm = map_segment(name, size, create=True, what=f"the {what}")
        except BaseException:
            ps.node_broadcast_object("")  # the other ranks wait for the name: tell them to give up
            raise
    name = ps.node_broadcast_object(name)
    if not name:
        raise RtpError(f"rank {ps.node_leader} could not create the {what} segment")
    if not creator:
        mm = map_segment(name, size, create=False, what=f"the {what}")
    try:
        ps.node_barrier()  # every rank of the node has mapped it
    finally:
        if creator:
            try:
                _posixshmem.shm_unlink("/" + name)
            except FileNotFoundError:
                pass
    return mm
