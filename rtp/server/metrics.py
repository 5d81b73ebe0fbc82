"""Prometheus metrics of one server, in a registry of its own (never the global one).

Request-level metrics (token counters, latency histograms) are observed by the
API layer as requests finish; engine gauges (running/waiting requests, KV-cache
usage, prefix-cache hit rate) are read from the engine's last stats snapshot
at scrape time, so a scrape never touches the scheduler from the HTTP thread.

With API frontend processes each frontend observes its own requests. With
several, prometheus_client's multiprocess mode sums them: rank 0 starts every
frontend with ``PROMETHEUS_MULTIPROC_DIR`` set to a directory of its run, each
frontend's counters and histograms live in files there, and a scrape of any
frontend reads all of them (one frontend keeps them in memory: an observation
costs ~3x less). The engine gauges come with every step's frame from rank 0
(the same numbers in every frontend).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rtp.outputs import RequestOutput
from rtp.server.vllm_metrics import VllmMetricsCollector, spec_positions

# Latency buckets in seconds: from a few ms (tiny models, decode steps) to minutes (long generations).
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _EngineStatsCollector(Collector):
    """Turns the engine's stats snapshot into gauges at scrape time."""

    def __init__(self, stats: Callable[[], Mapping[str, float]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats() or {}
        yield GaugeMetricFamily("rtp_requests_running", "Requests in the running batch.",
                                value=s.get("num_running", 0))
        yield GaugeMetricFamily("rtp_requests_waiting", "Requests queued for admission.",
                                value=s.get("num_waiting", 0))
        yield GaugeMetricFamily("rtp_kv_cache_usage_ratio", "Fraction of KV blocks held by running requests.",
                                value=s.get("kv_usage", 0.0))
        yield GaugeMetricFamily("rtp_kv_cache_blocks", "KV blocks per rank.", value=s.get("num_blocks", 0))
        query = s.get("prefix_query_tokens", 0)
        yield GaugeMetricFamily("rtp_prefix_cache_hit_rate",
                                "Prompt tokens served by the prefix cache / prompt tokens looked up (cumulative).",
                                value=s.get("prefix_hit_tokens", 0) / query if query else 0.0)
        yield CounterMetricFamily("rtp_preemptions", "Requests preempted to free KV blocks.",
                                  value=s.get("num_preemptions", 0))
        if "spec_num_drafts" not in s:
            return  # speculative decoding is off
        yield CounterMetricFamily("rtp_spec_decode_drafts", "Sequence-steps that verified draft tokens.",
                                  value=s["spec_num_drafts"])
        yield CounterMetricFamily("rtp_spec_decode_draft_tokens", "Draft tokens verified.",
                                  value=s.get("spec_num_draft_tokens", 0))
        yield CounterMetricFamily("rtp_spec_decode_accepted_tokens", "Draft tokens accepted.",
                                  value=s.get("spec_num_accepted_tokens", 0))
        yield CounterMetricFamily("rtp_spec_decode_refused_draft_tokens",
                                  "Draft tokens dropped before verification: the request's grammar refuses them.",
                                  value=s.get("spec_num_refused_draft_tokens", 0))
        per_pos = CounterMetricFamily("rtp_spec_decode_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by position in the draft.", labels=["position"])
        for pos, value in spec_positions(s):
            per_pos.add_metric([str(pos)], value)
        yield per_pos


class _ReplicaStatsCollector(Collector):
    """Data parallelism: each replica's gauges, labelled ``replica`` (the unlabelled ones are the totals)."""

    _GAUGES = (("num_running", "rtp_replica_requests_running", "Requests in the replica's running batch."),
               ("num_waiting", "rtp_replica_requests_waiting", "Requests queued on the replica."),
               ("kv_usage", "rtp_replica_kv_cache_usage_ratio", "Fraction of the replica's KV blocks in use."),
               ("prefix_hit_tokens", "rtp_replica_prefix_cache_hit_tokens",
                "Prompt tokens the replica served from its prefix cache (cumulative)."),
               ("prefix_query_tokens", "rtp_replica_prefix_cache_query_tokens",
                "Prompt tokens the replica looked up in its prefix cache (cumulative)."),
               ("routed_requests", "rtp_replica_routed_requests",
                "Requests this API frontend sent to the replica (cumulative)."))

    def __init__(self, replica_stats: Callable[[], list[dict[str, float]]]) -> None:
        self._replica_stats = replica_stats

    def collect(self) -> Iterator[Metric]:
        replicas = self._replica_stats()
        if len(replicas) < 2:
            return
        for key, name, doc in self._GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["replica"])
            for i, s in enumerate(replicas):
                family.add_metric([str(i)], s.get(key, 0.0))
            yield family


class ServerMetrics:
    """The server's metrics; ``stats`` returns the engine's latest stats dict.

    Every series is exported under rtp's name and under vLLM's (rtp.server.vllm_metrics), labelled
    with ``model_name``.
    """

    def __init__(self, stats: Callable[[], Mapping[str, float]], model_name: str = "rtp",
                 replica_stats: Callable[[], list[dict[str, float]]] | None = None) -> None:
        self.registry = CollectorRegistry()  # what /metrics renders
        mp_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        # Multiprocess mode: this process's series go to its files (a registry never rendered), and
        # the rendered registry reads every frontend's files.
        r = CollectorRegistry() if mp_dir else self.registry
        self._merged = multiprocess.MultiProcessCollector(self.registry, path=mp_dir) if mp_dir else None
        self.prompt_tokens = Counter("rtp_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("rtp_generation_tokens", "Generated tokens.", registry=r)
        self.requests = Counter("rtp_requests_finished", "Finished requests by finish reason.",
                                ["finish_reason"], registry=r)
        self.errors = Counter("rtp_http_errors", "Error responses by HTTP status.", ["status"], registry=r)
        self.ttft = Histogram("rtp_time_to_first_token_seconds", "Time from arrival to the first token.",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("rtp_inter_token_latency_seconds", "Time between two tokens of a request.",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("rtp_e2e_request_latency_seconds", "Time from arrival to the last token.",
                             buckets=_E2E_BUCKETS, registry=r)
        self.tpot = Histogram("rtp_request_time_per_output_token_seconds",
                              "Per request: (last token - first token) / (output tokens - 1).",
                              buckets=_ITL_BUCKETS, registry=r)
        self.registry.register(_EngineStatsCollector(stats))
        if replica_stats is not None:
            self.registry.register(_ReplicaStatsCollector(replica_stats))
        self.registry.register(VllmMetricsCollector(self, stats, model_name))

    def samples(self, metric: Counter | Histogram) -> list[Any]:
        """The samples of one of this server's counters or histograms (summed over the frontends)."""
        if self._merged is None:
            return [x for family in metric.collect() for x in family.samples]
        name = metric._name  # noqa: SLF001 - the family name, as the files store it
        return [x for family in self._merged.collect() if family.name == name for x in family.samples]

    def observe_tokens(self, num_tokens: int, seconds: float) -> None:
        """``num_tokens`` new tokens arrived ``seconds`` after the previous ones."""
        if num_tokens > 0:
            self.generation_tokens.inc(num_tokens)
            for _ in range(num_tokens):
                self.itl.observe(seconds / num_tokens)

    def observe_first_tokens(self, num_tokens: int) -> None:
        """The first output of a request brought ``num_tokens`` tokens (no inter-token gap before them)."""
        if num_tokens > 0:
            self.generation_tokens.inc(num_tokens)

    def observe_finished(self, out: RequestOutput | None, num_prompt_tokens: int, finish_reason: str) -> None:
        """A request ended (``out`` is its last output, None when none arrived)."""
        self.prompt_tokens.inc(num_prompt_tokens)
        self.requests.labels(finish_reason=finish_reason).inc()
        if out is None:
            return
        if out.first_token_time is not None and out.arrival_time:
            self.ttft.observe(max(0.0, out.first_token_time - out.arrival_time))
        if out.finish_time is not None and out.arrival_time:
            self.e2e.observe(max(0.0, out.finish_time - out.arrival_time))
        tokens = out.num_completion_tokens
        if out.finish_time is not None and out.first_token_time is not None and tokens > 1:
            self.tpot.observe(max(0.0, out.finish_time - out.first_token_time) / (tokens - 1))

    def observe_error(self, status: int) -> None:
        self.errors.labels(status=str(status)).inc()

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
