"""The loop of ranks > 0: read a StepPlan from the channel, run it, repeat."""

from __future__ import annotations

import os
import signal
import time

from rtp.core.step import StepKind, decode
from rtp.distributed.heartbeat import Heartbeat
from rtp.distributed.liveness import Failure, Watchdog, kill_hung
from rtp.distributed.parallel import ParallelState
from rtp.distributed.pids import pid_alive
from rtp.distributed.shm_channel import ShmChannel, cleanup_stale_segments, remove_segment
from rtp.log import get_logger
from rtp.runtime.fault_injection import StepDelay
from rtp.runtime.model_runner import ModelRunner

logger = get_logger(__name__)

# Waiting for rank 0 to create the step channel: it does so right after a collective every rank
# joined, so this only bounds a rank 0 that is alive but never gets there (the watchdog covers
# a rank 0 that dies or hangs).
_ATTACH_TIMEOUT_S = 60.0


class WorkerExit:
    """A worker's failure handler: log the one line, remove what a lost rank 0 cannot, exit at once.

    A worker owns no segment itself; rank 0's step channel is rank 0's to
    unlink, unless rank 0 is the rank that was lost.
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.channel_name: str | None = None  # rank 0's step channel, once attached

    def __call__(self, failure: Failure) -> None:
        logger.error("%s; rank %d exits", failure.message, self.rank)
        kill_hung(failure)
        if failure.rank == 0 and failure.kind in ("died", "hung") and self.channel_name is not None:
            remove_segment(self.channel_name)  # a hung rank 0 was just killed: it will never unlink it
        cleanup_stale_segments()  # anything else a dead rank 0 left
        os._exit(1)


def run_worker(ps: ParallelState, runner: ModelRunner, channel_name: str, watchdog: Watchdog,
               heartbeat: Heartbeat, step_delay: StepDelay | None = None) -> None:
    """Serve steps until rank 0 sends SHUTDOWN; exit the process if a peer or the launcher is lost.

    ``watchdog`` is this rank's, started with a :class:`WorkerExit` as its failure handler.
    """
    channel = ShmChannel.attach(channel_name, reader_index=ps.rank - 1, timeout=_ATTACH_TIMEOUT_S)
    if isinstance(watchdog.on_failure, WorkerExit):
        watchdog.on_failure.channel_name = channel_name  # from now on a lost rank 0's channel is removed
    driver_pid = watchdog.peers[0]

    def lost() -> bool:
        return watchdog.failure is not None or not pid_alive(driver_pid)

    # On SIGTERM (torchrun forwards it to every rank) keep serving until rank 0's
    # SHUTDOWN arrives, so a clean stop stays clean; the watchdog covers rank 0 dying.
    signal.signal(signal.SIGTERM, lambda *_: logger.info("SIGTERM: waiting for rank 0 to shut down"))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        while True:
            plan = decode(channel.read(should_abort=lost))
            if plan.kind == StepKind.SHUTDOWN:
                logger.info("rank %d: shutdown", ps.rank)
                return
            if plan.kind == StepKind.STEP:
                step = heartbeat.start_step()
                if step_delay is not None:
                    step_delay.apply(ps.rank, step)
                runner.execute(plan)
                heartbeat.finish_step()
    except Exception:
        # A collective or the channel failed: if a peer is gone or hung, that is the cause, not a bug here.
        failure = watchdog.wait_for_lost(timeout_s=3.0)
        if failure is not None:
            watchdog.report(failure)  # exits the process, unless another thread reported first and is exiting
            time.sleep(5.0)
            os._exit(1)
        raise
    finally:
        watchdog.stop()
        channel.close()
