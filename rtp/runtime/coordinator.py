"""Start the runtime on every rank; rank 0 gets a Runtime, the others serve steps and exit.

Rank 0 runs schedule -> channel.write(encode(plan)) -> execute -> sample ->
postprocess (see Engine). Ranks > 0 run read -> decode -> execute (see
worker.py). Every rank beats a heartbeat and runs a watchdog from the start
(:mod:`rtp.distributed.liveness`): a dead or hung peer, a lost launcher or (rank 0) a
stuck step becomes one logged error line and a prompt non-zero exit instead of
a hang in a collective. The shm segment is unlinked on every exit path
(normal, exception, SIGTERM/SIGINT, any liveness failure).

Several nodes (torchrun --nnodes): every node's leader (its local rank 0) owns
its node's channel; rank 0 also sends each plan to the other leaders over
their gloo group (:mod:`rtp.distributed.step_relay`), and the leaders carry
the heartbeats between nodes through the rendezvous store
(:class:`rtp.distributed.heartbeat.HeartbeatRelay`). With one node neither runs.
"""

from __future__ import annotations

import atexit
import datetime
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist
from tqdm import tqdm

from rtp.config import RtpConfig, resolve_tp_size
from rtp.core.step import StepKind, StepPlan, encode
from rtp.distributed import shm_allreduce
from rtp.distributed.heartbeat import Heartbeat, HeartbeatRelay, interval_for
from rtp.distributed.liveness import Failure, Watchdog, kill_hung
from rtp.distributed.parallel import ParallelState
from rtp.distributed.shm_channel import ShmChannel, cleanup_stale_segments, make_channel_name
from rtp.distributed.step_relay import StepRelay
from rtp.errors import RequestError, RtpError, StepTimeoutError, WorkerDiedError
from rtp.log import get_logger, setup_logging
from rtp.outputs import RequestOutput, snapshot
from rtp.runtime.engine import Engine
from rtp.runtime.fault_injection import StepDelay
from rtp.runtime.model_runner import ModelRunner
from rtp.runtime.worker import WorkerExit, run_worker
from rtp.sampling import SamplingParams

logger = get_logger(__name__)

# After a liveness failure rank 0's main thread normally unwinds (its waits check the failure)
# and exits through the launcher's error path. It may instead be stuck where nothing is checked
# (a gloo or NCCL call, a step sleeping in a test hook): then the process exits this much later.
_EXIT_GRACE_S = 3.0


def _error(failure: Failure) -> WorkerDiedError:
    return StepTimeoutError(failure.message) if failure.kind == "stuck" else WorkerDiedError(failure.message)


class Runtime:
    """Rank 0's handle on the running world: the engine, the channel, the heartbeat and the watchdog."""

    def __init__(self, config: RtpConfig, ps: ParallelState, engine: Engine, channel: ShmChannel | None,
                 watchdog: Watchdog, heartbeat: Heartbeat, step_delay: StepDelay | None = None,
                 relay: StepRelay | None = None) -> None:
        self.config, self.ps, self.engine, self.channel = config, ps, engine, channel
        self.relay = relay  # several nodes: the plans also go to the other nodes' leaders
        self.watchdog, self.heartbeat, self.step_delay = watchdog, heartbeat, step_delay
        self.closed = False
        self.stop_signal: int | None = None  # SIGTERM/SIGINT received during a step: stop after it
        self.failed: str | None = None  # a step raised: the workers may be stuck in it, the engine is unusable
        self.in_step = False
        self._old_handlers: dict[int, Any] = {}  # what signal.signal returned
        self.on_failure: list[Callable[[str], None]] = []  # the server hooks in to fail its clients
        watchdog.on_failure = self._on_failure  # takes over from the start-up handler

    # ---- step transport and liveness ----

    def send(self, plan: StepPlan) -> None:
        """Broadcast a plan to the workers (before rank 0 runs it); a STEP plan starts a step."""
        step = self.heartbeat.start_step() if plan.kind == StepKind.STEP else None
        if self.channel is not None:
            # A full ring with live, beating readers that never read is a stuck step; outside a
            # step (SHUTDOWN) readers that fail to read for a liveness timeout are as good as gone.
            timeout = self.config.step_timeout_s if step is not None else self.config.liveness_timeout_s
            data = encode(plan)
            self.channel.write(data, timeout=timeout, should_abort=self._aborted)
            if self.relay is not None:
                self.relay.send(data)
        elif self.relay is not None:  # several nodes, rank 0 alone on its node
            self.relay.send(encode(plan))
        if step is not None and self.step_delay is not None:
            self.step_delay.apply(0, step)

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
        # launcher's error path (shutdown() kills a hung peer last); if it is stuck where nothing
        # is checked, leave without it.
        timer = threading.Timer(_EXIT_GRACE_S, self._exit_now, args=(failure,))
        timer.daemon = True
        timer.start()

    def _exit_now(self, failure: Failure) -> None:
        logger.error("rank 0's main thread did not stop within %.0f s of the failure; exiting", _EXIT_GRACE_S)
        kill_hung(failure)
        os._exit(1)

    def check_alive(self) -> None:
        """Raise the liveness failure, if one was reported."""
        if self.watchdog.failure is not None:
            raise _error(self.watchdog.failure)

    def step(self) -> list[RequestOutput]:
        """One engine step. A step that fails because a peer was lost becomes a WorkerDiedError naming it."""
        self.check_alive()
        if self.failed is not None:
            raise RtpError(f"the runtime failed earlier and cannot continue: {self.failed}")
        self.in_step = True
        try:
            outputs = self.engine.step()
            self.heartbeat.finish_step()
            return outputs
        except Exception as e:
            found = self.watchdog.wait_for_lost(timeout_s=3.0)
            self.failed = f"{type(e).__name__}: {e}"
            if found is None:
                self.heartbeat.finish_step()  # the step is over (failed): not a stuck step later
                raise
            failure = self.watchdog.report(found)  # the first failure wins, whoever saw it
            self.engine.fail_all(failure.message)
            raise _error(failure) from e
        finally:
            self.in_step = False
            if self.stop_signal is not None:
                raise SystemExit(128 + self.stop_signal)  # deferred signal: unwinds to rtp.shutdown()

    # ---- offline API ----

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate completions for a batch; outputs come back in prompt order."""
        batch: list  # of strings and token-id lists
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            batch = [prompts]
        elif isinstance(prompts, list):
            batch = prompts
        else:
            raise TypeError("prompts must be a string, a list of token ids, or a list of either")
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(batch):
                raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(batch)} prompts")
            params = sampling_params
        else:
            params = [sampling_params or SamplingParams()] * len(batch)
        for i, sp in enumerate(params):
            if not isinstance(sp, SamplingParams):
                raise TypeError(f"sampling_params[{i}] is a {type(sp).__name__}; expected rtp.SamplingParams")
        ids: list[str] = []
        try:
            for i, (p, sp) in enumerate(zip(batch, params)):
                try:
                    ids.append(self.engine.add_request(p, sp))
                except RequestError as e:
                    raise RequestError(f"prompt {i}: {e}") from None
            return self._run_until_done(ids, use_tqdm)
        except BaseException:
            for rid in ids:  # leave nothing behind to run in a later call
                self.engine.abort(rid)
            raise

    def _run_until_done(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        start = self.engine.stats()
        last = (time.perf_counter(), start)
        while len(done) < len(ids):
            for out in self.step():
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
                    bar.update(1)
            now = time.perf_counter()
            if use_tqdm and now - last[0] > 0.5:
                stats = self.engine.stats()
                dt = now - last[0]
                prefill = (stats["num_prefill_tokens_computed"] - last[1]["num_prefill_tokens_computed"]) / dt
                decode = (stats["num_decode_tokens"] - last[1]["num_decode_tokens"]) / dt
                bar.set_postfix_str(f"prefill {prefill:.0f} tok/s, decode {decode:.0f} tok/s")
                last = (now, stats)
        bar.close()
        end = self.engine.stats()
        logger.info(
            "generated %d requests: %d prompt tokens computed, %d prefix-cache hits, %d decode tokens, %d preemptions",
            len(ids), end["num_prefill_tokens_computed"] - start["num_prefill_tokens_computed"],
            end["prefix_hit_tokens"] - start["prefix_hit_tokens"],
            end["num_decode_tokens"] - start["num_decode_tokens"],
            end["num_preemptions"] - start["num_preemptions"],
        )
        return [done[i] for i in ids]

    def generate_stream(self, prompt: str | list[int], sampling_params: SamplingParams | None = None
                        ) -> Iterator[RequestOutput]:
        """Yield the request's output after every step that changed it, until it finishes."""
        rid = self.engine.add_request(prompt, sampling_params)
        finished = False
        try:
            while not finished:
                for out in self.step():
                    if out.request_id == rid:
                        finished = out.finished
                        yield snapshot(out)  # the engine keeps updating its own object
        finally:
            if not finished:  # closed early by the caller
                self.engine.abort(rid)

    # ---- teardown ----

    def _unlink(self) -> None:
        if self.channel is not None:
            self.channel.unlink()

    def shutdown(self) -> None:
        """Tell the workers to exit, then release the channel and the process group. Idempotent."""
        if self.closed:
            return
        self.closed = True
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
        except Exception as e:  # noqa: BLE001 - best effort: a worker may already be gone
            logger.warning("could not send shutdown to the workers: %s", e)
            healthy = False
        finally:
            self._unlink()
            if self.channel is not None:
                self.channel.close()
            if self.engine is not None:
                self.engine.runner.close()
            self.ps.destroy(barrier=healthy)
            # Last: the workers watch this heartbeat until they have read SHUTDOWN. Without a clean
            # SHUTDOWN it beats on until the process exits, so no worker takes this rank for a hung one.
            if healthy:
                self.heartbeat.stop()
            if self.watchdog.failure is not None:
                # A hung peer cannot exit on its own. Killed only now, because torchrun answers a
                # rank's death by signalling the others, which would cut this cleanup short.
                kill_hung(self.watchdog.failure)
        logger.info("shut down")


def start(config: RtpConfig, model_dir: Path) -> Runtime:
    """Bring up this rank. Rank 0 returns its Runtime; other ranks serve and exit the process."""
    ps = ParallelState.from_env(config.device, timeout_s=max(config.liveness_timeout_s, 60.0))
    setup_logging(ps.rank, config.log_level)
    resolve_tp_size(config, ps.world_size)
    step_delay = StepDelay.from_env()
    pids = _gather_pids(ps)
    heartbeat, watchdog = _start_liveness(config, ps, pids)
    try:
        return _start(config, model_dir, ps, pids, heartbeat, watchdog, step_delay)
    except BaseException:
        # Every rank usually fails the same way (a bad model, a bad shape): stop watching, so a peer
        # leaving first is not reported on top of the real error. The heartbeat keeps beating until
        # this process exits, so the peers do not take this rank for a hung one meanwhile.
        watchdog.stop()
        raise


def _gather_pids(ps: ParallelState) -> list[int]:
    """Every rank's pid, by rank (gathered with the topology; a pid means something on its own node only)."""
    if ps.world_size == 1 or ps.topology is None:
        return [os.getpid()]
    return list(ps.topology.pids)


def _heartbeat_relay(ps: ParallelState, heartbeat: Heartbeat, timeout_s: float) -> HeartbeatRelay | None:
    """Several nodes, on a node's leader: the relay that carries heartbeats through the rendezvous store."""
    if ps.topology is None or ps.num_nodes == 1 or ps.rank != ps.node_leader:
        return None
    try:
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except (KeyError, ValueError):
        raise RtpError("several nodes need torchrun's MASTER_ADDR and MASTER_PORT (the rendezvous store)") from None
    # A client of its own: a relay call that waits on a lost store blocks no other store user.
    store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    run = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    ranks_by_node = [ps.topology.ranks_on(n) for n in range(ps.num_nodes)]
    return HeartbeatRelay(heartbeat, store, f"rtp/heartbeat/{run}/", ps.node_rank, ranks_by_node)


def _start_liveness(config: RtpConfig, ps: ParallelState, pids: list[int]) -> tuple[Heartbeat, Watchdog]:
    """Start this rank's heartbeat and watchdog (collective over the control group when there are peers).

    They start before the model loads, so a rank lost during the load is
    caught too; until rank 0's Runtime takes over, a failure just logs and exits.
    """
    timeout = config.liveness_timeout_s
    if ps.world_size > 1:
        heartbeat = Heartbeat.shared(ps, interval_for(timeout), timeout)
    else:
        heartbeat = Heartbeat.private(interval_for(timeout), timeout)
    remote: dict[int, str] = {}
    if ps.num_nodes > 1 and ps.topology is not None:
        relay = _heartbeat_relay(ps, heartbeat, timeout)
        ps.barrier()  # every leader has published its node's beats before any relay reads them
        if relay is not None:
            relay.start()
        topo = ps.topology
        remote = {r: f"pid {topo.pids[r]} on host {topo.hosts[r]}" for r in range(ps.world_size)
                  if r not in ps.local_ranks}
    heartbeat.start()
    on_failure = WorkerExit(ps.rank, ps.node_leader) if ps.rank != 0 else _exit_at_startup
    local = set(ps.local_ranks)
    watchdog = Watchdog(
        ps.rank, {r: pid for r, pid in enumerate(pids) if r != ps.rank and r in local}, on_failure,
        heartbeat=heartbeat, parent_pid=ps.launcher_pid,
        step_timeout_s=config.step_timeout_s if ps.rank == 0 else None, remote=remote,
    )
    return heartbeat, watchdog.start()


def _exit_at_startup(failure: Failure) -> None:
    logger.error("%s; rank 0 exits", failure.message)
    kill_hung(failure)
    os._exit(1)  # the main thread may be blocked in a start-up collective with the lost rank


def _start(config: RtpConfig, model_dir: Path, ps: ParallelState, pids: list[int], heartbeat: Heartbeat,
           watchdog: Watchdog, step_delay: StepDelay | None) -> Runtime:
    if ps.world_size > 1 and ps.num_nodes == 1 and ps.device.type == "cpu" and shm_allreduce.supported():
        # Layers' all-reduces and the logits gather go through shared memory instead of gloo.
        # Lost peers fail a collective through the heartbeat and should_abort; the last-resort timeout
        # comes after the stuck-step bound, so a slow step is reported as stuck, with stacks.
        last_resort = (config.step_timeout_s + config.liveness_timeout_s if config.step_timeout_s
                       else max(config.liveness_timeout_s, 60.0))
        ps.node_reduce = shm_allreduce.create_and_attach(
            ps, pids, last_resort, heartbeat=heartbeat, should_abort=watchdog.abort_reason
        )
    runner = ModelRunner(
        ps, model_dir, dtype=config.dtype, block_size=config.block_size, max_model_len=config.max_model_len,
        max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
        num_kv_blocks=config.num_kv_blocks,
        cpu_kv_cache_gib=config.cpu_kv_cache_gib, gpu_memory_utilization=config.gpu_memory_utilization,
        enforce_eager=config.enforce_eager, cuda_graph_max_batch=min(config.cuda_graph_max_batch, config.max_num_seqs),
        expert_parallel=config.expert_parallel,
    )
    if ps.world_size == 1:
        runtime = Runtime(config, ps, None, None, watchdog, heartbeat, step_delay)  # type: ignore[arg-type]
        runtime.engine = Engine(config, runner, model_dir, transport=runtime.send)  # transport: step tracking
        _install_exit_handlers(runtime)
        return runtime
    # Each node's leader (rank 0 on node 0) writes the step plans to its node's channel; with
    # several nodes the others' leaders get them from rank 0 over the leaders' gloo group.
    leader, num_local = ps.rank == ps.node_leader, len(ps.local_ranks)
    channel = None
    if leader and num_local > 1:
        try:
            cleanup_stale_segments()  # segments of crashed runs: removed, each one logged
            channel = ShmChannel.create(make_channel_name(), num_local - 1, config.shm_chunk_bytes,
                                        config.shm_num_chunks)
        except BaseException:
            ps.node_broadcast_object("")  # tell the node's workers waiting for the name to give up
            raise
    relay = StepRelay(ps.leader_group) if leader and ps.leader_group is not None else None
    if ps.rank == 0:
        try:
            # The Runtime first: from here on a liveness failure unlinks the channel.
            runtime = Runtime(config, ps, None, channel, watchdog, heartbeat, step_delay,  # type: ignore[arg-type]
                              relay=relay)
            _install_exit_handlers(runtime)
            if channel is not None:
                ps.node_broadcast_object(channel.name)
            runtime.engine = Engine(config, runner, model_dir, transport=runtime.send)
        except BaseException:
            if channel is not None:
                channel.unlink()
            raise
        return runtime
    name = None
    if leader:  # another node's leader: receives the plans over the relay and republishes them
        if channel is not None:
            if isinstance(watchdog.on_failure, WorkerExit):
                watchdog.on_failure.own_channel = channel
            ps.node_broadcast_object(channel.name)
    else:
        name = ps.node_broadcast_object(None)
        if not name:
            logger.error("rank %d failed to create the step channel; rank %d exits", ps.node_leader, ps.rank)
            sys.exit(1)
    run_worker(ps, runner, str(name) if name else None, watchdog, heartbeat, step_delay, relay=relay, writer=channel)
    runner.close()
    ps.destroy()
    sys.exit(0)


def _install_exit_handlers(runtime: Runtime) -> None:
    """Unlink the segment and stop the workers on normal exit, SIGTERM and SIGINT."""
    atexit.register(runtime.shutdown)

    def on_signal(signum: int, frame) -> None:  # noqa: ANN001
        # Inside a step, stop when it ends: leaving in the middle would strand the workers
        # in a collective. Outside a step (or on a second signal), stop at once.
        if runtime.in_step and runtime.stop_signal is None:
            logger.info("received %s: shutting down after the current step", signal.Signals(signum).name)
            runtime.stop_signal = signum
            return
        logger.info("received %s: shutting down", signal.Signals(signum).name)
        raise SystemExit(128 + signum)

    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            runtime._old_handlers[signum] = signal.signal(signum, on_signal)
