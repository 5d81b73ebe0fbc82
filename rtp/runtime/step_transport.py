"""Rank 0's step transport: each StepPlan to the workers, and the liveness that watches every step.

The transport writes each plan to its node's shm channel (and, with several
nodes, to the other leaders over the step relay), starts and ends the step on
the heartbeat, turns a step that failed because a peer was lost into one
error naming it, and defers SIGTERM/SIGINT to the end of a running step. It
exists before the engine, so a failure while the engine is being built is
handled like any other.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from rtp.config import RtpConfig
from rtp.core.step import StepKind, StepPlan, encode
from rtp.distributed.heartbeat import Heartbeat
from rtp.distributed.liveness import Failure, Watchdog, exit_deadline, kill_hung, stop_signals
from rtp.distributed.parallel import ParallelState
from rtp.distributed.shm_channel import ShmChannel
from rtp.distributed.step_relay import StepRelay
from rtp.errors import RtpError, StepTimeoutError, WorkerDiedError
from rtp.log import get_logger
from rtp.outputs import RequestOutput
from rtp.runtime.fault_injection import StepDelay

logger = get_logger(__name__)

# After a liveness failure rank 0's main thread normally unwinds (its waits check the failure)
# and exits through the launcher's error path. It may instead be stuck where nothing is checked
# (a gloo or NCCL call, a step sleeping in a test hook): then the process exits this much later.
_EXIT_GRACE_S = 3.0


def _error(failure: Failure) -> WorkerDiedError:
    return StepTimeoutError(failure.message) if failure.kind == "stuck" else WorkerDiedError(failure.message)


class StepTransport:
    """Rank 0's channel, relay, heartbeat and watchdog, and the exit paths that release them.

    ``release`` runs on close before the process group goes (the model runner's CUDA graphs
    hold NCCL work that must not outlive the communicator).
    """

    def __init__(self, config: RtpConfig, ps: ParallelState, channel: ShmChannel | None, watchdog: Watchdog,
                 heartbeat: Heartbeat, step_delay: StepDelay | None = None, relay: StepRelay | None = None,
                 release: Callable[[], None] | None = None) -> None:
        self.config, self.ps, self.channel = config, ps, channel
        self.relay = relay  # several nodes: the plans also go to the other nodes' leaders
        self.watchdog, self.heartbeat, self.step_delay = watchdog, heartbeat, step_delay
        self.release = release
        self.closed = False
        self.stop_signal: int | None = None  # SIGTERM/SIGINT received during a step: stop after it
        self.failed: str | None = None  # a step raised: the workers may be stuck in it, the engine is unusable
        self.in_step = False
        self._old_handlers: dict[int, Any] = {}  # what signal.signal returned
        self.on_failure: list[Callable[[str], None]] = []  # the server hooks in to fail its clients
        watchdog.on_failure = self._on_failure  # takes over from the start-up handler

    # ---- steps ----

    def send(self, plan: StepPlan) -> None:
        """Broadcast a plan to the workers (before rank 0 runs it); a STEP plan starts a step."""
        step = self.heartbeat.start_step() if plan.kind == StepKind.STEP else None
        if self.channel is not None:
            # A full ring with live, beating readers that never read is a stuck step; outside a
            # step (SHUTDOWN) readers that fail to read for a liveness timeout are as good as gone.
            liveness = self.config.liveness
            timeout = liveness.step_timeout_s if step is not None else liveness.timeout_s
            data = encode(plan)
            self.channel.write(data, timeout=timeout, should_abort=self._aborted)
            if self.relay is not None:
                self.relay.send(data)
        elif self.relay is not None:  # several nodes, rank 0 alone on its node
            self.relay.send(encode(plan))
        if step is not None and self.step_delay is not None:
            self.step_delay.apply(self.heartbeat.rank, step)

    def run_step(self, step: Callable[[], list[RequestOutput]],
                 fail_all: Callable[[str], object]) -> list[RequestOutput]:
        """Run one engine ``step``. A step that fails because a peer was lost fails every request
        (``fail_all``) and becomes a WorkerDiedError naming the peer."""
        self.check_alive()
        if self.failed is not None:
            raise RtpError(f"the runtime failed earlier and cannot continue: {self.failed}")
        self.in_step = True
        try:
            outputs = step()
            self.heartbeat.finish_step()
            return outputs
        except Exception as e:
            found = self.watchdog.wait_for_lost(timeout_s=3.0)
            self.failed = f"{type(e).__name__}: {e}"
            if found is None:
                self.heartbeat.finish_step()  # the step is over (failed): not a stuck step later
                raise
            failure = self.watchdog.report(found)  # the first failure wins, whoever saw it
            fail_all(failure.message)
            raise _error(failure) from e
        except BaseException as e:
            # A second stop signal interrupts a step in the middle: the workers may sit in its collectives and
            # the scheduler's view of the step (blocks it registered for the step's KV) never came true.
            self.failed = f"a step was interrupted ({type(e).__name__})"
            raise
        finally:
            self.in_step = False
            if self.stop_signal is not None:
                signum, self.stop_signal = self.stop_signal, None
                raise _interruption(signum)  # deferred signal: unwinds to rtp.shutdown() or the caller's handler

    # ---- liveness ----

    def check_alive(self) -> None:
        """Raise the liveness failure, if one was reported."""
        if self.watchdog.failure is not None:
            raise _error(self.watchdog.failure)

    def lost_peer(self) -> Failure | None:
        """The failure already reported, else a peer already gone, else None; takes no lock (a signal
        handler asks it). A lost node comes first: this node's ranks that saw it and left are not the cause."""
        watchdog = self.watchdog
        return watchdog.failure or watchdog.lost_node() or watchdog.check_peers(heartbeats=False)

    def report_lost_peer(self) -> bool:
        """If a peer process is already gone, report it now (the failure hooks run, as when the watchdog finds
        it); True when a failure is (or was) reported. A stop signal often follows a rank's loss (torchrun
        stops the survivors when one dies): checked first, the stop is told as that loss."""
        found = self.lost_peer()
        if found is None:
            return False
        self.watchdog.report(found)  # the first failure wins, whoever saw it
        return True

    def _aborted(self) -> bool:
        return self.watchdog.failure is not None

    def _on_failure(self, failure: Failure) -> None:
        """The watchdog's handler (runs once, on whichever thread reported first): fail everything, leave."""
        logger.error("%s", failure.message)
        for hook in list(self.on_failure):
            try:
                hook(failure.message)
            except Exception:  # noqa: BLE001 - failing clients must not stop the exit
                logger.exception("failure hook raised")
        self._unlink()
        # The main thread normally notices the failure within milliseconds and exits through the
        # launcher's error path (close() kills a hung peer last); if it is stuck where nothing
        # is checked, leave without it.
        timer = threading.Timer(_EXIT_GRACE_S, self._exit_now, args=(failure,))
        timer.daemon = True
        timer.start()

    def _exit_now(self, failure: Failure) -> None:
        logger.error("rank 0's main thread did not stop within %.0f s of the failure; exiting", _EXIT_GRACE_S)
        kill_hung(failure)
        os._exit(1)

    def install_signal_handlers(self) -> None:
        """SIGTERM, SIGINT and SIGHUP stop the process: at once outside a step, at its end inside one."""

        def on_signal(signum: int, frame: Any) -> None:  # noqa: ANN401
            # torchrun stops the survivors when a rank leaves: a stop that follows a rank's loss ends
            # the run with that loss (the launcher prints it), not as a requested shutdown.
            lost = self.lost_peer()
            if lost is not None:
                logger.info("received %s after a rank was lost", signal.Signals(signum).name)
                self.failed = lost.message  # close() must not wait on the lost rank for a shutdown
                raise _error(lost)
            # Inside a step, stop when it ends: leaving in the middle would strand the workers
            # in a collective. Outside a step (or on a second signal), stop at once.
            if self.in_step and self.stop_signal is None:
                logger.info("received %s: %s after the current step", signal.Signals(signum).name, _stopping(signum))
                self.stop_signal = signum
                return
            logger.info("received %s: %s", signal.Signals(signum).name, _stopping(signum))
            raise _interruption(signum)

        if threading.current_thread() is threading.main_thread():
            for signum in stop_signals():
                self._old_handlers[signum] = signal.signal(signum, on_signal)
        ps = self.ps
        if (ps.rank if ps.global_rank is None else ps.global_rank) == 0:  # the run's rank 0, not a replica's
            self.watchdog.on_stop_request = self._stop_for_node

    def _stop_for_node(self, node: int) -> None:
        """Another node's ranks got SIGTERM (the watchdog's thread): this process takes it too, unless it already
        got a stop signal (a second one would not wait for the running step)."""
        if self.stop_signal is None:
            logger.warning("node %d's ranks got SIGTERM: stopping the run as for a SIGTERM to rank 0", node)
            os.kill(os.getpid(), signal.SIGTERM)

    # ---- teardown ----

    def _unlink(self) -> None:
        if self.channel is not None:
            self.channel.unlink()

    def close(self) -> None:
        """Tell the workers to exit, then release the channel and the process group. Idempotent."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)  # registered at start-up: a closed transport need not outlive init()
        # The watchdog stops watching here: a teardown that blocks must still end the process.
        with exit_deadline(max(60.0, 2 * self.heartbeat.timeout_s), "rank 0's teardown"):
            self._close()

    def _close(self) -> None:
        self.watchdog.stop()
        for signum, handler in self._old_handlers.items():
            signal.signal(signum, handler)
        # After a failed step the workers may still sit in its collectives: telling them to
        # shut down or meeting them at a barrier could block. Leaving is enough, since their
        # watchdogs see rank 0 go.
        healthy = self.watchdog.failure is None and self.failed is None
        try:
            if (self.channel is not None or self.relay is not None) and healthy:
                self.send(StepPlan(kind=StepKind.SHUTDOWN))
                if self.channel is not None:  # a shutdown right after init(): workers may still be attaching
                    self.channel.wait_for_readers(self.heartbeat.timeout_s)
        except Exception as e:  # noqa: BLE001 - best effort: a worker may already be gone
            logger.warning("could not send shutdown to the workers: %s", e)
            healthy = False
        finally:
            self._unlink()
            if self.channel is not None:
                self.channel.close()
            if self.release is not None:
                self.release()
            self.ps.destroy(barrier=healthy)
            # Last: the workers watch this heartbeat until they have read SHUTDOWN. Without a clean
            # SHUTDOWN it beats on until the process exits, so no worker takes this rank for a hung one.
            if healthy:
                self.heartbeat.stop()
            if self.watchdog.failure is not None:
                # A hung peer cannot exit on its own. Killed only now, because torchrun answers a
                # rank's death by signalling the others, which would cut this cleanup short.
                kill_hung(self.watchdog.failure)


def _interruption(signum: int) -> BaseException:
    """What a stop signal raises on rank 0: KeyboardInterrupt for SIGINT (Ctrl-C in a script, a REPL or a
    notebook, which may catch it: a step it waited for has ended, and generate() aborts its requests), else
    SystemExit(128 + signum)."""
    return KeyboardInterrupt() if signum == signal.SIGINT else SystemExit(128 + signum)


def _stopping(signum: int) -> str:
    return "interrupting" if signum == signal.SIGINT else "shutting down"
