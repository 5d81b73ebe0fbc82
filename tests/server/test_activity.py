"""The server's periodic activity line (rtp.server.activity): the rates of an interval, nothing for idle ones."""

import logging
from types import SimpleNamespace

from rtp.server.activity import ActivityLog


def _stats(prefill: int, running: int = 0, waiting: int = 0, queried: int = 0, hits: int = 0) -> dict[str, float]:
    return {"num_prefill_tokens_computed": prefill, "num_running": running, "num_waiting": waiting,
            "kv_usage": 0.25, "prefix_query_tokens": queried, "prefix_hit_tokens": hits, "num_preemptions": 0}


def test_an_interval_with_work_is_one_line_of_its_rates(caplog) -> None:
    log = ActivityLog(10.0, now=100.0)
    assert not log.due(109.0) and log.due(110.0)
    log.count([SimpleNamespace(new_token_ids=[1, 2, 3], samples=None),
               SimpleNamespace(new_token_ids=[], samples=[SimpleNamespace(new_token_ids=[4]),
                                                          SimpleNamespace(new_token_ids=[5, 6])])])
    with caplog.at_level(logging.INFO, logger="rtp.server.activity"):
        log.log(_stats(prefill=400, running=2, waiting=1, queried=200, hits=50), now=110.0)
    assert [r.getMessage() for r in caplog.records] == [
        "prefill 40.0 tok/s, generation 0.6 tok/s, running 2, waiting 1, KV cache 25.0%, prefix cache hits 25.0%, "
        "preemptions 0"]
    caplog.clear()
    # The next interval: the counters' increase only; then an idle one writes nothing.
    with caplog.at_level(logging.INFO, logger="rtp.server.activity"):
        log.log(_stats(prefill=500, running=1, queried=200, hits=50), now=115.0)  # no new prefix lookups
        log.log(_stats(prefill=500, queried=200, hits=50), now=125.0)
    assert [r.getMessage() for r in caplog.records] == [
        "prefill 20.0 tok/s, generation 0.0 tok/s, running 1, waiting 0, KV cache 25.0%, prefix cache hits -, "
        "preemptions 0"]


def test_interval_zero_is_never_due() -> None:
    log = ActivityLog(0.0, now=0.0)
    assert not log.due(1e9)
