"""Rank-aware logging: one logger per module, INFO on rank 0 only."""

from __future__ import annotations

import logging
import sys

_FORMAT = "%(asctime)s [%(rank)s] %(levelname)s %(name)s: %(message)s"


class _RankFilter(logging.Filter):
    def __init__(self, label: str) -> None:
        super().__init__()
        self.rank = label

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


def get_logger(name: str) -> logging.Logger:
    """The logger of one module (``get_logger(__name__)``)."""
    return logging.getLogger(name)


class RtpLogHandler(logging.StreamHandler):
    """The handler setup_logging installs (replaced, not duplicated, when it is called again)."""


def setup_logging(rank: int = 0, level: str = "INFO", label: str | None = None, coordinator: bool | None = None
                  ) -> None:
    """Configure the ``rtp`` logger tree for this process.

    Rank 0 (with data parallelism: every replica's coordinator, ``coordinator``) logs
    at ``level``; other ranks log warnings and errors only, so a run with eight ranks
    does not print everything eight times. Lines are prefixed ``[rankN]``, or
    ``[label]`` when given (an API frontend: ``[api0]``).
    """
    root = logging.getLogger("rtp")
    chatty = rank == 0 if coordinator is None else coordinator
    effective = getattr(logging, level.upper()) if chatty else max(logging.WARNING, getattr(logging, level.upper()))
    root.setLevel(effective)
    for old in list(root.handlers):
        if isinstance(old, RtpLogHandler):
            root.removeHandler(old)
    handler = RtpLogHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
    handler.addFilter(_RankFilter(label or f"rank{rank}"))
    root.addHandler(handler)
    root.propagate = False
