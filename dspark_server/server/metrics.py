"""Prometheus metric families (``dspark_`` prefix, base units), filled from engine statistics."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from dspark_server.engine.stats import EngineStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)

# Engine observation name -> (metric name, help, buckets)
HISTOGRAMS: dict[str, tuple[str, str, tuple[float, ...]]] = {
    "ttft_seconds": ("dspark_time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS),
    "tpot_seconds": ("dspark_time_per_output_token_seconds", "Mean inter-token latency per request.",
                     LATENCY_BUCKETS),
    "e2e_seconds": ("dspark_e2e_request_latency_seconds", "End-to-end request latency.",
                    LATENCY_BUCKETS),
    "queue_seconds": ("dspark_request_queue_time_seconds", "Time from arrival to first schedule.",
                      LATENCY_BUCKETS),
    "step_seconds": ("dspark_engine_step_seconds", "Engine step wall time.", LATENCY_BUCKETS),
    "batch_tokens": ("dspark_batch_tokens", "Tokens in one target forward.", TOKEN_BUCKETS),
    "acceptance_length": ("dspark_spec_acceptance_length",
                          "Tokens emitted per speculative round per request (bonus included).",
                          tuple(float(i) for i in range(1, 17))),
}


class _EngineCollector(Collector):
    def __init__(self, stats: EngineStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        s = self.stats
        yield _counter("dspark_prompt_tokens", "Prompt tokens processed.", s.prompt_tokens)
        yield _counter("dspark_generation_tokens", "Tokens generated.", s.generation_tokens)
        yield _counter("dspark_engine_steps", "Engine steps run.", s.steps)
        yield _counter("dspark_spec_rounds", "Speculative rounds (per request).", s.spec_rounds)
        yield _counter("dspark_spec_draft_tokens", "Draft tokens proposed.", s.spec_draft_tokens)
        yield _counter("dspark_spec_verified_tokens", "Draft tokens sent to verification.",
                       s.spec_verified_tokens)
        yield _counter("dspark_spec_accepted_tokens", "Draft tokens accepted.", s.spec_accepted_tokens)
        yield _gauge("dspark_num_requests_running", "Requests in the running set.", s.num_running)
        yield _gauge("dspark_num_requests_waiting", "Requests waiting for admission.", s.num_waiting)
        yield _gauge("dspark_kv_cache_total_pages", "KV cache capacity in pages.", s.kv_total_pages)
        yield _gauge("dspark_kv_cache_free_pages", "Free KV cache pages.", s.kv_free_pages)
        used = 1.0 - s.kv_free_pages / s.kv_total_pages if s.kv_total_pages else 0.0
        yield _gauge("dspark_kv_cache_usage_ratio", "Fraction of KV cache pages in use.", used)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


class Metrics:
    def __init__(self, stats: EngineStats) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats))
        self.requests = Counter("dspark_requests", "HTTP requests by endpoint and status.",
                                ["endpoint", "status"], registry=self.registry)
        self.histograms = {
            key: Histogram(name, doc, buckets=buckets, registry=self.registry)
            for key, (name, doc, buckets) in HISTOGRAMS.items()
        }
        stats.observers.append(self._observe)

    def _observe(self, name: str, value: float) -> None:
        hist = self.histograms.get(name)
        if hist is not None:
            hist.observe(value)

    def count_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
