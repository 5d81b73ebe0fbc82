"""rtp's metrics under vLLM's names, so that dashboards and alerts written for vLLM work unchanged.

vLLM (v1 engine) labels every series with ``model_name`` and ``engine`` (the engine index, "0"
for a single engine); the names and units below are vLLM's (``vllm/v1/metrics/loggers.py``):

==========================================  ==========================================
vLLM                                        from rtp
==========================================  ==========================================
vllm:num_requests_running / _waiting        the engine's running / waiting requests
vllm:kv_cache_usage_perc                    KV blocks in use, 0..1 (1 = 100 %)
vllm:prefix_cache_queries / _hits           prompt tokens looked up / found in the prefix cache
vllm:num_preemptions                        preempted requests
vllm:prompt_tokens, vllm:generation_tokens  rtp_prompt_tokens, rtp_generation_tokens
vllm:request_success{finished_reason}       rtp_requests_finished{finish_reason}
vllm:time_to_first_token_seconds            rtp_time_to_first_token_seconds
vllm:inter_token_latency_seconds            rtp_inter_token_latency_seconds
vllm:time_per_output_token_seconds          the same (vLLM's older name of that histogram)
vllm:request_time_per_output_token_seconds  rtp_request_time_per_output_token_seconds
vllm:e2e_request_latency_seconds            rtp_e2e_request_latency_seconds
==========================================  ==========================================

The series are read from rtp's own metric objects at scrape time (one observation, two names),
so the two sets can never disagree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from rtp.server.metrics import ServerMetrics

_LABELS = ["model_name", "engine"]


def spec_positions(stats: Mapping[str, float]) -> list[tuple[int, float]]:
    """(position, accepted drafts) of the stats' ``spec_accepted_pos_<i>`` entries, by position."""
    prefix = "spec_accepted_pos_"
    return sorted((int(k[len(prefix):]), v) for k, v in stats.items() if k.startswith(prefix))


class VllmMetricsCollector(Collector):
    """Yields vLLM-named copies of a ServerMetrics' series (see the module docstring)."""

    def __init__(self, metrics: ServerMetrics, stats: Callable[[], Mapping[str, float]], model_name: str) -> None:
        self._m = metrics
        self._stats = stats
        self._labels = [model_name, "0"]

    def _counter_total(self, metric: Counter) -> float:
        return float(sum(s.value for s in self._m.samples(metric) if s.name.endswith("_total")))

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=_LABELS)
        g.add_metric(self._labels, value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=_LABELS)
        c.add_metric(self._labels, value)
        return c

    def _histogram(self, name: str, doc: str, source: Histogram) -> HistogramMetricFamily:
        samples = self._m.samples(source)
        buckets = [(s.labels["le"], s.value) for s in samples if s.name.endswith("_bucket")]
        total = next((s.value for s in samples if s.name.endswith("_sum")), 0.0)
        h = HistogramMetricFamily(name, doc, labels=_LABELS)
        h.add_metric(self._labels, buckets, total)
        return h

    def collect(self) -> Iterator[Metric]:
        s = self._stats() or {}
        m = self._m
        yield self._gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                          s.get("num_running", 0))
        yield self._gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                          s.get("num_waiting", 0))
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                          s.get("kv_usage", 0.0))
        yield self._counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                            s.get("prefix_query_tokens", 0))
        yield self._counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                            s.get("prefix_hit_tokens", 0))
        yield self._counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                            s.get("num_preemptions", 0))
        if "spec_num_drafts" in s:  # speculative decoding is on
            yield self._counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.",
                                s["spec_num_drafts"])
            yield self._counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
                                s.get("spec_num_draft_tokens", 0))
            yield self._counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                                s.get("spec_num_accepted_tokens", 0))
            per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                          "Accepted tokens per draft position.", labels=[*_LABELS, "position"])
            for pos, value in spec_positions(s):
                per_pos.add_metric([*self._labels, str(pos)], value)
            yield per_pos
        yield self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                            self._counter_total(m.prompt_tokens))
        yield self._counter("vllm:generation_tokens", "Number of generation tokens processed.",
                            self._counter_total(m.generation_tokens))
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=[*_LABELS, "finished_reason"])
        for sample in m.samples(m.requests):
            if sample.name.endswith("_total"):
                success.add_metric([*self._labels, sample.labels["finish_reason"]], sample.value)
        yield success
        yield self._histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              m.ttft)
        yield self._histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                              m.itl)
        yield self._histogram("vllm:time_per_output_token_seconds",
                              "Histogram of time per output token in seconds (the inter-token latency).",
                              m.itl)
        yield self._histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.",
                              m.tpot)
        yield self._histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                              m.e2e)
