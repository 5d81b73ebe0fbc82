"""The data-parallel router: prefix matches, load slack, spreading new prefixes, pins."""

from __future__ import annotations

import pytest

from rtp.errors import RequestError
from rtp.server.http_errors import runtime_error
from rtp.server.router import PrefixRouter, RoundRobinRouter


def test_a_conversation_returns_to_the_replica_that_holds_its_prefix():
    router = PrefixRouter(2, block_size=4, capacity_blocks=100)
    a, b = list(range(100, 140)), list(range(200, 240))
    assert router.choose(a + [1], [0, 0]) == 0
    assert router.choose(b + [2], [0, 0]) == 1  # a new prefix goes to the replica holding fewer blocks
    assert router.choose(a + [3, 4], [0, 0]) == 0
    assert router.choose(b + [5], [0, 0]) == 1
    assert router.match(0, router.block_hashes(a)) == 10 and router.match(1, router.block_hashes(a)) == 0


def test_the_chain_matches_leading_blocks_only():
    router = PrefixRouter(1, block_size=2, capacity_blocks=100)
    router.choose([1, 2, 3, 4, 5, 6], [0])
    assert router.match(0, router.block_hashes([1, 2, 3, 4, 9, 9])) == 2
    assert router.match(0, router.block_hashes([9, 9, 3, 4, 5, 6])) == 0  # same later blocks, other prefix


def test_load_beyond_the_slack_overrides_the_prefix():
    router = PrefixRouter(2, block_size=4, capacity_blocks=100, balance_slack=2)
    shared = list(range(64))
    assert router.choose(shared, [0, 0]) == 0
    assert router.choose(shared, [2, 0]) == 0  # within the slack: the cached prefix wins
    assert router.choose(shared, [3, 0]) == 1  # beyond it: the idle replica, which then holds it too
    assert router.choose(shared, [3, 1]) == 1  # both hold it: the less loaded one


def test_capacity_evicts_the_oldest_blocks():
    router = PrefixRouter(1, block_size=1, capacity_blocks=3)
    router.choose([1, 2, 3, 4, 5], [0])
    assert router.match(0, router.block_hashes([1])) == 0
    assert len(router._blocks[0]) == 3


def test_pins_win_and_are_checked():
    router = PrefixRouter(2, block_size=4, capacity_blocks=10)
    assert router.choose([1] * 8, [0, 9], pinned=1) == 1
    with pytest.raises(RequestError, match="data_parallel_rank=2 is out of range") as e:
        router.choose([1], [0, 0], pinned=2)
    assert e.value.param == "data_parallel_rank"
    assert runtime_error(e.value, "prompt").param == "data_parallel_rank"  # the HTTP error's field
    rr = RoundRobinRouter(3)
    assert [rr.choose([1], [0, 0, 0]) for _ in range(4)] == [0, 1, 2, 0]
    assert rr.choose([1], [0, 0, 0], pinned=2) == 2
