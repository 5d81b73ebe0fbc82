"""Named POSIX shared-memory segments of one run: fresh names, mapping, unlinking, reaping dead runs'.

The step channel (:mod:`rtp.distributed.shm_channel`), the CPU all-reduce and
the heartbeat region (both through :mod:`rtp.distributed.node_segment`) live
in such segments. A name is ``<prefix><pid>_<random hex>``: the creator's pid
in the name is what lets :func:`cleanup_stale_segments` tell a segment that a
killed run left from one a live process still uses.
"""

from __future__ import annotations

import _posixshmem  # the primitive multiprocessing.shared_memory itself is built on
import mmap
import os
import re
import secrets

from rtp.distributed.pids import pid_alive
from rtp.errors import RtpError
from rtp.log import get_logger

logger = get_logger(__name__)

SHM_DIR = "/dev/shm"


def make_segment_name(prefix: str = "rtp_") -> str:
    """A fresh segment name, ``<prefix><pid>_<random hex>``, unique per run."""
    _check_prefix(prefix)
    return f"{prefix}{os.getpid()}_{secrets.token_hex(6)}"


def _check_prefix(prefix: str) -> None:
    if not prefix or "/" in prefix or not prefix.isprintable():
        raise ValueError(f"segment name prefix must be a non-empty printable string without '/', got {prefix!r}")


def check_segment_name(name: object) -> str:
    """``name`` if it can name a segment (non-empty, no '/', at most 200 characters); else ValueError."""
    if not isinstance(name, str) or not name or "/" in name or len(name) > 200:
        raise ValueError(f"segment name must be a non-empty string without '/' (at most 200 chars), got {name!r}")
    return name


def map_segment(name: str, size: int, create: bool, what: str, remedy: str = "enlarge /dev/shm") -> mmap.mmap:
    """Map segment ``name`` of ``size`` bytes, creating it (exclusively, zero-filled) if ``create``.

    A segment this call created is unlinked again if mapping it fails (nobody
    else knows its name yet). ``what`` and ``remedy`` word the error of a full /dev/shm.
    """
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = _posixshmem.shm_open("/" + name, flags, mode=0o600)
    try:
        if create:
            os.ftruncate(fd, size)
            try:  # reserve the pages now: a full /dev/shm must fail here, not SIGBUS on a later write
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                raise RtpError(f"cannot reserve {size} bytes of shared memory for {what} ({e.strerror}); {remedy}"
                               ) from None
        return mmap.mmap(fd, size)
    except BaseException:
        if create:
            _posixshmem.shm_unlink("/" + name)
        raise
    finally:
        os.close(fd)


def remove_segment(name: str) -> bool:
    """Unlink segment ``name`` whoever created it; False if it was already gone.

    For a reader whose writer was lost (killed because it hung): the writer
    can no longer unlink its own segment, and it may not be reaped yet, so
    :func:`cleanup_stale_segments` would still see its pid alive.
    """
    try:
        _posixshmem.shm_unlink("/" + check_segment_name(name))
    except FileNotFoundError:
        return False
    return True


def cleanup_stale_segments(prefix: str = "rtp_") -> list[str]:
    """Unlink ``<prefix><pid>_<hex>`` segments in /dev/shm whose creator pid is dead; return their names.

    Segments of live processes, of other naming schemes, and ones we may not
    remove are left alone. Each removal is logged as a warning.
    """
    _check_prefix(prefix)
    if not os.path.isdir(SHM_DIR):
        return []
    pattern = re.compile(re.escape(prefix) + r"(\d+)_[0-9a-f]+")
    removed = []
    for entry in sorted(os.listdir(SHM_DIR)):
        match = pattern.fullmatch(entry)
        if match is None or pid_alive(int(match.group(1))):
            continue
        try:
            _posixshmem.shm_unlink("/" + entry)
        except FileNotFoundError:
            continue  # removed concurrently
        except PermissionError:
            logger.warning("stale shared-memory segment %s/%s belongs to another user; not removed", SHM_DIR, entry)
            continue
        logger.warning("removed stale shared-memory segment %s/%s (creator pid %s is gone)",
                       SHM_DIR, entry, match.group(1))
        removed.append(entry)
    return removed
