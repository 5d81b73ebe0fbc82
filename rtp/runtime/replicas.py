"""Data parallelism offline: rank 0 spreads a ``generate()`` batch over the replicas' coordinators.

Every replica is a full engine on its own ranks (its scheduler, KV cache and
step channel). Rank 0's :class:`ReplicaGroup` splits a batch round-robin by
prompt index, sends each coordinator its share (one :class:`ReplicaBatch` per
replica, broadcast once per ``generate()`` call over the coordinators' gloo
group), runs its own share, gathers the others' finished outputs and returns
them in the caller's order. The other coordinators run :func:`serve_replica`
until rank 0 sends :data:`SHUTDOWN`.

This is one message per batch, not per step: the replicas step independently.
A lost rank anywhere is seen by every rank's watchdog (the liveness spans the
world, across nodes too), so no coordinator waits on a dead peer past the
liveness bound; a step or a collective of this group that fails because of it
raises the watchdog's WorkerDiedError naming the lost rank, on every coordinator.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch.distributed as dist

from rtp.errors import RequestError, RtpError, WorkerDiedError
from rtp.log import get_logger
from rtp.outputs import RequestOutput
from rtp.sampling import SamplingParams

if TYPE_CHECKING:
    from rtp.runtime.coordinator import Runtime

logger = get_logger(__name__)

SHUTDOWN = "shutdown"
GENERATE = "generate"


@dataclass
class ReplicaBatch:
    """One replica's share of a batch: the prompts' indices in the caller's batch, the prompts, their params."""

    indices: list[int] = field(default_factory=list)
    prompts: list[str | list[int]] = field(default_factory=list)
    params: list[SamplingParams] = field(default_factory=list)


@dataclass
class ReplicaResult:
    """A replica's answer: its outputs in its share's order, or the first prompt it refused (global index)."""

    outputs: list[RequestOutput] = field(default_factory=list)
    error: str | None = None
    """A prompt refused (RequestError's message, naming its index in the caller's batch)."""
    failed: str | None = None
    """The replica's engine failed otherwise (the exception, in one line)."""


def split_batch(prompts: list, params: list[SamplingParams], num_replicas: int) -> list[ReplicaBatch]:
    """Prompt i goes to replica i % num_replicas (equal shares for equal prompts; mixed lengths interleave)."""
    shares = [ReplicaBatch() for _ in range(num_replicas)]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        share = shares[i % num_replicas]
        share.indices.append(i)
        share.prompts.append(p)
        share.params.append(sp)
    return shares


def run_share(runtime: Runtime, share: ReplicaBatch, use_tqdm: bool) -> ReplicaResult:
    """Generate one share on this replica's engine."""
    try:
        return ReplicaResult(runtime.generate_local(share.prompts, share.params, use_tqdm, share.indices))
    except RequestError as e:
        return ReplicaResult(error=str(e))
    except WorkerDiedError:
        raise  # a lost rank ends the run: the other coordinators are failing too, nobody waits for this share
    except Exception as e:  # noqa: BLE001 - reported by rank 0; every coordinator still joins the gather
        logger.exception("replica %d failed its share", runtime.dp_rank)
        return ReplicaResult(failed=f"{type(e).__name__}: {e}")


class ReplicaGroup:
    """Rank 0's end of the coordinators' group: one generate() call spread over every replica."""

    def __init__(self, group: dist.ProcessGroup, size: int) -> None:
        self.group, self.size = group, size
        self.closed = False

    def generate(self, runtime: Runtime, prompts: list, params: list[SamplingParams],
                 use_tqdm: bool) -> list[RequestOutput]:
        shares = split_batch(prompts, params, self.size)
        _collective(runtime, dist.broadcast_object_list, [(GENERATE, shares)], group_src=0, group=self.group)
        mine = run_share(runtime, shares[0], use_tqdm)
        results: list[ReplicaResult | None] = [None] * self.size
        _collective(runtime, dist.gather_object, mine, results, group_dst=0, group=self.group)
        out: list[RequestOutput | None] = [None] * len(prompts)
        for replica, (share, result) in enumerate(zip(shares, results)):
            assert result is not None
            if result.failed is not None:
                raise RtpError(f"data-parallel replica {replica} failed: {result.failed}")
            if result.error is not None:
                raise RequestError(result.error)
            for i, o in zip(share.indices, result.outputs):
                out[i] = o
        assert all(o is not None for o in out)
        return out  # type: ignore[return-value]

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Tell the other coordinators to shut their replicas down, and wait until they heard it."""
        if self.closed:
            return
        self.closed = True
        dist.broadcast_object_list([(SHUTDOWN, None)], group_src=0, group=self.group)
        dist.monitored_barrier(self.group, timeout=datetime.timedelta(seconds=timeout_s))


def serve_replica(runtime: Runtime) -> None:
    """A coordinator other than rank 0: run the shares rank 0 sends until it says SHUTDOWN."""
    ps = runtime.transport.ps
    group, rank = ps.dp_group, ps.dp_rank
    assert group is not None
    while True:
        box: list[object] = [None]
        _collective(runtime, dist.broadcast_object_list, box, group_src=0, group=group)
        message: tuple[str, list[ReplicaBatch] | None] = box[0]  # type: ignore[assignment]
        kind, shares = message
        if kind == SHUTDOWN:
            dist.monitored_barrier(group, timeout=datetime.timedelta(seconds=30.0))
            logger.info("replica %d: shutdown", rank)
            return
        assert shares is not None
        result = run_share(runtime, shares[rank], use_tqdm=False)
        _collective(runtime, dist.gather_object, result, None, group_dst=0, group=group)


def _collective(runtime: Runtime, collective: Callable[..., object], *args: object, **kwargs: object) -> None:
    """A collective of the coordinators' group; one that fails because a rank was lost raises the
    watchdog's WorkerDiedError naming it (gloo's own error says only that a connection closed)."""
    try:
        collective(*args, **kwargs)
    except RuntimeError as e:
        found = runtime.transport.watchdog.wait_for_lost(timeout_s=3.0)
        if found is None:
            raise
        raise WorkerDiedError(runtime.transport.watchdog.report(found).message) from e
