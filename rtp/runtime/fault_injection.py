"""Test-only fault injection: make one step artificially long on one rank.

The liveness tests need a step that runs long while its process stays alive
(a big prefill, a compile), to check that it is not taken for a hung rank and
that it is reported as a stuck step. Off unless the environment variable
``RTP_TEST_STEP_DELAY=RANK:STEP:SECONDS`` is set (e.g. ``1:5:60``: rank 1
sleeps 60 s inside step 5; ``0:1+:0.01``: rank 0 sleeps 10 ms in every step from
step 1 on, a slow rank). It is read once, by the runtime's start-up, and
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
    """Sleep ``seconds`` inside step number ``step`` (1-based) on rank ``rank``; in every later step too if
    ``onwards``."""

    rank: int
    step: int
    seconds: float
    onwards: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> StepDelay | None:
        """The delay described by ``RTP_TEST_STEP_DELAY``, or None when it is unset or empty."""
        text = environ.get(ENV_VAR, "").strip()
        if not text:
            return None
        try:
            rank, step, seconds = text.split(":")
            onwards = step.endswith("+")
            delay = cls(int(rank), int(step.removesuffix("+")), float(seconds), onwards)
        except ValueError:
            delay = None
        if delay is None or delay.rank < 0 or delay.step < 1 or not delay.seconds >= 0:
            raise ConfigError(f"{ENV_VAR}={text!r} is invalid: expected RANK:STEP[+]:SECONDS, e.g. 1:5:60")
        return delay

    def apply(self, rank: int, step: int) -> None:
        """Sleep if this is the rank and the step (or, ``onwards``, a later one) to delay."""
        if rank != self.rank or step < self.step or (step > self.step and not self.onwards):
            return
        if step == self.step:
            logger.warning("test hook %s: rank %d sleeps %.3f s in step %d%s", ENV_VAR, rank, self.seconds, step,
                           " and every later step" if self.onwards else "")
        time.sleep(self.seconds)
