"""The loop of ranks > 0: read a StepPlan from the channel, run it, repeat.

With several nodes, the leader of every node but rank 0's receives the plans
from rank 0 over the leaders' gloo group (:class:`rtp.distributed.step_relay.StepRelay`)
and republishes them on its node's channel, which it owns.

With pipeline stages a worker runs only its stage's part of each plan (``runner.execute``
receives and sends the hidden states point-to-point); every rank still reads every plan.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

from rtp.core.step import StepKind, decode
from rtp.distributed.heartbeat import Heartbeat
from rtp.distributed.liveness import Failure, Watchdog, kill_hung, stop_signals
from rtp.distributed.parallel import ParallelState
from rtp.distributed.pids import pid_alive
from rtp.distributed.shm_channel import ChannelTimeout, ShmChannel
from rtp.distributed.shm_segment import cleanup_stale_segments, remove_segment
from rtp.distributed.step_relay import StepRelay
from rtp.heap import freeze_startup_heap
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

    The node's step channel is its leader's to unlink (rank 0 on node 0),
    unless the leader is the rank that was lost. The leader of another node
    owns its node's channel (``own_channel``) and unlinks it here.
    """

    def __init__(self, rank: int, leader: int = 0) -> None:
        self.rank, self.leader = rank, leader
        self.channel_name: str | None = None  # the node leader's step channel, once attached
        self.own_channel: ShmChannel | None = None  # the channel this rank writes, on another node's leader

    def __call__(self, failure: Failure) -> None:
        logger.error("%s; rank %d exits", failure.message, self.rank)
        kill_hung(failure)
        if self.own_channel is not None:
            self.own_channel.unlink()
        if failure.rank == self.leader and failure.kind in ("died", "hung") and self.channel_name is not None:
            remove_segment(self.channel_name)  # a hung leader was just killed: it will never unlink it
        cleanup_stale_segments()  # anything else a dead rank 0 left
        os._exit(1)


def run_worker(ps: ParallelState, runner: ModelRunner, channel_name: str | None, watchdog: Watchdog,
               heartbeat: Heartbeat, step_delay: StepDelay | None = None, relay: StepRelay | None = None,
               writer: ShmChannel | None = None) -> None:
    """Serve steps until rank 0 sends SHUTDOWN; exit the process if a peer or the launcher is lost.

    ``watchdog`` is this rank's, started with a :class:`WorkerExit` as its failure handler.
    A rank reads its node's channel ``channel_name``; the leader of another node
    than rank 0's instead receives over ``relay`` and republishes on ``writer``
    (None when it is alone on its node), which it unlinks when it leaves.
    """
    freeze_startup_heap(f"rank {ps.rank}")  # its model shard and runtime: alive until the process ends
    channel: ShmChannel | None = None
    receive: Callable[[], bytes]

    def failed() -> bool:
        return watchdog.failure is not None

    if relay is not None:
        receive = relay.recv
    else:
        if channel_name is None:
            raise ValueError("run_worker needs a channel name or a step relay")
        local = ps.local_ranks
        channel = ShmChannel.attach(channel_name, reader_index=local.index(ps.rank) - 1, timeout=_ATTACH_TIMEOUT_S)
        if isinstance(watchdog.on_failure, WorkerExit):
            watchdog.on_failure.channel_name = channel_name  # from now on a lost leader's channel is removed
        # The channel's writer: this node's leader, or (data parallelism) this replica's coordinator.
        writer_rank = watchdog.on_failure.leader if isinstance(watchdog.on_failure, WorkerExit) else ps.node_leader
        leader_pid = watchdog.peers[writer_rank]

        def lost() -> bool:
            return watchdog.failure is not None or not pid_alive(leader_pid)

        reader = channel

        def receive() -> bytes:
            return reader.read(should_abort=lost)

    # On SIGTERM (torchrun forwards it to every rank) keep serving until rank 0's
    # SHUTDOWN arrives, so a clean stop stays clean; the watchdog covers rank 0 dying. On another node than
    # rank 0's, only this node's torchrun may have been signalled: ask rank 0 (through the relays) to stop.
    def on_sigterm(signum: int, frame: object) -> None:
        if ps.node_rank != 0:
            heartbeat.request_stop(ps.node_rank)
        logger.info("%s: waiting for rank 0 to shut down", signal.Signals(signum).name)

    for signum in stop_signals():  # SIGINT (Ctrl-C reaches every rank of a terminal): rank 0's to act on
        signal.signal(signum, signal.SIG_IGN if signum == signal.SIGINT else on_sigterm)
    try:
        while True:
            data = receive()
            if writer is not None:
                writer.write(data, should_abort=failed)
            plan = decode(data)
            if plan.kind == StepKind.SHUTDOWN:
                logger.info("rank %d: shutdown", heartbeat.rank)
                if writer is not None:  # this node's workers may still be attaching (a shutdown right after init)
                    try:
                        writer.wait_for_readers(heartbeat.timeout_s)
                    except ChannelTimeout as e:  # one never came: its own watchdog ends it
                        logger.warning("%s", e)
                return
            if plan.kind == StepKind.STEP:
                step = heartbeat.start_step()
                if step_delay is not None:
                    step_delay.apply(heartbeat.rank, step)
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
        if channel is not None:
            channel.close()
        if writer is not None:
            writer.unlink()
            writer.close()
