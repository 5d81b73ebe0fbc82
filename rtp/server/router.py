"""The data-parallel router: which replica a request goes to, from its prompt and the replicas' loads.

Each API frontend keeps, per replica, the chained hashes of the full KV blocks
of the prompts it sent there, the same chain a replica's block manager keys its
prefix cache by (block i's key covers tokens 0..(i+1)*block_size). A request's
match on a replica is the number of its leading blocks found there: the prompt
tokens that replica can most likely serve from its cache. The router:

1. sends a pinned request (``X-Data-Parallel-Rank`` / ``data_parallel_rank``) where it is pinned;
2. among the replicas whose in-flight count is within ``balance_slack`` of the
   least loaded one, picks the longest match (ties: the least loaded, then the
   one holding the fewest blocks, so new prefixes spread);
3. remembers the prompt's blocks for the replica it chose.

Why a copy in the router rather than the block managers' own hash sets sent
back each step: the routing decision needs no message from the engines, every
frontend decides on the event loop in microseconds, and the engines' wire stays
as it is. What the copy cannot see is an eviction: it keeps at most as many
blocks per replica as the replica's KV cache holds (LRU), so a stale entry costs
one wasted preference, never a wrong answer (the engine recomputes what it
lacks). With several frontends each sees only its own requests; with the
default single frontend the view is complete.
"""

from __future__ import annotations

from collections import OrderedDict

from rtp.core.block_manager import hash_block
from rtp.errors import RequestError


def check_pin(pinned: int | None, num_replicas: int) -> None:
    """RequestError unless ``pinned`` (a request's data_parallel_rank) is None or one of the replicas."""
    if pinned is not None and not 0 <= pinned < num_replicas:
        which = "one replica (0)" if num_replicas == 1 else f"{num_replicas} replicas, 0..{num_replicas - 1}"
        raise RequestError(f"data_parallel_rank={pinned} is out of range: this server has {which}",
                           param="data_parallel_rank")


class PrefixRouter:
    """Cache-aware, load-balanced choice among ``num_replicas`` replicas."""

    def __init__(self, num_replicas: int, block_size: int, capacity_blocks: int, balance_slack: int = 2) -> None:
        self.num_replicas, self.block_size = num_replicas, block_size
        self.capacity_blocks, self.balance_slack = max(1, capacity_blocks), balance_slack
        self._blocks: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]

    def block_hashes(self, ids: list[int]) -> list[int]:
        """The chained hash of each full block of ``ids`` (the block manager's own)."""
        out: list[int] = []
        h: int | None = None
        bs = self.block_size
        for start in range(0, len(ids) - bs + 1, bs):
            h = hash_block(h, ids[start : start + bs])
            out.append(h)
        return out

    def match(self, replica: int, hashes: list[int]) -> int:
        """Leading blocks of ``hashes`` that ``replica`` most likely holds."""
        held = self._blocks[replica]
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def choose(self, ids: list[int], loads: list[int], pinned: int | None = None) -> int:
        """The replica for a prompt (and its blocks remembered there); ``loads``: requests in flight per replica."""
        hashes = self.block_hashes(ids)
        if pinned is not None:
            check_pin(pinned, self.num_replicas)
            replica = pinned
        else:
            least = min(loads)
            eligible = [r for r in range(self.num_replicas) if loads[r] <= least + self.balance_slack]
            replica = max(eligible, key=lambda r: (self.match(r, hashes), -loads[r], -len(self._blocks[r]), -r))
        self._remember(replica, hashes)
        return replica

    def _remember(self, replica: int, hashes: list[int]) -> None:
        held = self._blocks[replica]
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.capacity_blocks:
            held.popitem(last=False)


class RoundRobinRouter(PrefixRouter):
    """The baseline the README compares with: replicas in turn, pins honoured."""

    def __init__(self, num_replicas: int) -> None:
        super().__init__(num_replicas, 1 << 30, 1)
        self._next = 0

    def choose(self, ids: list[int], loads: list[int], pinned: int | None = None) -> int:
        if pinned is not None:
            return super().choose(ids, loads, pinned)
        replica, self._next = self._next, (self._next + 1) % self.num_replicas
        return replica
