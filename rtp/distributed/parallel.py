"""ParallelState: who this process is in the tensor-parallel world.

Built once from torchrun's environment and passed to every constructor that
needs it; layers never call ``dist.get_rank()`` or read the environment.
"""

from __future__ import annotations

import datetime
import gc
import os
import re
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rtp.distributed.shm_allreduce import ShmAllReduce
from rtp.distributed.step_relay import new_relay_group
from rtp.errors import ConfigError, RtpError
from rtp.log import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True)
class Topology:
    """Which node (torchrun ``GROUP_RANK``) each global rank runs on, with its host and pid.

    Every node has a leader, its local rank 0; rank 0 leads node 0. Pids mean
    something only on their own node.
    """

    hosts: tuple[str, ...]
    pids: tuple[int, ...]
    nodes: tuple[int, ...]
    leaders: tuple[int, ...]
    """Global rank of each node's leader, by node."""

    @property
    def num_nodes(self) -> int:
        return len(self.leaders)

    def ranks_on(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.nodes) if n == node]

    @classmethod
    def from_ranks(cls, entries: list[tuple[str, int, int, int]]) -> Topology:
        """Build and check the topology from every rank's (hostname, pid, GROUP_RANK, LOCAL_RANK)."""
        hosts = tuple(e[0] for e in entries)
        nodes = tuple(e[2] for e in entries)
        num_nodes = max(nodes) + 1
        if sorted(set(nodes)) != list(range(num_nodes)):
            raise ConfigError(f"GROUP_RANK values {sorted(set(nodes))} are not 0..{num_nodes - 1}: "
                              "check every node's --node-rank")
        leaders = []
        for node in range(num_nodes):
            ranks = [r for r, n in enumerate(nodes) if n == node]
            node_hosts = sorted({hosts[r] for r in ranks})
            if len(node_hosts) > 1:
                raise ConfigError(f"GROUP_RANK {node} has ranks on several hosts {node_hosts}: "
                                  "each node (torchrun --node-rank) must run on one machine")
            local = sorted(entries[r][3] for r in ranks)
            if local != list(range(len(ranks))):
                raise ConfigError(f"node {node} has LOCAL_RANK values {local}; expected 0..{len(ranks) - 1}")
            leaders.append(next(r for r in ranks if entries[r][3] == 0))
        if leaders[0] != 0:
            raise ConfigError(f"rank 0 must be local rank 0 of node 0; node 0 is led by rank {leaders[0]}")
        for a in range(num_nodes):
            for b in range(a + 1, num_nodes):
                if hosts[leaders[a]] == hosts[leaders[b]]:
                    logger.warning("nodes %d and %d both report hostname %s: are they really two machines?",
                                   a, b, hosts[leaders[a]])
        return cls(hosts, tuple(e[1] for e in entries), nodes, tuple(leaders))


def replicas_per_node(topology: Topology, dp: int, local: list[int | None] | None = None) -> list[int]:
    """How many data-parallel replicas each node holds, by node; ConfigError if a replica would span nodes.

    Replica d holds the contiguous global ranks ``d*tp .. d*tp+tp-1`` (``tp = world / dp``), so its TP
    collectives stay inside one node. ``local`` (by rank, None where not given) is each rank's
    ``data_parallel_size_local``: where given it must equal its node's count.
    """
    world = len(topology.nodes)
    tp = world // dp
    sizes = [len(topology.ranks_on(n)) for n in range(topology.num_nodes)]
    for d in range(dp):
        nodes = sorted({topology.nodes[r] for r in range(d * tp, (d + 1) * tp)})
        if len(nodes) > 1:
            counts = ", ".join(f"node {n} has {sizes[n]}" for n in range(len(sizes)))
            raise ConfigError(
                f"data-parallel replica {d} (global ranks {d * tp}..{(d + 1) * tp - 1}, TP {tp}) would span nodes "
                f"{' and '.join(map(str, nodes))}: a replica's ranks must be on one node, so each node's rank count "
                f"must be a multiple of TP {tp} ({counts}; world {world} = data_parallel_size {dp} x TP {tp})")
    per_node = [size // tp for size in sizes]
    for rank, given in enumerate(local or []):
        node = topology.nodes[rank]
        if given is not None and given != per_node[node]:
            raise ConfigError(
                f"data_parallel_size_local={given} (--data-parallel-size-local) on node {node}, but node {node} holds "
                f"{per_node[node]} replica(s): its {sizes[node]} ranks / TP {tp}; fix it or leave it unset")
    return per_node


@dataclass
class ParallelState:
    """Rank, world size, device and process groups of this process.

    ``tp_group`` carries tensor collectives (NCCL on GPU, gloo on CPU);
    ``cpu_group`` is always gloo and carries small control messages.

    With ``pp_size`` pipeline stages the world is ``tp_size x pp_size`` ranks, TP innermost:
    ``rank = pp_rank * tp_size + tp_rank``, and ``tp_group`` is this rank's stage.

    With data parallelism (``dp_size`` > 1; not yet with pipeline stages) the world holds
    ``dp_size`` replicas of ``tp_size`` ranks each, global rank = ``dp_rank * tp_size + tp_rank``; every
    replica's ranks are on one node (a node of N ranks holds N / tp_size replicas; see :func:`replicas_per_node`).
    The state :meth:`from_env` returns is the whole world's (liveness watches every rank of it);
    :meth:`replica` gives the view a replica's engine and model are built on, whose
    ``rank``/``world_size`` are the TP rank and size and whose groups span the replica only.
    Without either, tensor parallelism spans the whole world: ``tp_size == world_size``.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    tp_group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None
    node_reduce: ShmAllReduce | None = None
    """Shared-memory collectives for CPU tensors when every rank is on this node (set by the runtime)."""
    launcher_pid: int | None = None
    """pid of the process that started this rank (torchrun's agent); None without a launcher."""
    topology: Topology | None = None
    """Which ranks share a node; None for a world built by hand (one node)."""
    node_group: dist.ProcessGroup | None = None
    """gloo group of this node's ranks (several nodes only)."""
    leader_group: dist.ProcessGroup | None = None
    """gloo group of every node's leader (several nodes only): carries the step plans."""
    pp_size: int = 1
    """Pipeline stages; each holds a contiguous range of layers on ``tp_size`` ranks."""
    dp_rank: int = 0
    """This rank's replica, 0..dp_size-1."""
    dp_size: int = 1
    """Number of data-parallel replicas (1: the world is one replica)."""
    global_rank: int | None = None
    """In a replica view: this rank's rank in the whole world (None: ``rank`` is already global)."""
    replica_node: int = 0
    """In a replica view: the node (torchrun GROUP_RANK) the replica runs on; a replica view has no
    topology, since every rank of a replica is on that one node."""
    dp_group: dist.ProcessGroup | None = None
    """gloo group of the replicas' coordinators (global ranks dp_rank * tp_size); None on other ranks."""
    _replica_groups: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None
    """This rank's replica's (tensor, control) groups, when dp_size > 1."""

    @property
    def num_nodes(self) -> int:
        return 1 if self.topology is None else self.topology.num_nodes

    @property
    def node_rank(self) -> int:
        """This rank's node (torchrun GROUP_RANK); in a replica view, the replica's."""
        return self.replica_node if self.topology is None else self.topology.nodes[self.rank]

    @property
    def node_leader(self) -> int:
        """Global rank of this node's leader (0 with one node)."""
        return 0 if self.topology is None else self.topology.leaders[self.node_rank]

    @property
    def local_ranks(self) -> list[int]:
        """Global ranks on this node, this one included, in order."""
        return list(range(self.world_size)) if self.topology is None else self.topology.ranks_on(self.node_rank)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def tp_size(self) -> int:
        replicas = self.dp_size if self.global_rank is None else 1  # a replica view is one replica's world
        return self.world_size // (self.pp_size * replicas)

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage (0 without pipeline parallelism)."""
        return (self.rank // self.tp_size) % self.pp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def stage_rank(self, stage: int, tp_rank: int = 0) -> int:
        """Global rank of TP rank ``tp_rank`` of pipeline stage ``stage``."""
        return stage * self.tp_size + tp_rank

    @property
    def coordinator_rank(self) -> int:
        """Global rank of this rank's coordinator: rank 0, or (data parallelism) its replica's first rank."""
        return self.dp_rank * self.tp_size * self.pp_size

    @property
    def replica_ranks(self) -> list[int]:
        """Global ranks of this rank's replica, its coordinator first."""
        return list(range(self.coordinator_rank, self.coordinator_rank + self.tp_size))

    def replica(self) -> ParallelState:
        """The view of this rank's replica: rank = TP rank, world = the replica's TP ranks (see the class)."""
        if self.dp_size == 1 or self.global_rank is not None:
            return self
        assert self._replica_groups is not None
        tp_group, cpu_group = self._replica_groups
        return ParallelState(self.tp_rank, self.tp_size, self.local_rank, self.device, tp_group, cpu_group,
                             launcher_pid=self.launcher_pid, dp_rank=self.dp_rank, dp_size=self.dp_size,
                             global_rank=self.rank, dp_group=self.dp_group, replica_node=self.node_rank)

    @classmethod
    def single(cls, device: str | torch.device = "cpu") -> ParallelState:
        """A world of one process, without torch.distributed (tests, TP=1 without torchrun)."""
        return cls(rank=0, world_size=1, local_rank=0, device=torch.device(device))

    @classmethod
    def from_env(cls, device: str = "auto", timeout_s: float = 60.0, pp_size: int = 1,
                 data_parallel_size: int = 1, data_parallel_size_local: int | None = None) -> ParallelState:
        """Initialise torch.distributed from torchrun's RANK/WORLD_SIZE/LOCAL_RANK/MASTER_*.

        Without those variables this is a single-process world. ``device``:
        "auto" picks ``cuda:LOCAL_RANK`` when CUDA is available, else CPU.
        ``pp_size`` pipeline stages split the world (it must divide WORLD_SIZE); each stage's
        ranks get a TP group of their own. ``data_parallel_size`` replicas split it likewise
        (not both at once), each on one node; ``data_parallel_size_local`` (if not None) must be
        the number of replicas on this rank's node.
        """
        if data_parallel_size == 1 and data_parallel_size_local not in (None, 1):
            raise ConfigError(f"data_parallel_size_local={data_parallel_size_local} needs data_parallel_size > 1 "
                              "(--data-parallel-size): a node cannot hold more replicas than the world")
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            if pp_size != 1:
                raise ConfigError(f"pipeline_parallel_size={pp_size} needs {pp_size} ranks or more: run under torchrun")
            return cls.single(resolve_device(device, 0))
        launcher_pid = os.getppid()  # first thing: the liveness watchdog compares it with later getppid()
        rank = int(os.environ["RANK"])
        world_size = int(os.environ["WORLD_SIZE"])
        if world_size % pp_size:
            raise ConfigError(f"pipeline_parallel_size={pp_size} does not divide the world of {world_size} ranks")
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        dev = resolve_device(device, local_rank)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        backend = "nccl" if dev.type == "cuda" else "gloo"
        try:
            return cls._join(rank, world_size, local_rank, dev, backend, launcher_pid, timeout_s, pp_size,
                             data_parallel_size, data_parallel_size_local)
        except dist.DistStoreError as e:  # a rank that never came: name it rather than the store's key
            missing = sorted({int(r) for r in re.findall(r"/(\d+)(?=,|$)", str(e))})
            who = f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}" if missing else "a rank"
            raise RtpError(f"{who} did not join the process group within {timeout_s:.0f} s (stopped, failed or "
                           f"never started: its messages, if any, are above; torch: {e})") from None

    @classmethod
    def _join(cls, rank: int, world_size: int, local_rank: int, dev: torch.device, backend: str, launcher_pid: int,
              timeout_s: float, pp_size: int, data_parallel_size: int, data_parallel_size_local: int | None
              ) -> ParallelState:
        """:meth:`from_env`'s process groups, topology and replica groups."""
        timeout = datetime.timedelta(seconds=timeout_s)
        if not dist.is_initialized():
            dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
        tp_group = dist.group.WORLD
        if pp_size > 1:
            tp = world_size // pp_size
            for stage in range(pp_size):  # every rank creates every group, in the same order
                group = dist.new_group(list(range(stage * tp, (stage + 1) * tp)), timeout=timeout)
                if rank // tp == stage:
                    tp_group = group
        # A gloo group exists on GPU too, for control messages that must not
        # queue behind (or deadlock with) NCCL kernels.
        cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else dist.group.WORLD
        # Who shares a node: torchrun's GROUP_RANK, cross-checked with the hostname.
        entries: list = [None] * world_size
        me = (socket.gethostname(), os.getpid(), int(os.environ.get("GROUP_RANK", 0)), local_rank)
        dist.all_gather_object(entries, me, group=cpu_group)
        topology = Topology.from_ranks(entries)
        ps = cls(rank, world_size, local_rank, dev, tp_group, cpu_group, launcher_pid=launcher_pid, topology=topology,
                 pp_size=pp_size)
        if data_parallel_size > 1:
            ps._add_replica_groups(data_parallel_size, data_parallel_size_local, backend, timeout)
        if topology.num_nodes > 1:
            # Every rank creates every group, in the same order (torch.distributed requires it).
            for node in range(topology.num_nodes):
                group = dist.new_group(topology.ranks_on(node), backend="gloo", timeout=timeout)
                if node == ps.node_rank:
                    ps.node_group = group
            leaders = new_relay_group(list(topology.leaders))
            if rank in topology.leaders:
                ps.leader_group = leaders
        logger.info("initialised %s world of %d ranks on %s (%d node%s%s)", backend, world_size, dev,
                    topology.num_nodes, "s" if topology.num_nodes > 1 else "",
                    f", {pp_size} pipeline stages of TP {world_size // pp_size}" if pp_size > 1 else
                    f", {ps.dp_size} data-parallel replicas of TP {ps.tp_size}" if ps.dp_size > 1 else "")
        return ps

    def _add_replica_groups(self, dp: int, local: int | None, backend: str, timeout: datetime.timedelta) -> None:
        """Every rank creates every replica's groups and the coordinators' group, in the same order.

        The placement is checked first, on every rank alike (each sees every rank's
        ``data_parallel_size_local``), so a bad one fails the whole world at once, before the model loads.
        """
        if self.world_size % dp:
            raise ConfigError(f"data_parallel_size={dp} does not divide the world of {self.world_size} ranks")
        if self.topology is not None:
            given: list[int | None] = [None] * self.world_size
            dist.all_gather_object(given, local, group=self.cpu_group)
            replicas_per_node(self.topology, dp, given)
        self.dp_size, tp = dp, self.world_size // dp
        self.dp_rank = self.rank // tp
        for d in range(dp):
            ranks = list(range(d * tp, (d + 1) * tp))
            group = dist.new_group(ranks, backend=backend, timeout=timeout)
            control = dist.new_group(ranks, backend="gloo", timeout=timeout) if backend == "nccl" else group
            if d == self.dp_rank:
                self._replica_groups = (group, control)
        coordinators = dist.new_group([d * tp for d in range(dp)], backend="gloo", timeout=timeout)
        if self.rank % tp == 0:
            self.dp_group = coordinators

    # Collectives. With one rank they are no-ops, so layers need no special case.

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the TP group, in place; returns ``x``."""
        if self.tp_size > 1:
            if self.node_reduce is not None and x.device.type == "cpu":
                return self.node_reduce.all_reduce(x)
            dist.all_reduce(x, group=self.tp_group)
        return x

    def gather_to_driver(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Concatenate each TP rank's ``x`` along ``dim`` on the stage's TP rank 0 (rank 0 without pipeline
        parallelism); other ranks get None."""
        if self.tp_size == 1:
            return x
        if self.node_reduce is not None and x.device.type == "cpu":
            return self.node_reduce.gather(x, dim)
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        # group_dst: the stage's (or replica's) first rank, whatever its global rank
        dist.gather(x, parts, group_dst=0, group=self.tp_group)
        return torch.cat(parts, dim=dim) if parts is not None else None

    def min_int(self, value: int) -> int:
        """Minimum of an integer over all ranks (KV block counts)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def raise_any(self, error: Exception | None, doing: str) -> None:
        """Every rank raises when any rank failed ``doing`` (``error``: this rank's failure, or None).

        For start-up work whose errors are not the same on every rank (pipeline stages each check only their
        own layers' tensors): the failing rank raises its own error, the others an RtpError naming that rank and
        its message, so the rank that reports (rank 0) says why, and no rank is left waiting in a collective.
        """
        if self.world_size == 1 or self.cpu_group is None:  # alone, or a view without process groups (checks)
            if error is not None:
                raise error
            return
        messages = self.all_gather_object(None if error is None else str(error))
        if error is not None:
            raise error
        failed = next(((r, m) for r, m in enumerate(messages) if m is not None), None)
        if failed is not None:
            raise RtpError(f"rank {failed[0]} failed {doing}: {failed[1]}")

    def all_gather_object(self, obj: Any) -> list[Any]:  # noqa: ANN401 - any small picklable object
        """Every rank's ``obj``, by rank (control group; start-up only)."""
        if self.world_size == 1 or self.cpu_group is None:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out

    def barrier(self) -> None:
        """Wait for every rank (control group)."""
        if self.world_size > 1:
            dist.barrier(group=self.cpu_group)

    def broadcast_object(self, obj: object) -> object:
        """Send a small picklable object from rank 0 to every rank (startup only)."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group_src=0, group=self.cpu_group)
        return box[0]

    def node_broadcast_object(self, obj: object) -> object:
        """Send a small picklable object from this node's leader to the node's ranks (startup only)."""
        if self.node_group is None:
            return self.broadcast_object(obj)
        box = [obj]
        dist.broadcast_object_list(box, src=self.node_leader, group=self.node_group)
        return box[0]

    def node_barrier(self) -> None:
        """Wait for every rank of this node."""
        if self.node_group is None:
            self.barrier()
        else:
            dist.barrier(group=self.node_group)

    def destroy(self, barrier: bool = True, barrier_timeout_s: float = 10.0) -> None:
        """Tear down the process groups (idempotent).

        Ranks first meet at a barrier: a rank that tears gloo down while a peer
        still uses the connection can abort in gloo's threads at exit. A dead
        peer only costs the timeout.
        """
        # A replica view of one rank still belongs to a world of several: its groups go too (left to
        # the interpreter's exit, gloo's teardown can block on a lost peer with no watchdog to end it).
        if (self.world_size > 1 or self.global_rank is not None) and dist.is_initialized():
            try:
                if barrier and self.world_size > 1:
                    dist.monitored_barrier(self.cpu_group, timeout=datetime.timedelta(seconds=barrier_timeout_s))
            except RuntimeError as e:
                logger.debug("no barrier before teardown: %s", e)
            dist.destroy_process_group()
        # destroy_process_group() only makes torch.distributed forget the groups: each C++ group, with
        # gloo's worker threads, lives while anything holds it. Left to the interpreter's exit, its last
        # tensors are freed after Python is gone and the process can abort ("terminate called without an
        # active exception"). Dropping this view's references frees them now.
        self.tp_group = self.cpu_group = self.node_group = self.leader_group = self.dp_group = None
        self._replica_groups = None
        gc.collect()
        if self.node_reduce is not None:
            self.node_reduce.close()
            self.node_reduce = None


def resolve_device(device: str, local_rank: int) -> torch.device:
    """Map a config device string to a torch.device for this local rank."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device=cuda was requested but CUDA is not available; use device: cpu or auto")
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(
                f"local rank {local_rank} has no GPU: only {torch.cuda.device_count()} visible; "
                "lower --nproc-per-node or check CUDA_VISIBLE_DEVICES"
            )
        return torch.device("cuda", local_rank)
    if device == "cpu":
        return torch.device("cpu")
    raise ConfigError(f"device={device!r} is invalid: expected auto, cpu or cuda")
