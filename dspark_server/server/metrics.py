"""Prometheus metric families (``dspark_`` prefix, base units, ``_total`` counters).

Histograms are fed sample by sample through ``EngineStats`` observers (engine thread); counters
and gauges are read from ``EngineStats`` and the backend at scrape time, so a scrape always sees
the live KV pool and queue lengths. Names follow vLLM's / SGLang's where one exists (see
docs/metrics.md for the full list and the equivalents).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from dspark_server.engine.stats import load_bucket

if TYPE_CHECKING:
    from dspark_server.engine.backend import Backend
    from dspark_server.engine.stats import EngineStats

disable_created_metrics()  # no *_created series: they double the exposition for nothing

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
VERIFY_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
LENGTH_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 14, 16, 24, 32)
RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)
MEAN_LEN_BUCKETS = (0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0, 12.0, 16.0)

# Engine observation name -> (metric name, help, buckets)
HISTOGRAMS: dict[str, tuple[str, str, tuple[float, ...]]] = {
    "ttft_seconds": (
        "dspark_time_to_first_token_seconds",
        "Time from arrival to the first generated token.",
        LATENCY_BUCKETS,
    ),
    "itl_seconds": (
        "dspark_inter_token_latency_seconds",
        "Time between successive token deliveries of a request (a speculative round "
        "that emits several tokens is one delivery).",
        LATENCY_BUCKETS,
    ),
    "tpot_seconds": (
        "dspark_time_per_output_token_seconds",
        "Per finished request: (finish - first token) / (output tokens - 1).",
        LATENCY_BUCKETS,
    ),
    "e2e_seconds": (
        "dspark_e2e_request_latency_seconds",
        "Per finished request: arrival to finish.",
        LATENCY_BUCKETS,
    ),
    "queue_seconds": (
        "dspark_request_queue_time_seconds",
        "Time from arrival to the first schedule.",
        LATENCY_BUCKETS,
    ),
    "step_seconds": (
        "dspark_engine_step_seconds",
        "Wall time of one engine step (draft, plan, forward, sample, commit).",
        LATENCY_BUCKETS,
    ),
    "forward_seconds": ("dspark_model_forward_seconds", "Wall time of one target forward.", LATENCY_BUCKETS),
    "batch_tokens": (
        "dspark_batch_tokens",
        "Tokens in one target forward (prefill chunks + decodes + verification blocks).",
        TOKEN_BUCKETS,
    ),
    "request_prompt_tokens": (
        "dspark_request_prompt_tokens",
        "Per finished request: prompt tokens.",
        TOKEN_BUCKETS,
    ),
    "request_generation_tokens": (
        "dspark_request_generation_tokens",
        "Per finished request: generated tokens.",
        TOKEN_BUCKETS,
    ),
    "acceptance_length": (
        "dspark_spec_accept_length",
        "Tokens emitted per speculative round per request (accepted drafts + the corrected/bonus token).",
        LENGTH_BUCKETS,
    ),
    "verify_tokens_per_step": (
        "dspark_spec_verify_tokens_per_step",
        "Verification budget: draft tokens admitted for verification in one "
        "engine step with decoding requests (sum of l).",
        VERIFY_BUCKETS,
    ),
    "plan_predicted_step_seconds": (
        "dspark_spec_plan_predicted_step_seconds",
        "The cost model's price of a speculative step it planned (draft + forward + bookkeeping).",
        LATENCY_BUCKETS,
    ),
    "plan_step_time_ratio": (
        "dspark_spec_plan_step_time_ratio",
        "Measured / predicted wall time of a planned speculative step (1 = the cost model is right).",
        RATIO_BUCKETS,
    ),
    "request_mean_verify_len": (
        "dspark_spec_request_verify_length_mean",
        "Per finished request: mean draft tokens verified per round (l).",
        MEAN_LEN_BUCKETS,
    ),
}


class ServerView(Protocol):
    """What a scrape reads from the server's state (server/state.py; not imported here, so the
    state module can depend on this one without a cycle)."""

    @property
    def ready(self) -> bool: ...

    @property
    def draining(self) -> bool: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def backend(self) -> Backend | None: ...


class _Collector(Collector):
    """Counters and gauges read at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        state = self.metrics.state()
        yield _gauge("dspark_server_ready", "1 when /ready answers 200.", 1.0 if state.ready else 0.0)
        yield _gauge(
            "dspark_server_draining",
            "1 after SIGTERM, while in-flight requests finish.",
            1.0 if state.draining else 0.0,
        )
        yield _gauge("dspark_http_requests_in_flight", "/v1/* requests being handled.", state.in_flight)
        backend = state.backend
        if backend is None:
            return
        yield from _engine_families(backend)


def _engine_families(backend: Backend) -> Iterator[Metric]:
    yield from _request_families(backend.stats)
    yield from _load_families(backend)
    yield from _spec_families(backend)


def _request_families(s: EngineStats) -> Iterator[Metric]:
    """Counters of tokens, steps, preemptions, finished requests and speculative choices."""
    yield _counter(
        "dspark_prompt_tokens",
        "Prompt tokens prefilled (recomputation after preemption included).",
        s.prompt_tokens,
    )
    yield _counter(
        "dspark_prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache (each prompt but its last token).",
        s.prefix_cache_queries,
    )
    yield _counter(
        "dspark_prefix_cache_hits",
        "Prompt tokens found in the prefix cache (their prefill skipped).",
        s.prefix_cache_hits,
    )
    yield _counter(
        "dspark_generation_tokens", "Tokens generated (delivered to requests).", s.generation_tokens
    )
    yield _counter("dspark_engine_steps", "Engine steps that ran a forward.", s.steps)
    yield _counter(
        "dspark_num_preemptions", "Requests preempted (KV dropped, recomputed later).", s.preemptions
    )
    fam = CounterMetricFamily(
        "dspark_request_success",
        "Requests finished, by finish reason (stop, length, abort, error).",
        labels=["finished_reason"],
    )
    for reason, n in sorted(dict(s.finished_by_reason).items()):
        fam.add_metric([reason], n)
    yield fam
    choices = CounterMetricFamily(
        "dspark_spec_steps",
        "Speculative-mode steps with decoding requests, by load (decoding requests, power-of-two "
        "bucket) and choice: plain (nothing drafted), none (drafted, no draft verified), drafts.",
        labels=["running", "choice"],
    )
    for (bucket, choice), n in sorted(dict(s.spec_steps_by_choice).items()):
        choices.add_metric([bucket, choice], n)
    yield choices


def _load_families(backend: Backend) -> Iterator[Metric]:
    """Queue and KV cache gauges, read live."""
    load = backend.load()
    yield _gauge("dspark_num_requests_running", "Requests in the running set.", load.running)
    yield _gauge("dspark_num_requests_waiting", "Requests waiting for admission.", load.waiting)
    yield _gauge(
        "dspark_num_requests_admitted",
        "Requests accepted and not finished (running, waiting, or about to enter the engine).",
        load.admitted,
    )
    yield _gauge(
        "dspark_max_requests_admitted",
        "Admission limit: max_running + max_queued; more requests get 429.",
        load.max_running + load.max_queued,
    )
    yield _gauge("dspark_kv_cache_total_pages", "KV cache capacity in pages.", load.kv_total_pages)
    yield _gauge("dspark_kv_cache_free_pages", "Free KV cache pages.", load.kv_free_pages)
    yield _gauge(
        "dspark_kv_cache_used_pages", "KV cache pages in use.", load.kv_total_pages - load.kv_free_pages
    )
    used = 1.0 - load.kv_free_pages / load.kv_total_pages if load.kv_total_pages else 0.0
    yield _gauge("dspark_kv_cache_usage_ratio", "Fraction of KV cache pages in use (0..1).", used)


def _spec_families(backend: Backend) -> Iterator[Metric]:
    """The speculative decoder's configuration, counters, SPS curve and calibration drift."""
    s = backend.stats
    spec = backend.spec_snapshot()
    if spec is None:
        return
    info = GaugeMetricFamily(
        "dspark_spec_planner_info", "Speculative decoding planner mode (value is always 1).", labels=["mode"]
    )
    info.add_metric([spec.mode], 1.0)
    yield info
    yield _gauge("dspark_spec_gamma", "Draft block size (drafts proposed per round).", spec.gamma)
    yield _counter(
        "dspark_spec_decode_num_drafts", "Speculative rounds (one per request per step).", s.spec_rounds
    )
    yield _counter("dspark_spec_decode_num_draft_tokens", "Draft tokens proposed.", s.spec_draft_tokens)
    yield _counter(
        "dspark_spec_decode_num_verified_tokens",
        "Draft tokens admitted for verification by the planner.",
        s.spec_verified_tokens,
    )
    yield _counter("dspark_spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.spec_accepted_tokens)
    yield _counter(
        "dspark_spec_decode_num_emitted_tokens",
        "Tokens emitted by speculative rounds (accepted + corrected/bonus, after stop conditions).",
        s.spec_emitted_tokens,
    )
    accepted, verified = list(s.accepted_per_position), list(s.verified_per_position)
    acc_fam = CounterMetricFamily(
        "dspark_spec_decode_num_accepted_tokens_per_pos",
        "Accepted draft tokens by draft position (0 = first draft).",
        labels=["position"],
    )
    ver_fam = CounterMetricFamily(
        "dspark_spec_decode_num_verified_tokens_per_pos",
        "Verified draft tokens by draft position (0 = first draft).",
        labels=["position"],
    )
    for k in range(spec.gamma):
        acc_fam.add_metric([str(k)], accepted[k] if k < len(accepted) else 0)
        ver_fam.add_metric([str(k)], verified[k] if k < len(verified) else 0)
    yield acc_fam
    yield ver_fam
    yield _gauge(
        "dspark_spec_verify_tokens",
        "Verification budget of the latest step with decoding "
        "requests: draft tokens admitted for verification (sum of l).",
        s.last_verify_tokens,
    )
    yield _gauge(
        "dspark_spec_verify_length_mean",
        "Mean l (draft tokens verified per decoding request) in the latest step with decoding requests.",
        s.last_mean_verify_len,
    )
    mean_acc = s.spec_emitted_tokens / s.spec_rounds if s.spec_rounds else 0.0
    yield _gauge(
        "dspark_spec_accept_length_mean",
        "Mean tokens emitted per round since start (SGLang's spec_accept_length).",
        mean_acc,
    )

    if spec.mode == "dspark":  # (no samples with --no-draft-gate)
        gate = GaugeMetricFamily(
            "dspark_draft_gate_tokens_per_second",
            "dspark mode's draft gate: tokens per second of one request in drafting steps (at the "
            "load bucket's mean forecast) and in plain steps, by load (decoding requests, "
            "power-of-two bucket); it drafts for everyone where drafting's is higher.",
            labels=["running", "choice"],
        )
        for low, (draft_rate, plain_rate) in sorted(spec.gate_rates.items()):
            bucket = load_bucket(low)
            for choice, rate in (("draft", draft_rate), ("plain", plain_rate)):
                if math.isfinite(rate):
                    gate.add_metric([bucket, choice], rate)
        yield gate
        times = GaugeMetricFamily(
            "dspark_draft_gate_step_seconds",
            "dspark mode's draft gate: the step times it prices each choice with, by load "
            "(decoding requests, power-of-two bucket): a step's own time (part=step) and the "
            "engine loop's time after it until the next step (part=loop).",
            labels=["running", "choice", "part"],
        )
        for low, parts in sorted(spec.gate_times.items()):
            for (choice, part), seconds in sorted(parts.items()):
                if math.isfinite(seconds):
                    times.add_metric([load_bucket(low), choice, part], seconds)
        yield times

    if spec.sps_curve:
        families = {
            "base": GaugeMetricFamily(
                "dspark_spec_sps_base_steps_per_second",
                "Profiled SPS curve: verify steps per second at a batch size.",
                labels=["batch_tokens"],
            ),
            "live": GaugeMetricFamily(
                "dspark_spec_sps_live_steps_per_second",
                "SPS curve the planner uses now (profile blended with live timings).",
                labels=["batch_tokens"],
            ),
            "measured": GaugeMetricFamily(
                "dspark_spec_sps_measured_steps_per_second",
                "1 / median of recent step times at this probe (probes with samples only).",
                labels=["batch_tokens"],
            ),
            "samples": GaugeMetricFamily(
                "dspark_spec_sps_samples", "Live step timings held for this probe.", labels=["batch_tokens"]
            ),
        }
        for p in spec.sps_curve:
            label = [str(p.batch_tokens)]
            families["base"].add_metric(label, p.base_steps_per_sec)
            families["live"].add_metric(label, p.live_steps_per_sec)
            if p.measured_steps_per_sec is not None:
                families["measured"].add_metric(label, p.measured_steps_per_sec)
            families["samples"].add_metric(label, p.num_samples)
        yield from families.values()

    drift = {
        "predicted": GaugeMetricFamily(
            "dspark_spec_calibration_predicted_acceptance",
            "Mean predicted "
            "prefix survival (calibrated confidence) at a draft position, "
            "over a recent window.",
            labels=["position"],
        ),
        "realised": GaugeMetricFamily(
            "dspark_spec_calibration_realised_acceptance",
            "Fraction of verified rounds whose drafts up to this position were all accepted, same window.",
            labels=["position"],
        ),
        "gap": GaugeMetricFamily(
            "dspark_spec_calibration_gap", "predicted - realised (> 0: over-confident).", labels=["position"]
        ),
        "samples": GaugeMetricFamily(
            "dspark_spec_calibration_samples",
            "Rounds in the window that verified this position.",
            labels=["position"],
        ),
    }
    for d in spec.drift:
        label = [str(d.position - 1)]  # 0-based, like the per-position counters
        drift["samples"].add_metric(label, d.count)
        if d.count and not math.isnan(d.mean_predicted):
            drift["predicted"].add_metric(label, d.mean_predicted)
            drift["realised"].add_metric(label, d.mean_realised)
            drift["gap"].add_metric(label, d.gap)
    yield from drift.values()


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


class Metrics:
    """The registry behind ``/metrics``. ``state`` returns the server state (ready, draining,
    backend) at scrape time; ``attach`` subscribes the histograms to a backend's statistics."""

    def __init__(self, state: Callable[[], ServerView]) -> None:
        self.state = state
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(self))
        self.requests = Counter(
            "dspark_requests",
            "HTTP responses by endpoint (route path, or 'other') and status code.",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.histograms = {
            key: Histogram(name, doc, buckets=buckets, registry=self.registry)
            for key, (name, doc, buckets) in HISTOGRAMS.items()
        }
        self._attached: set[int] = set()

    def attach(self, backend: Backend) -> None:
        if id(backend.stats) not in self._attached:
            self._attached.add(id(backend.stats))
            backend.stats.observers.append(self._observe)

    def _observe(self, name: str, value: float) -> None:
        hist = self.histograms.get(name)
        if hist is not None:
            hist.observe(value)

    def count_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
