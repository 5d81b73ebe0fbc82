"""The multi-node pieces without torchrun: topology checks, the step relay, the heartbeat relay.

The heartbeat relay runs between two heartbeat regions (two "nodes") through
an in-memory stand-in for the rendezvous store; the step relay runs between
two processes over a real gloo group.
"""

from __future__ import annotations

import multiprocessing as mp
import random
import socket
import time

import pytest

from rtp.distributed.heartbeat import Heartbeat, HeartbeatRelay
from rtp.distributed.liveness import Watchdog
from rtp.distributed.parallel import ParallelState, Topology, replicas_per_node
from rtp.errors import ConfigError

# --------------------------------------------------------------------------- topology


def test_topology_from_torchrun_env_and_hostnames():
    entries = [("a", 10, 0, 0), ("a", 11, 0, 1), ("b", 10, 1, 0), ("b", 12, 1, 1)]
    topo = Topology.from_ranks(entries)
    assert topo.num_nodes == 2 and topo.leaders == (0, 2)
    assert topo.ranks_on(1) == [2, 3] and topo.hosts[3] == "b" and topo.pids[3] == 12


@pytest.mark.parametrize("entries, words", [
    ([("a", 1, 0, 0), ("b", 2, 0, 1)], ["GROUP_RANK 0", "several hosts", "'a'", "'b'"]),
    ([("a", 1, 0, 0), ("b", 2, 2, 0)], ["GROUP_RANK", "[0, 2]", "--node-rank"]),
    ([("a", 1, 0, 0), ("a", 2, 0, 2)], ["LOCAL_RANK", "[0, 2]"]),
    ([("a", 1, 0, 1), ("a", 2, 0, 0)], ["rank 0 must be local rank 0"]),
])
def test_topology_errors_name_the_problem(entries, words):
    with pytest.raises(ConfigError) as e:
        Topology.from_ranks(entries)
    for w in words:
        assert w in str(e.value)


def _topology(nodes: list[int]) -> Topology:
    local = {n: 0 for n in nodes}
    entries = []
    for n in nodes:
        entries.append((f"host{n}", 100 + len(entries), n, local[n]))
        local[n] += 1
    return Topology.from_ranks(entries)


@pytest.mark.parametrize("nodes, dp, per_node", [
    ([0, 0, 1, 1], 2, [1, 1]),  # two nodes of 2 ranks: DP 2 x TP 2, a replica per node
    ([0, 0, 1, 1], 4, [2, 2]),  # DP 4 x TP 1
    ([0, 0, 0, 0, 1, 1], 3, [2, 1]),  # unequal nodes that split no replica: fine
    ([0, 0, 0, 0], 2, [2]),  # one node
])
def test_replicas_per_node(nodes, dp, per_node):
    assert replicas_per_node(_topology(nodes), dp) == per_node
    # data_parallel_size_local given on some ranks, right: accepted
    assert replicas_per_node(_topology(nodes), dp, [per_node[n] if r % 2 else None for r, n in enumerate(nodes)])


@pytest.mark.parametrize("nodes, dp, words", [
    # TP 2 does not divide node 0's 3 ranks: replica 1 (ranks 2..3) has one rank on each node
    ([0, 0, 0, 1], 2, ["replica 1 (global ranks 2..3, TP 2) would span nodes 0 and 1",
                       "node 0 has 3, node 1 has 1", "world 4 = data_parallel_size 2 x TP 2"]),
    # TP 4 over two 2-rank nodes: the one replica would need both nodes
    ([0, 0, 1, 1, 2, 2, 3, 3], 2, ["replica 0 (global ranks 0..3, TP 4) would span nodes 0 and 1"]),
])
def test_a_replica_spanning_nodes_fails_naming_the_numbers(nodes, dp, words):
    with pytest.raises(ConfigError) as e:
        replicas_per_node(_topology(nodes), dp)
    assert "\n" not in str(e.value)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_data_parallel_size_local_must_match_the_node():
    with pytest.raises(ConfigError, match=r"^data_parallel_size_local=2 \(--data-parallel-size-local\) on node 1, "
                                          r"but node 1 holds 1 replica\(s\): its 2 ranks / TP 2"):
        replicas_per_node(_topology([0, 0, 1, 1]), 2, [None, None, 2, 2])
    with pytest.raises(ConfigError, match="data_parallel_size_local=2 needs data_parallel_size > 1"):
        ParallelState.from_env("cpu", data_parallel_size_local=2)  # refused before torch.distributed starts


# --------------------------------------------------------------------------- heartbeat relay


class FakeStore:
    """The two calls the relay makes on a torch.distributed Store; ``broken`` makes them fail."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.broken = False

    def set(self, key: str, value: str) -> None:
        if self.broken:
            raise RuntimeError("Broken pipe")
        self.data[key] = value.encode()

    def multi_get(self, keys: list[str]) -> list[bytes]:
        if self.broken:
            raise RuntimeError("Broken pipe")
        return [self.data[k] for k in keys]


def two_nodes(timeout_s: float = 1.0):
    """Ranks 0, 1 on node 0 and 2, 3 on node 1: one region per node, the leaders' relays, one store."""
    import mmap

    store, by_node = FakeStore(), [[0, 1], [2, 3]]
    regions = [mmap.mmap(-1, Heartbeat.region_bytes(4)) for _ in range(2)]
    hbs = {r: Heartbeat(regions[r // 2], r, 4, 0.02, timeout_s, creator=r % 2 == 0) for r in range(4)}
    for r in range(4):  # what Heartbeat.shared does on a leader: other nodes' slots start fresh
        other = hbs[2 if r < 2 else 0]
        other._q[8 * (1 + r) + 2] = time.monotonic_ns()
    relays = [HeartbeatRelay(hbs[0], store, "k/", 0, by_node), HeartbeatRelay(hbs[2], store, "k/", 1, by_node)]
    return store, hbs, relays


def test_relay_carries_beats_steps_dump_and_stop_requests_across_nodes():
    store, hbs, relays = two_nodes()
    hbs[3].start_step()
    hbs[3].finish_step()
    hbs[3].set_waiting(True)
    for hb in hbs.values():
        hb.beat()
    hbs[0].request_dump(7)
    for relay in relays:
        relay.publish()
    for relay in relays:
        relay.pull()
    # node 0's region now holds node 1's slots and vice versa
    assert hbs[0].beats(3) == hbs[2].beats(3) and hbs[0].step_state(3)[:2] == (1, 1) and hbs[0].waiting(3)
    assert hbs[2].beats(1) == hbs[0].beats(1)
    assert hbs[2]._q[2] == 1 and hbs[2]._q[3] == 7  # the dump request reached node 1's header
    # A rank of node 1 got SIGTERM from its own torchrun: its stop request reaches node 0 (rank 0's watchdog).
    assert hbs[0].stop_requested() is None
    hbs[3].request_stop(1)
    for relay in relays:
        relay.publish()
    for relay in relays:
        relay.pull()
    assert hbs[0].stop_requested() == 1 and hbs[1].stop_requested() == 1
    assert hbs[2]._q[2] == 1 and hbs[2]._q[3] == 7 and hbs[0].beats(3) == hbs[2].beats(3)  # the rest as before


def test_a_silent_node_is_reported_with_its_host_and_a_live_one_is_not():
    store, hbs, relays = two_nodes(timeout_s=0.5)
    for relay in relays:
        relay.start()
    for hb in hbs.values():
        hb.start()
    failures = []
    dog = Watchdog(0, {}, failures.append, heartbeat=hbs[0], interval_s=0.05,
                   remote={2: "pid 10 on host b", 3: "pid 12 on host b"}).start()
    try:
        time.sleep(1.2)  # more than twice the timeout: live remote beats keep arriving
        assert failures == []
        hbs[2].stop()  # node 1's heartbeats and its relay stop: the node is gone
        hbs[3].stop()
        deadline = time.monotonic() + 3
        while not failures and time.monotonic() < deadline:
            time.sleep(0.05)
        assert failures, "a silent node was not reported"
        # either of the node's ranks can be the first whose last beat ages past the timeout
        lost = failures[0]
        assert lost.rank in (2, 3) and lost.pid is None
        where = {2: "pid 10 on host b", 3: "pid 12 on host b"}[lost.rank]
        assert f"rank {lost.rank} ({where}) was lost: no heartbeat from its node" in lost.message
    finally:
        dog.stop()
        for hb in hbs.values():
            hb.stop()


def test_a_stop_signal_after_a_lost_node_ends_rank0_with_that_loss():
    """torchrun stops rank 0 when a rank of its own node leaves because node 1 went silent: rank 0's
    handler names the lost node (not the rank that left, not a requested stop); before the loss the
    same signal is a plain stop."""
    import signal
    import subprocess
    import sys

    from rtp.config import RtpConfig
    from rtp.errors import WorkerDiedError
    from rtp.runtime.step_transport import StepTransport

    _, hbs, _ = two_nodes(timeout_s=0.4)
    left = subprocess.Popen([sys.executable, "-c", "pass"])
    dog = Watchdog(0, {1: left.pid}, lambda failure: None, heartbeat=hbs[0],
                   remote={2: "pid 10 on host b", 3: "pid 12 on host b"})
    transport = StepTransport(RtpConfig(), ParallelState.single("cpu"), None, dog, hbs[0])
    transport.install_signal_handlers()
    assert dog.on_stop_request == transport._stop_for_node  # the run's rank 0 takes another node's stop
    hbs[0].start()
    try:
        with pytest.raises(SystemExit) as stop:  # every peer alive: a requested stop
            signal.raise_signal(signal.SIGTERM)
        assert stop.value.code == 128 + signal.SIGTERM and transport.failed is None
        left.wait()  # rank 1 left ...
        time.sleep(0.6)  # ... after node 1's beats stopped for the timeout
        with pytest.raises(WorkerDiedError, match=r"rank [23] \(pid 1[02] on host b\) was lost: no heartbeat"):
            signal.raise_signal(signal.SIGTERM)
        assert transport.failed is not None and "host b" in transport.failed
        assert dog.failure is None  # a signal handler reports nothing (that takes a lock); the caller does
    finally:
        hbs[0].stop()
        for signum, handler in transport._old_handlers.items():
            signal.signal(signum, handler)


def test_a_broken_store_stops_the_relay_so_the_remote_beats_age():
    store, hbs, relays = two_nodes()
    relays[0].start()
    hbs[0].start()
    try:
        time.sleep(0.1)
        store.broken = True
        time.sleep(0.1)
        assert not relays[0]._thread.is_alive()
        age = hbs[0].age_s(2)
        time.sleep(0.2)
        assert hbs[0].age_s(2) > age + 0.15  # nobody refreshes it any more
    finally:
        hbs[0].stop()


# --------------------------------------------------------------------------- step relay


def _relay_rank(rank: int, port: int, sizes: list[int], out) -> None:
    import torch.distributed as dist

    from rtp.distributed.step_relay import StepRelay

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        relay = StepRelay(dist.group.WORLD, inline_bytes=64)
        rng = random.Random(0)
        msgs = [bytes(rng.randrange(256) for _ in range(n)) for n in sizes]
        if rank == 0:
            for m in msgs:
                relay.send(m)
        else:
            out.put([relay.recv() == m for m in msgs])
    finally:
        dist.destroy_process_group()


def _two_ranks(target, *args) -> tuple[object, list[int | None]]:
    """Run ``target(rank, port, *args, out)`` in two forked processes; (what rank 1 put, exit codes)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")  # the ranks inherit torch instead of importing it again
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, port, *args, out)) for r in range(2)]
    try:
        for p in procs:
            p.start()
        result = out.get(timeout=60)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return result, [p.exitcode for p in procs]


@pytest.mark.slow
def test_step_relay_delivers_every_size_over_gloo():
    sizes = [0, 1, 55, 56, 57, 200, 5000, 3, 70_000, 56]  # inline capacity is 64 - 8 = 56 bytes
    result, exitcodes = _two_ranks(_relay_rank, sizes)
    assert result == [True] * len(sizes)
    assert exitcodes == [0, 0]


def _idle_rank(rank: int, port: int, out) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from rtp.distributed.step_relay import StepRelay, new_relay_group

    # The world's collectives time out after 1 s; the relay's wait must outlast that.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=1))
    try:
        relay = StepRelay(new_relay_group([0, 1]))
        if rank == 0:
            time.sleep(3.0)  # an idle server: no plan for a while
            relay.send(b"after a pause")
        else:
            out.put(relay.recv())
    except Exception as e:  # noqa: BLE001 - reported to the test
        out.put(repr(e))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_leader_waits_for_the_next_plan_as_long_as_rank0_is_idle():
    result, exitcodes = _two_ranks(_idle_rank)
    assert result == b"after a pause"
    assert exitcodes == [0, 0]
