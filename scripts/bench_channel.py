"""Step-broadcast latency: encoded StepPlan over ShmChannel, the two-node relay, and gloo broadcast_object_list.

Starts ``--world-size`` processes on this machine. For every step rank 0 sends a
realistic decode StepPlan (256 running sequences, one new token each, now and
then a new KV block) to the other ranks, first through ShmChannel with the
explicit wire format, then with ``torch.distributed.broadcast_object_list``
over gloo (pickle). Latency of a step = the moment the slowest worker holds the
decoded StepPlan minus the moment rank 0 started encoding it, both read from
CLOCK_MONOTONIC, which is one clock for every process on the machine.

Steps are paced by an untimed gloo barrier, after which rank 0 waits a little
so that the workers are already waiting, as they are in the runtime.

The two-node relay is the multi-node path (rtp.distributed.step_relay): the
ranks are split into two "nodes", [0, W/2) and [W/2, W); rank 0 writes its
node's channel and sends the encoded plan to node 1's leader (rank W/2) over a
gloo group of the two leaders; the leader republishes it on node 1's own
channel, which node 1's other ranks read. Both "nodes" run on this machine,
in the same namespaces, joined by loopback TCP: the numbers leave out a real
network's latency, which adds to the relay's per-step cost.

    .venv/bin/python scripts/bench_channel.py --world-size 4 --steps 500
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import pickle
import queue
import random
import socket
import statistics
import time

import torch.distributed as dist

from rtp.core.step import CachedSeq, StepPlan, decode, encode
from rtp.distributed.shm_channel import ShmChannel
from rtp.distributed.shm_segment import make_segment_name
from rtp.distributed.step_relay import StepRelay

VOCAB = 151_936  # Qwen3 vocabulary size
NUM_BLOCKS = 4096


def make_plans(num_steps: int, num_seqs: int, seed: int = 0) -> list[StepPlan]:
    """Decode steps: every sequence gets its sampled token; one in 16 also starts a new block."""
    rng = random.Random(seed)
    return [
        StepPlan(
            cached_seqs=[
                CachedSeq(
                    seq_id=1000 + s,
                    num_new_tokens=1,
                    new_token_ids=[rng.randrange(VOCAB)],
                    new_block_ids=[rng.randrange(NUM_BLOCKS)] if rng.random() < 1 / 16 else [],
                )
                for s in range(num_seqs)
            ]
        )
        for _ in range(num_steps)
    ]


def _now_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def _settle() -> None:
    """Rank 0 spends ~0.3 ms (as scheduling would) so the workers are already waiting."""
    end = _now_ns() + 300_000
    while _now_ns() < end:
        pass


def _open_channel(name: str, rank: int, owner: int, num_readers: int) -> ShmChannel | None:
    """``owner`` creates the channel, then the ranks after it (``owner + 1 ..``) attach as its readers."""
    chan = None
    if rank == owner and num_readers:
        chan = ShmChannel.create(name, num_readers=num_readers, chunk_bytes=256 * 1024, num_chunks=4)
    dist.barrier()
    if rank != owner:
        chan = ShmChannel.attach(name, rank - owner - 1, timeout=30)
    dist.barrier()
    return chan


def _relay_steps(rank: int, world: int, names: tuple[str, str], plans: list[StepPlan],
                 times: dict[str, list[int]]) -> int:
    """The two-node relay (see the module docstring); returns the number of plans received wrong."""
    half = world // 2
    node = 0 if rank < half else 1
    leader = 0 if node == 0 else half
    readers = (half if node == 0 else world - half) - 1
    leaders = dist.new_group([0, half])  # every rank creates every group
    relay = StepRelay(leaders) if rank == leader else None
    chan = None
    mismatches = 0
    try:
        chan = _open_channel(names[node], rank, leader, readers)
        for plan in plans:
            dist.barrier()
            if rank == 0:
                _settle()
                t = _now_ns()
                buf = encode(plan)
                if chan is not None:
                    chan.write(buf, timeout=30)
                relay.send(buf)  # type: ignore[union-attr]
            else:
                if rank == half:
                    buf = relay.recv()  # type: ignore[union-attr]
                    times["relay_leader"].append(_now_ns())
                    if chan is not None:
                        chan.write(buf, timeout=30)
                else:
                    buf = chan.read(timeout=30)  # type: ignore[union-attr]
                mismatches += decode(buf) != plan
                t = _now_ns()
            times["relay"].append(t)
    finally:
        if chan is not None:
            chan.close()
            if rank == leader:
                chan.unlink()
    return mismatches


def _rank_main(rank: int, world: int, port: int, name: str, relay_names: tuple[str, str], steps: int,
               warmup: int, seqs: int, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    plans = make_plans(steps + warmup, seqs)  # every rank builds them, so workers can check what they got
    # shm_mid: rank 0 = encode done, workers = read() returned (splits serialization from transport).
    times: dict[str, list[int]] = {"shm": [], "shm_mid": [], "gloo": [], "relay": [], "relay_leader": []}
    mismatches = 0
    chan = None
    try:
        chan = _open_channel(name, rank, 0, world - 1)

        for plan in plans:
            dist.barrier()
            if rank == 0:
                _settle()
                t = _now_ns()
                buf = encode(plan)
                times["shm_mid"].append(_now_ns())
                chan.write(buf, timeout=30)
            else:
                buf = chan.read(timeout=30)
                times["shm_mid"].append(_now_ns())
                got = decode(buf)
                t = _now_ns()
                mismatches += got != plan
            times["shm"].append(t)

        for plan in plans:
            dist.barrier()
            if rank == 0:
                _settle()
                box: list[object] = [plan]
                t = _now_ns()
                dist.broadcast_object_list(box, src=0)
            else:
                box = [None]
                dist.broadcast_object_list(box, src=0)
                t = _now_ns()
                mismatches += box[0] != plan
            times["gloo"].append(t)

        mismatches += _relay_steps(rank, world, relay_names, plans, times)

        gathered: list[object] = [None] * world
        dist.all_gather_object(gathered, (times, mismatches))
        if rank == 0:
            out.put(gathered)
    finally:
        if chan is not None:
            chan.close()
            if rank == 0:
                chan.unlink()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _summary(label: str, lat_us: list[float]) -> tuple[float, float]:
    lat = sorted(lat_us)
    med = statistics.median(lat)
    p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
    print(f"{label:<34} median {med:8.1f} us   p99 {p99:8.1f} us   mean {statistics.fmean(lat):8.1f} us")
    return med, p99


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2, help="number of ranks (>= 2)")
    parser.add_argument("--steps", type=int, default=500, help="timed steps per method")
    parser.add_argument("--warmup", type=int, default=50, help="untimed steps per method")
    parser.add_argument("--seqs", type=int, default=256, help="running sequences per decode step")
    args = parser.parse_args()
    if args.world_size < 2 or args.steps < 1 or args.warmup < 0 or args.seqs < 1:
        parser.error("need --world-size >= 2, --steps >= 1, --warmup >= 0, --seqs >= 1")

    sample = make_plans(1, args.seqs)[0]
    print(f"world size {args.world_size}, {args.steps} steps (+{args.warmup} warm-up), {args.seqs} seqs/step")
    print(f"message size: encode() {len(encode(sample))} B, pickle {len(pickle.dumps(sample))} B")

    # fork: the ranks inherit the already imported modules instead of each importing torch again.
    # Safe here because this process has started no threads and touched no accelerator.
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    port, name = _free_port(), make_segment_name()
    relay_names = (make_segment_name(), make_segment_name())
    t0 = time.monotonic()
    procs = [
        ctx.Process(target=_rank_main,
                    args=(r, args.world_size, port, name, relay_names, args.steps, args.warmup, args.seqs, out))
        for r in range(args.world_size)
    ]
    for p in procs:
        p.start()
    gathered = None
    while gathered is None:  # poll, so a rank that crashed ends the run instead of hanging it
        try:
            gathered = out.get(timeout=1.0)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.terminate()
                raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}") from None
    t_done = time.monotonic()
    for p in procs:
        p.join(timeout=60)
    if any(p.exitcode != 0 for p in procs):
        raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")

    mismatches = sum(m for _, m in gathered)
    print(f"workers received {mismatches} StepPlans that differ from what rank 0 sent")
    result = {}
    for method in ("shm", "gloo"):
        sent = gathered[0][0][method]
        done = [max(gathered[r][0][method][i] for r in range(1, args.world_size)) for i in range(len(sent))]
        lat = [(d - s) / 1e3 for s, d in zip(sent, done)][args.warmup :]
        label = "ShmChannel + encode/decode" if method == "shm" else "gloo broadcast_object_list"
        result[method] = _summary(label, lat)
    # Breakdown of the shm path (medians over steps; the slowest worker each step).
    w = args.world_size
    enc = [(m - s) / 1e3 for s, m in zip(gathered[0][0]["shm"], gathered[0][0]["shm_mid"])][args.warmup :]
    xfer, dec = [], []
    for i in range(args.warmup, len(gathered[0][0]["shm"])):
        xfer.append((max(gathered[r][0]["shm_mid"][i] for r in range(1, w)) - gathered[0][0]["shm_mid"][i]) / 1e3)
        dec.append(max(gathered[r][0]["shm"][i] - gathered[r][0]["shm_mid"][i] for r in range(1, w)) / 1e3)
    print(f"  shm breakdown (medians): encode {statistics.median(enc):.1f} us, "
          f"write->read {statistics.median(xfer):.1f} us, decode {statistics.median(dec):.1f} us")
    (shm_med, shm_p99), (gloo_med, gloo_p99) = result["shm"], result["gloo"]
    print(f"gloo / shm: median {gloo_med / shm_med:.1f}x, p99 {gloo_p99 / shm_p99:.1f}x")

    half = w // 2
    print(f"two-node relay: 'node 0' = ranks 0..{half - 1}, 'node 1' = ranks {half}..{w - 1}, both on this machine "
          "(same namespaces; the leaders' gloo group runs over loopback TCP)")
    sent = gathered[0][0]["relay"][args.warmup :]
    leader = [(d - s) / 1e3 for s, d in zip(sent, gathered[half][0]["relay_leader"][args.warmup :])]
    _summary("  rank 0 -> node 1's leader (gloo)", leader)
    if w - half > 1:
        n1 = [max(gathered[r][0]["relay"][args.warmup + i] for r in range(half + 1, w)) - s for i, s in enumerate(sent)]
        _summary("  -> republished -> node 1 reader", [x / 1e3 for x in n1])
    else:
        print("  (node 1 has one rank: no republish; use --world-size 3 or more to measure it)")
    everyone = [max(gathered[r][0]["relay"][args.warmup + i] for r in range(1, w)) - s for i, s in enumerate(sent)]
    relay_med, relay_p99 = _summary("two-node relay, slowest rank", [x / 1e3 for x in everyone])
    print(f"relay / shm: median {relay_med / shm_med:.1f}x, p99 {relay_p99 / shm_p99:.1f}x")
    print(f"ranks ran for {t_done - t0:.1f} s")


if __name__ == "__main__":
    main()
