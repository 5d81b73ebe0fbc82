"""Shared-memory segments that every rank of a node maps once and that nothing can leak.

The CPU all-reduce and the heartbeat region both need memory that all ranks
of a node map for the whole run. Rank 0 creates a segment under a fresh name,
tells the others the name over the control group, every rank maps it, and
rank 0 unlinks the name as soon as all have: the mappings live on until the
processes exit, so a crash at any later point leaves nothing in /dev/shm.
(A crash in the short window before the unlink leaves a ``rtp_<pid>_`` name,
which :func:`rtp.distributed.shm_channel.cleanup_stale_segments` reaps.)
"""

from __future__ import annotations

import _posixshmem
import mmap

from rtp.distributed.shm_channel import make_channel_name, map_segment
from rtp.errors import RtpError


def share_segment(ps, size: int, what: str) -> mmap.mmap:  # noqa: ANN001 - a ParallelState (import cycle)
    """Collective over ``ps.cpu_group``: a zero-filled segment of ``size`` bytes mapped on every rank.

    The name is unlinked before this returns on any rank. ``what`` names the
    segment in errors ("CPU all-reduce", "heartbeat region").
    """
    name = None
    if ps.rank == 0:
        name = make_channel_name()
        try:
            mm = map_segment(name, size, create=True, what=f"the {what}")
        except BaseException:
            ps.broadcast_object("")  # the other ranks wait for the name: tell them to give up
            raise
    name = ps.broadcast_object(name)
    if not name:
        raise RtpError(f"rank 0 could not create the {what} segment")
    if ps.rank != 0:
        mm = map_segment(name, size, create=False, what=f"the {what}")
    try:
        ps.barrier()  # every rank has mapped it
    finally:
        if ps.rank == 0:
            try:
                _posixshmem.shm_unlink("/" + name)
            except FileNotFoundError:
                pass
    return mm
