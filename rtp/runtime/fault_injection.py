"""Test-only fault injection: make one step artificially long on one rank.

The liveness tests need a step that runs long while its process stays alive
(a big prefill, a compile), to check that it is not taken for a hung rank and
that it is reported as a stuck step. Off unless the environment variable
``RTP_TEST_STEP_DELAY=RANK:STEP:SECONDS`` is set (e.g. ``1:5:60``: rank 1
sleeps 60 s inside step 5). It is read once, by the runtime's start-up, and
passed down as a :class:`StepDelay`; it is deliberately not a config key, so
no shipped or user config can turn it on.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

from rtp.errors import ConfigError
from rtp.log import get_logger

logger = get_logger(__name__)

ENV_VAR = "RTP_TEST_STEP_DELAY"


@dataclass(frozen=True)
class StepDelay:
    """Sleep ``seconds`` inside step number ``step`` (1-based) on rank ``rank``."""

    rank: int
    step: int
    seconds: float

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> StepDelay | None:
        """The delay described by ``RTP_TEST_STEP_DELAY``, or None when it is unset or empty."""
        text = environ.get(ENV_VAR, "").strip()
        if not text:
            return None
        try:
            rank, step, seconds = text.split(":")
            delay = cls(int(rank), int(step), float(seconds))
        except ValueError:
            delay = None
        if delay is None or delay.rank < 0 or delay.step < 1 or not delay.seconds >= 0:
            raise ConfigError(f"{ENV_VAR}={text!r} is invalid: expected RANK:STEP:SECONDS, e.g. 1:5:60")
        return delay

    def apply(self, rank: int, step: int) -> None:
        """Sleep if this is the rank and the step to delay."""
        if rank == self.rank and step == self.step:
            logger.warning("test hook %s: rank %d sleeps %.1f s in step %d", ENV_VAR, rank, self.seconds, step)
            time.sleep(self.seconds)
