"""The loop of ranks > 0: read a StepPlan from the channel, run it, repeat."""

from __future__ import annotations

import os
import signal

from rtp.core.step import StepKind, decode
from rtp.dist.liveness import Watchdog, pid_alive
from rtp.dist.parallel import ParallelState
from rtp.dist.shm_channel import ShmChannel, cleanup_stale_segments
from rtp.log import get_logger
from rtp.runtime.model_runner import ModelRunner

logger = get_logger(__name__)


def run_worker(ps: ParallelState, runner: ModelRunner, channel_name: str, driver_pid: int, timeout_s: float) -> None:
    """Serve steps until rank 0 sends SHUTDOWN; exit the process if rank 0 dies."""
    channel = ShmChannel.attach(channel_name, reader_index=ps.rank - 1, timeout=timeout_s)

    def driver_gone(rank: int, pid: int) -> None:
        logger.error("rank 0 (pid %d) is gone; rank %d exits", pid, ps.rank)
        cleanup_stale_segments()  # the dead writer cannot unlink its segment: do it for it
        os._exit(1)

    watchdog = Watchdog({0: driver_pid}, driver_gone).start()
    # On SIGTERM (torchrun forwards it to every rank) keep serving until rank 0's
    # SHUTDOWN arrives, so a clean stop stays clean; the watchdog covers rank 0 dying.
    signal.signal(signal.SIGTERM, lambda *_: logger.info("SIGTERM: waiting for rank 0 to shut down"))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        while True:
            plan = decode(channel.read(should_abort=lambda: not pid_alive(driver_pid)))
            if plan.kind == StepKind.SHUTDOWN:
                logger.info("rank %d: shutdown", ps.rank)
                return
            if plan.kind == StepKind.STEP:
                runner.execute(plan)
    except Exception:
        # A collective or the channel failed: if rank 0 is gone, that is the cause, not a bug here.
        if watchdog.wait_for_dead(timeout_s=3.0):
            driver_gone(0, driver_pid)
        raise
    finally:
        watchdog.stop()
        channel.close()
