"""Run under torchrun by test_shm_allreduce.py: checks the shared-memory collectives against a reference."""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from rtp.distributed import shm_allreduce
from rtp.distributed.heartbeat import Heartbeat
from rtp.distributed.parallel import ParallelState
from rtp.errors import RtpError, WorkerDiedError
from rtp.runtime.model_runner import vocab_parallel_argmax

HUNG_TIMEOUT_S = 2.0  # liveness timeout of the "hung" mode


def main() -> None:
    mode = sys.argv[1]
    ps = ParallelState.from_env("cpu")
    pids = [None] * ps.world_size
    dist.all_gather_object(pids, os.getpid(), group=ps.cpu_group)
    heartbeat = Heartbeat.shared(ps, interval_s=0.1, timeout_s=HUNG_TIMEOUT_S).start()
    ar = shm_allreduce.create_and_attach(ps, pids, timeout_s=20.0, slot_bytes=4096,  # tiny slots: force pieces
                                         heartbeat=heartbeat)
    ps.barrier()  # rank 0 unlinks the name when it leaves setup
    leaked = [n for n in os.listdir("/dev/shm") if n.startswith(f"rtp_{pids[0]}_")]
    assert not leaked, f"segment still named after setup: {leaked}"
    if mode == "hung":  # rank 1 stops (SIGSTOP) before the collective: only its heartbeat can tell
        if ps.rank == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            ar.all_reduce(torch.ones(8))
        except WorkerDiedError as e:
            print(f"rank 0 after {time.monotonic() - t0:.1f} s: {e}", flush=True)
            os.kill(pids[1], signal.SIGKILL)
            os._exit(3)
        os._exit(4)
    if mode == "abort":  # the runtime failed for another reason while rank 0 waits for rank 1
        if ps.rank == 1:
            time.sleep(30)
            os._exit(0)
        t0 = time.monotonic()
        ar.should_abort = lambda: "the run failed" if time.monotonic() - t0 > 0.5 else None
        try:
            ar.all_reduce(torch.ones(8))
        except RtpError as e:
            print(f"rank 0 after {time.monotonic() - t0:.1f} s: {e}", flush=True)
            os.kill(pids[1], signal.SIGKILL)
            os._exit(3)
        os._exit(4)
    if mode == "dead":
        if ps.rank == 1:
            os._exit(0)  # leave without ever joining the collective
        try:
            ar.all_reduce(torch.ones(8))
        except WorkerDiedError as e:
            print(f"rank {ps.rank}: {e}", flush=True)
            os._exit(3)
        os._exit(4)
    # "check": the C++ piece where it builds; "check-torch": the torch path. Either must give the reference.
    if mode == "check-torch":
        ar.kernel = None
    print(f"rank {ps.rank}: kernel {'yes' if ar.kernel is not None else 'no'}", flush=True)
    g = torch.Generator().manual_seed(1234)  # the same stream on every rank: every rank knows every input
    for numel in [0, 1, 7, 1023, 1024, 1025, 5000, 70001]:
        for dtype in (torch.float32, torch.bfloat16):
            inputs = [torch.randn(numel, generator=g).to(dtype) for _ in range(ps.world_size)]
            x = inputs[ps.rank].clone()
            ar.all_reduce(x)
            ref = inputs[0] + inputs[1]
            for r in range(2, ps.world_size):
                ref = ref + inputs[r]
            assert torch.equal(x, ref), (numel, dtype)  # bitwise: the same additions in the same order
            # gather along the last dim of a 2-D view
            rows = max(1, numel // 7)
            parts = [t[: rows * (numel // rows)].view(rows, -1) for t in inputs] if numel else [t for t in inputs]
            got = ar.gather(parts[ps.rank], dim=-1)
            if ps.rank == 0:
                assert torch.equal(got, torch.cat(parts, dim=-1)), (numel, dtype)
            else:
                assert got is None
    # Rows wider than a slot take the flat path, whole rows a slot holds the column path; also no rows at all.
    for rows, cols, dtype in [(3, 1500, torch.float32), (5, 1500, torch.bfloat16), (0, 9, torch.float32)]:
        parts = [torch.randn(rows, cols, generator=g).to(dtype) for _ in range(ps.world_size)]
        got = ar.gather(parts[ps.rank], dim=-1)
        if ps.rank == 0:
            assert torch.equal(got, torch.cat(parts, dim=-1)), (rows, cols, dtype)
        else:
            assert got is None
    # A non-contiguous tensor is reduced in place too.
    base = torch.full((6, 10), float(ps.rank + 1))
    view = base[:, ::2]
    ar.all_reduce(view)
    total = sum(range(1, ps.world_size + 1))
    assert torch.equal(base[:, ::2], torch.full((6, 5), float(total))) and torch.equal(base[:, 1::2][0, 0:1],
                                                                                        torch.tensor([ps.rank + 1.0]))
    # Through ParallelState, as the layers call it.
    ps.node_reduce = ar
    y = torch.full((3, 4), float(ps.rank))
    assert ps.all_reduce(y) is y and torch.equal(y, torch.full((3, 4), float(sum(range(ps.world_size)))))
    check_vocab_parallel_argmax(ps, ar)
    print(f"rank {ps.rank}: OK", flush=True)
    ps.destroy()


def check_vocab_parallel_argmax(ps: ParallelState, ar: shm_allreduce.ShmAllReduce) -> None:
    """Greedy tokens from vocabulary shards equal the argmax of the whole logits, ties included (the first
    index of the maximum), through gloo and through the shared segment."""
    g = torch.Generator().manual_seed(99)
    vocab = 1000 * ps.world_size - 7  # the last rank holds 7 padding rows, which are no tokens
    per_rank = -(-vocab // ps.world_size)
    start = ps.rank * per_rank
    for dtype in (torch.float32, torch.bfloat16):
        full = torch.randint(-3, 3, (40, vocab), generator=g).to(dtype)  # small integers: ties in every row
        full[0] = -5.0
        full[0, per_rank - 1] = full[0, per_rank] = 7.0  # equal maxima on either side of ranks 0 and 1's border
        full[1] = -5.0
        full[1, vocab - 1] = 7.0  # the last token id
        full[2, 3 * vocab // 4] = float("inf")
        local = full[:, start : start + per_rank]
        for node_reduce in (None, ar):
            ps.node_reduce = node_reduce
            got = vocab_parallel_argmax(local, start, ps)
            if ps.rank == 0:
                assert torch.equal(got, full.argmax(dim=1)), (dtype, node_reduce)
                assert got[0] == per_rank - 1 and got[1] == vocab - 1
            else:
                assert got is None


if __name__ == "__main__":
    main()
