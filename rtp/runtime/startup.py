"""Start the runtime on every rank; rank 0 gets a Runtime, the others serve steps and exit.

Rank 0 runs schedule -> channel.write(encode(plan)) -> execute -> sample ->
postprocess (see Engine). Ranks > 0 run read -> decode -> execute (see
worker.py). Every rank beats a heartbeat and runs a watchdog from the start
(:mod:`rtp.distributed.liveness`): a dead or hung peer, a lost launcher or (rank 0) a
stuck step becomes one logged error line and a prompt non-zero exit instead of
a hang in a collective. On rank 0 the step transport takes the watchdog over
before the engine is built; the shm segment is unlinked on every exit path
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
import sys
from pathlib import Path

import torch.distributed as dist

from rtp.config import RtpConfig, resolve_tp_size, setting_keys, value_of
from rtp.distributed import shm_allreduce
from rtp.distributed.heartbeat import Heartbeat, HeartbeatRelay, interval_for
from rtp.distributed.liveness import Failure, Watchdog, exit_deadline, exit_now, kill_hung
from rtp.distributed.parallel import ParallelState
from rtp.distributed.shm_channel import ShmChannel
from rtp.distributed.shm_segment import cleanup_stale_segments, make_segment_name
from rtp.distributed.step_relay import StepRelay
from rtp.errors import ConfigError, RtpError
from rtp.log import get_logger, setup_logging
from rtp.model.loader import checkpoint_fingerprint
from rtp.runtime.coordinator import Runtime
from rtp.runtime.engine import Engine
from rtp.runtime.fault_injection import StepDelay
from rtp.runtime.model_runner import ModelRunner, resolve_dtype
from rtp.runtime.step_transport import StepTransport
from rtp.runtime.worker import WorkerExit, run_worker
from rtp.spec.draft_check import check_draft_model
from rtp.spec.eagle3 import check_eagle3_head

logger = get_logger(__name__)


def start(config: RtpConfig, model_dir: Path) -> Runtime:
    """Bring up this rank. Rank 0 returns its Runtime; other ranks serve and exit the process.

    With data parallelism every replica's coordinator (global rank ``dp_rank * TP``) returns the
    Runtime of its replica; the liveness (heartbeats, watchdogs) spans the whole world, so a rank
    lost in any replica ends the run.
    """
    world = ParallelState.from_env(config.parallel.device, timeout_s=max(config.liveness.timeout_s, 60.0),
                                   pp_size=config.parallel.pipeline_parallel_size,
                                   data_parallel_size=config.parallel.data_parallel_size,
                                   data_parallel_size_local=config.parallel.data_parallel_size_local)
    setup_logging(world.rank, config.log_level, coordinator=world.rank == world.coordinator_rank)
    _check_same_setup(world, config, model_dir)
    check_draft_model(config.speculative_config, model_dir, resolve_tp_size(config, world.world_size))
    check_eagle3_head(config, model_dir)
    step_delay = StepDelay.from_env()
    pids = _gather_pids(world)
    heartbeat, watchdog = _start_liveness(config, world, pids)
    ps = world.replica()
    if world.dp_size > 1:  # the replica's ranks' pids, by their rank in the replica
        pids = [pids[r] for r in world.replica_ranks]
    try:
        return _start(config, model_dir, ps, pids, heartbeat, watchdog, step_delay)
    except BaseException:
        # Every rank usually fails the same way (a bad model, a bad shape): stop watching, so a peer
        # leaving first is not reported on top of the real error. The heartbeat keeps beating until
        # this process exits, so the peers do not take this rank for a hung one meanwhile; without peers it
        # stops too (a script may catch the error and init again).
        watchdog.stop()
        if world.world_size == 1:
            heartbeat.stop()
        raise


# What a node may set for itself: where its files are, its memory and shared-memory sizes, its liveness timeouts,
# its server and its logs. Every other setting must be the same on every node.
_NODE_LOCAL = ("model.path", "speculative_config.model", "parallel.data_parallel_size_local",
               "parallel.shm_chunk_bytes", "parallel.shm_num_chunks", "cache.gpu_memory_utilization",
               "cache.cpu_kv_cache_gib", "liveness.", "server.", "log_level")


def _check_same_setup(world: ParallelState, config: RtpConfig, model_dir: Path) -> None:
    """Several nodes each read their own flags and their own disk: every rank refuses to start (one line, the
    same on each) when a node's settings or checkpoint differ from node 0's, which gave other tokens with exit
    code 0 (another block size, weights, expert parallelism) or a gloo abort (another dtype)."""
    if world.num_nodes == 1 or world.topology is None:
        return
    settings = {key: value_of(config, key) for key in setting_keys() if not key.startswith(_NODE_LOCAL)}
    settings["model.dtype"] = str(resolve_dtype(config.model.dtype, world.device))  # "auto" follows the CPU
    error, files = None, {}
    try:
        if world.rank == world.node_leader:  # the leaders' are compared: one read per node
            files = checkpoint_fingerprint(model_dir)
    except Exception as e:  # noqa: BLE001 - every rank learns of it
        error = e
    world.raise_any(error, "reading its checkpoint")
    entries = world.all_gather_object((settings, files, str(model_dir)))
    (first, first_files, first_dir), topo = entries[0], world.topology
    for node, leader in enumerate(topo.leaders[1:], 1):
        ours, files, path = entries[leader]
        where = f"node {node} ({topo.hosts[leader]})"
        key = next((k for k in first if first[k] != ours[k]), None)
        if key is not None:
            raise ConfigError(f"{where} runs {key}={ours[key]!r}, node 0 ({topo.hosts[0]}) {first[key]!r}: start "
                              "every node with the same settings")
        name = next((n for n in sorted(first_files.keys() | files.keys()) if first_files.get(n) != files.get(n)),
                    None)
        if name is not None:
            raise ConfigError(f"the checkpoint of {where} ({path}) is not node 0's ({first_dir}): its {name} "
                              f"differs{'' if name in files else ' (missing)'}; give every node the same files")


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
    timeout = config.liveness.timeout_s
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
    # A replica's coordinator (rank 0 without data parallelism) owns its channel and times its steps;
    # every rank watches every other rank of its node, whichever replica it belongs to.
    coordinator = ps.rank == ps.coordinator_rank
    leader = ps.coordinator_rank if ps.dp_size > 1 else ps.node_leader
    on_failure = _exit_at_startup if coordinator else WorkerExit(ps.rank, leader)
    local = set(ps.local_ranks)
    watchdog = Watchdog(
        ps.rank, {r: pid for r, pid in enumerate(pids) if r != ps.rank and r in local}, on_failure,
        heartbeat=heartbeat, parent_pid=ps.launcher_pid,
        step_timeout_s=config.liveness.step_timeout_s if coordinator else None, remote=remote,
        step_ranks=ps.replica_ranks if ps.dp_size > 1 else None,
    )
    return heartbeat, watchdog.start()


def _exit_at_startup(failure: Failure) -> None:
    logger.error("%s; the coordinator exits", failure.message)
    kill_hung(failure)
    os._exit(1)  # the main thread may be blocked in a start-up collective with the lost rank


def _start(config: RtpConfig, model_dir: Path, ps: ParallelState, pids: list[int], heartbeat: Heartbeat,
           watchdog: Watchdog, step_delay: StepDelay | None) -> Runtime:
    """Build this rank's replica on ``ps`` (its replica view; ``pids`` by its rank in it)."""
    # (Pipeline stages: each stage's TP group runs its collectives on gloo; the segment spans the whole node.)
    if (ps.world_size > 1 and ps.num_nodes == 1 and ps.pp_size == 1 and ps.device.type == "cpu"
            and shm_allreduce.supported()):
        # Layers' all-reduces and the logits gather go through shared memory instead of gloo.
        # Lost peers fail a collective through the heartbeat and should_abort; the last-resort timeout
        # comes after the stuck-step bound, so a slow step is reported as stuck, with stacks.
        liveness = config.liveness
        last_resort = (liveness.step_timeout_s + liveness.timeout_s if liveness.step_timeout_s
                       else max(liveness.timeout_s, 60.0))
        ps.node_reduce = shm_allreduce.create_and_attach(
            ps, pids, last_resort, heartbeat=heartbeat, should_abort=watchdog.abort_reason
        )
    runner = ModelRunner(ps, model_dir, config)
    if ps.world_size == 1:
        _log_replica(ps, None)
        transport = _transport(config, ps, None, watchdog, heartbeat, step_delay, None, runner)
        return _runtime(config, runner, model_dir, transport)  # the transport tracks the steps
    # Each node's leader (rank 0 on node 0) writes the step plans to its node's channel; with
    # several nodes the others' leaders get them from rank 0 over the leaders' gloo group.
    leader, num_local = ps.rank == ps.node_leader, len(ps.local_ranks)
    channel = None
    if leader and num_local > 1:
        try:
            cleanup_stale_segments()  # segments of crashed runs: removed, each one logged
            channel = ShmChannel.create(make_segment_name(), num_local - 1, config.parallel.shm_chunk_bytes,
                                        config.parallel.shm_num_chunks)
        except BaseException:
            ps.node_broadcast_object("")  # tell the node's workers waiting for the name to give up
            raise
    relay = StepRelay(ps.leader_group) if leader and ps.leader_group is not None else None
    _log_replica(ps, channel)
    if ps.rank == 0:
        try:
            # The transport first: from here on a liveness failure unlinks the channel.
            transport = _transport(config, ps, channel, watchdog, heartbeat, step_delay, relay, runner)
            if channel is not None:
                ps.node_broadcast_object(channel.name)
            return _runtime(config, runner, model_dir, transport)
        except BaseException:
            if channel is not None:
                channel.unlink()
            raise
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
    with exit_deadline(_teardown_budget_s(config), f"rank {ps.rank}'s teardown"):
        runner.close()
        ps.destroy()
    exit_now(0)  # everything this rank owns is released


def _teardown_budget_s(config: RtpConfig) -> float:
    """How long a clean teardown may take before :func:`exit_deadline` ends the process."""
    return max(60.0, 2 * config.liveness.timeout_s)


def _log_replica(ps: ParallelState, channel: ShmChannel | None) -> None:
    """A data-parallel replica's coordinator: where the replica runs and what it shares memory through."""
    if ps.dp_size == 1 or ps.rank != 0:
        return
    first = ps.global_rank or 0  # a replica view has no topology: every rank of it is on the replica's node
    logger.info("data-parallel replica %d: global ranks %d..%d on node %d, step channel %s, CPU all-reduce %s",
                ps.dp_rank, first, first + ps.world_size - 1, ps.node_rank,
                channel.name if channel is not None else "none (one rank)",
                "in shared memory" if ps.node_reduce is not None else "none" if ps.world_size == 1 else "gloo")


def _transport(config: RtpConfig, ps: ParallelState, channel: ShmChannel | None, watchdog: Watchdog,
               heartbeat: Heartbeat, step_delay: StepDelay | None, relay: StepRelay | None,
               runner: ModelRunner) -> StepTransport:
    """Rank 0's step transport, closed at exit and on SIGTERM/SIGINT from now on."""
    transport = StepTransport(config, ps, channel, watchdog, heartbeat, step_delay, relay, release=runner.close)
    atexit.register(transport.close)  # also when building the engine fails: the workers are told to exit
    transport.install_signal_handlers()
    return transport


def _runtime(config: RtpConfig, runner: ModelRunner, model_dir: Path, transport: StepTransport) -> Runtime:
    """Rank 0's engine on ``transport``, and the Runtime around both (shut down at exit)."""
    runtime = Runtime(Engine(config, runner, model_dir, transport=transport.send), transport)
    atexit.register(runtime.shutdown)  # runs before the transport's own close (atexit is last in, first out)
    return runtime
