"""The engine's activity in the server log: one line every ``server.log_stats_interval_s`` seconds with work."""

from __future__ import annotations

from collections.abc import Mapping

from rtp.log import get_logger
from rtp.outputs import RequestOutput

logger = get_logger(__name__)


class ActivityLog:
    """The engine's activity as a log line every ``interval_s`` seconds with work (vLLM's periodic stats line):
    prefill tokens a second (query tokens of multi-token chunks: prompts, and verified drafts with speculative
    decoding), generated tokens a second (those sent to the frontends), running and waiting requests, KV cache
    use, the prefix cache's hit rate and the preemptions of the interval. ``interval_s`` 0: no lines."""

    def __init__(self, interval_s: float, now: float) -> None:
        self.interval_s = interval_s
        self.generated = 0  # tokens sent to the frontends since the last line
        self._since = now
        self._prev: Mapping[str, float] = {}

    def count(self, outputs: list[RequestOutput]) -> None:
        """Add a step's newly generated tokens."""
        for out in outputs:
            self.generated += (len(out.new_token_ids) if out.samples is None
                               else sum(len(c.new_token_ids) for c in out.samples))

    def due(self, now: float) -> bool:
        return self.interval_s > 0 and now - self._since >= self.interval_s

    def log(self, stats: Mapping[str, float], now: float) -> None:
        """Write the line for the interval ending ``now`` (nothing if it had no work) and start the next."""
        span = max(now - self._since, 1e-9)

        def delta(key: str) -> float:
            return stats.get(key, 0) - self._prev.get(key, 0)

        prefill = delta("num_prefill_tokens_computed")
        if self.generated or prefill or stats.get("num_running") or stats.get("num_waiting"):
            queried = delta("prefix_query_tokens")
            hits = f"{100 * delta('prefix_hit_tokens') / queried:.1f}%" if queried else "-"
            logger.info("prefill %.1f tok/s, generation %.1f tok/s, running %d, waiting %d, KV cache %.1f%%, "
                        "prefix cache hits %s, preemptions %d", prefill / span, self.generated / span,
                        stats.get("num_running", 0), stats.get("num_waiting", 0), 100 * stats.get("kv_usage", 0),
                        hits, delta("num_preemptions"))
        self._since, self._prev, self.generated = now, dict(stats), 0
