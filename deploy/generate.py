#!/usr/bin/env python3
"""Writes the two generated deployment files from their sources:

* ``deploy/grafana/dashboards/dspark.json`` -- the Grafana dashboard, from the panel list below;
* ``deploy/k8s/base/prometheusrule.yaml`` -- the Prometheus Operator copy of
  ``deploy/prometheus/rules/dspark.rules.yml``.

    python deploy/generate.py          # rewrite both
    python deploy/generate.py --check  # exit 1 if either is stale (tests/test_deploy_*.py run this)

Metric names are those of docs/metrics.md. Every query filters on the dashboard's ``$instance`` and
``$model`` variables; ``$__rate_interval`` is Grafana's window for rate() (at least four scrape
intervals) and ``$__range`` the dashboard's time range.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

DEPLOY = Path(__file__).resolve().parent
DASHBOARD_PATH = DEPLOY / "grafana" / "dashboards" / "dspark.json"
RULES_PATH = DEPLOY / "prometheus" / "rules" / "dspark.rules.yml"
PROMETHEUS_RULE_PATH = DEPLOY / "k8s" / "base" / "prometheusrule.yaml"

DS = {"type": "prometheus", "uid": "${datasource}"}
S = 'instance=~"$instance", model=~"$model"'  # the selector every query carries
RI = "$__rate_interval"
SD = "dspark_spec_decode_num_"  # prefix of the speculative counters
LAST = {"calcs": ["lastNotNull"], "fields": "", "values": False}  # stat / bar gauge reduction


def q(expr: str, legend: str = "", *, instant: bool = False, fmt: str = "time_series") -> dict[str, Any]:
    return {"expr": expr, "legendFormat": legend, "instant": instant, "range": not instant, "format": fmt}


def ratio(num: str, den: str, by: str = "instance", window: str = RI) -> str:
    return f"sum by ({by}) (rate({num}{{{S}}}[{window}]))\n  / sum by ({by}) (rate({den}{{{S}}}[{window}]))"


def quantile(qv: float, metric: str, by: str = "le") -> str:
    return f"histogram_quantile({qv}, sum by ({by}) (rate({metric}_bucket{{{S}}}[{RI}])))"


def percentiles(metric: str) -> list[dict[str, Any]]:
    return [q(quantile(v, metric), f"p{round(v * 100)}") for v in (0.5, 0.9, 0.99)]


# (type, title, description, queries, unit, width, extra panel fields)
Panel = tuple[str, str, str, list[dict[str, Any]], str, int, dict[str, Any]]


def _xy(x_field: str, transformations: list[dict[str, Any]], lines: bool) -> dict[str, Any]:
    return {
        "options": {
            "seriesMapping": "auto",
            "dims": {"x": x_field},
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "none"},
        },
        "transformations": transformations,
        "custom": {"show": "points+lines" if lines else "points", "pointSize": {"fixed": 6}},
    }


def _number(field: str) -> dict[str, Any]:
    return {
        "id": "convertFieldType",
        "options": {"conversions": [{"targetField": field, "destinationType": "number"}], "fields": {}},
    }


def _sort(field: str) -> dict[str, Any]:
    return {"id": "sortBy", "options": {"sort": [{"field": field, "desc": False}]}}


SECTIONS: list[tuple[str, list[Panel]]] = [
    (
        "Throughput and load",
        [
            (
                "timeseries",
                "Output tokens/s",
                "Generated tokens delivered to requests per second (and prompt tokens prefilled), per replica.",
                [
                    q(
                        f"sum by (instance) (rate(dspark_generation_tokens_total{{{S}}}[{RI}]))",
                        "{{instance}} output",
                    ),
                    q(
                        f"sum by (instance) (rate(dspark_prompt_tokens_total{{{S}}}[{RI}]))",
                        "{{instance}} prompt",
                    ),
                ],
                "none",
                8,
                {},
            ),
            (
                "xychart",
                "Output TPS vs concurrency (running requests)",
                "Each point is one moment: x = requests in the running set, y = output tokens/s, summed over "
                "the selected replicas (select one instance for one replica's curve). Throughput should "
                "rise with concurrency until the engine saturates.",
                [
                    q(f"sum(rate(dspark_generation_tokens_total{{{S}}}[{RI}]))", "output tokens/s"),
                    q(f"sum(avg_over_time(dspark_num_requests_running{{{S}}}[{RI}]))", "running requests"),
                ],
                "none",
                8,
                _xy(
                    "running requests",
                    [{"id": "joinByField", "options": {"byField": "Time", "mode": "outer"}}],
                    lines=False,
                ),
            ),
            (
                "xychart",
                "Output TPS by running-request count",
                "Mean output tokens/s of a replica while it ran n requests (recording rule "
                "dspark:output_tokens_per_second:by_running, averaged over the dashboard range and the "
                "selected replicas): the throughput-vs-concurrency curve.",
                [
                    q(
                        f"avg by (running) (avg_over_time(dspark:output_tokens_per_second:by_running{{{S}}}[$__range]))",
                        "{{running}}",
                        instant=True,
                        fmt="table",
                    )
                ],
                "none",
                8,
                _xy(
                    "running",
                    [
                        {
                            "id": "organize",
                            "options": {
                                "excludeByName": {"Time": True},
                                "renameByName": {"Value": "output tokens/s"},
                            },
                        },
                        _number("running"),
                        _sort("running"),
                    ],
                    lines=True,
                ),
            ),
            (
                "timeseries",
                "Queue depth: running, waiting and admitted requests",
                "running: in the running set (<= --max-running); waiting: queued for admission (what the "
                "HorizontalPodAutoscaler scales on); admitted: accepted and not finished; limit: "
                "--max-running + --max-queued, past which requests get 429.",
                [
                    q(f"sum by (instance) (dspark_num_requests_running{{{S}}})", "{{instance}} running"),
                    q(f"sum by (instance) (dspark_num_requests_waiting{{{S}}})", "{{instance}} waiting"),
                    q(f"sum by (instance) (dspark_num_requests_admitted{{{S}}})", "{{instance}} admitted"),
                    q(f"sum by (instance) (dspark_max_requests_admitted{{{S}}})", "{{instance}} limit"),
                ],
                "none",
                8,
                {},
            ),
            (
                "timeseries",
                "KV cache usage",
                "Share of KV cache pages in use. Near 100 % the scheduler preempts requests (see "
                "preemptions in the Engine row).",
                [q(f"max by (instance) (dspark_kv_cache_usage_ratio{{{S}}})", "{{instance}}")],
                "percentunit",
                8,
                {},
            ),
            (
                "timeseries",
                "Error rates: 4xx / 5xx responses per second",
                "HTTP responses with an error status, by status code (400 invalid request, 401 bad key, "
                "413 body too large, 429 admission limit reached, 503 loading or draining, 5xx server "
                "errors).",
                [
                    q(
                        f'sum by (status) (rate(dspark_requests_total{{{S}, status=~"4..|5.."}}[{RI}]))',
                        "{{status}}",
                    )
                ],
                "reqps",
                8,
                {},
            ),
            (
                "timeseries",
                "Error ratio and overload ratio",
                "Share of responses that were errors (4xx/5xx) and share refused with 429 (recording rules, "
                "1m windows).",
                [
                    q(f"max by (instance) (dspark:request_error_ratio:rate1m{{{S}}})", "{{instance}} errors"),
                    q(f"max by (instance) (dspark:request_overload_ratio:rate1m{{{S}}})", "{{instance}} 429"),
                ],
                "percentunit",
                8,
                {},
            ),
            (
                "timeseries",
                "Finished requests/s by reason",
                "stop (EOS / stop string), length (max_tokens), abort (client went away), error.",
                [
                    q(
                        f"sum by (finished_reason) (rate(dspark_request_success_total{{{S}}}[{RI}]))",
                        "{{finished_reason}}",
                    )
                ],
                "reqps",
                8,
                {},
            ),
        ],
    ),
    (
        "Speculative decoding",
        [
            (
                "stat",
                "Planner mode and draft block size γ",
                "The verification planner (fixed, threshold or dspark) and γ, the drafts proposed per round.",
                [
                    q(f"max by (mode) (dspark_spec_planner_info{{{S}}})", "{{mode}}", instant=True),
                    q(f"max(dspark_spec_gamma{{{S}}})", "γ", instant=True),
                ],
                "none",
                6,
                {"options": {"textMode": "value_and_name", "colorMode": "none", "reduceOptions": LAST}},
            ),
            (
                "timeseries",
                "Acceptance length (mean tokens per round)",
                "Tokens emitted per speculative round of a request (accepted drafts + 1 corrected/bonus "
                "token): over the rate window and since start. γ + 1 is the ceiling.",
                [
                    q(
                        ratio("dspark_spec_accept_length_sum", "dspark_spec_accept_length_count"),
                        "{{instance}} window",
                    ),
                    q(
                        f"max by (instance) (dspark_spec_accept_length_mean{{{S}}})",
                        "{{instance}} since start",
                    ),
                    q(f"max(dspark_spec_gamma{{{S}}}) + 1", "γ + 1"),
                ],
                "none",
                9,
                {},
            ),
            (
                "bargauge",
                "Acceptance length distribution",
                "Rounds by tokens emitted (histogram buckets le = 1, 2, 3, ...) over the dashboard range.",
                [
                    q(
                        f"sum by (le) (increase(dspark_spec_accept_length_bucket{{{S}}}[$__range]))",
                        "{{le}}",
                        instant=True,
                        fmt="heatmap",
                    )
                ],
                "none",
                9,
                {
                    "options": {
                        "orientation": "vertical",
                        "displayMode": "gradient",
                        "showUnfilled": True,
                        "reduceOptions": LAST,
                    }
                },
            ),
            (
                "heatmap",
                "Acceptance length distribution over time",
                "Rounds per second in each acceptance-length bucket.",
                [
                    q(
                        f"sum by (le) (rate(dspark_spec_accept_length_bucket{{{S}}}[{RI}]))",
                        "{{le}}",
                        fmt="heatmap",
                    )
                ],
                "none",
                12,
                {
                    "options": {
                        "calculate": False,
                        "yAxis": {"unit": "none"},
                        "cellGap": 1,
                        "color": {"mode": "scheme", "scheme": "Oranges"},
                    }
                },
            ),
            (
                "timeseries",
                "Verification budget: tokens admitted per step (Σℓ)",
                "Draft tokens the planner admits for verification in one engine step, summed over the "
                "decoding requests: mean and p90 over the rate window, and the latest step.",
                [
                    q(
                        ratio(
                            "dspark_spec_verify_tokens_per_step_sum",
                            "dspark_spec_verify_tokens_per_step_count",
                        ),
                        "{{instance}} mean",
                    ),
                    q(
                        quantile(0.9, "dspark_spec_verify_tokens_per_step", "le, instance"),
                        "{{instance}} p90",
                    ),
                    q(f"max by (instance) (dspark_spec_verify_tokens{{{S}}})", "{{instance}} latest step"),
                ],
                "none",
                12,
                {},
            ),
            (
                "timeseries",
                "Verification budget: verified drafts per request",
                "ℓ, the drafts a request verifies per round (mean over rounds, and per finished request), "
                "against γ; right axis: draft tokens verified per finished request.",
                [
                    q(ratio(f"{SD}verified_tokens_total", f"{SD}drafts_total"), "{{instance}} ℓ per round"),
                    q(
                        ratio(
                            "dspark_spec_request_verify_length_mean_sum",
                            "dspark_spec_request_verify_length_mean_count",
                        ),
                        "{{instance}} mean ℓ of finished requests",
                    ),
                    q(f"max(dspark_spec_gamma{{{S}}})", "γ"),
                    q(
                        f"max by (instance) (dspark:spec_verified_tokens_per_request:rate1m{{{S}}})",
                        "{{instance}} verified per request",
                    ),
                ],
                "none",
                12,
                {
                    "fieldConfig": {
                        "overrides": [
                            {
                                "matcher": {"id": "byRegexp", "options": ".*verified per request"},
                                "properties": [{"id": "custom.axisPlacement", "value": "right"}],
                            }
                        ]
                    }
                },
            ),
            (
                "timeseries",
                "Drafts verified and accepted",
                "verified: share of proposed drafts the planner admitted (the rest were skipped); "
                "accepted: share of verified drafts the target accepted.",
                [
                    q(
                        ratio(f"{SD}verified_tokens_total", f"{SD}draft_tokens_total"),
                        "{{instance}} verified / proposed",
                    ),
                    q(
                        ratio(f"{SD}accepted_tokens_total", f"{SD}verified_tokens_total"),
                        "{{instance}} accepted / verified",
                    ),
                ],
                "percentunit",
                12,
                {},
            ),
            (
                "timeseries",
                "Per-position acceptance rate",
                "Accepted / verified draft tokens at each draft position (0 = first draft).",
                [
                    q(
                        ratio(
                            f"{SD}accepted_tokens_per_pos_total",
                            f"{SD}verified_tokens_per_pos_total",
                            by="position",
                        ),
                        "position {{position}}",
                    )
                ],
                "percentunit",
                12,
                {},
            ),
            (
                "bargauge",
                "Per-position acceptance over the range",
                "Accepted / verified draft tokens by position over the dashboard range.",
                [
                    q(
                        f"sum by (position) (increase({SD}accepted_tokens_per_pos_total{{{S}}}[$__range]))"
                        f"\n  / sum by (position) (increase({SD}verified_tokens_per_pos_total{{{S}}}"
                        f"[$__range]))",
                        "position {{position}}",
                        instant=True,
                    )
                ],
                "percentunit",
                8,
                {
                    "options": {
                        "orientation": "vertical",
                        "displayMode": "gradient",
                        "showUnfilled": True,
                        "minVizHeight": 10,
                        "reduceOptions": LAST,
                    },
                    "fieldConfig": {"defaults": {"min": 0, "max": 1}},
                },
            ),
            (
                "timeseries",
                "Predicted vs realised acceptance (calibration drift)",
                "For each position: the calibrated confidence that drafts 0..position all survive "
                "(predicted, dashed) and the share of recent rounds where they did (realised).",
                [
                    q(
                        f"avg by (position) (dspark_spec_calibration_predicted_acceptance{{{S}}})",
                        "predicted pos {{position}}",
                    ),
                    q(
                        f"avg by (position) (dspark_spec_calibration_realised_acceptance{{{S}}})",
                        "realised pos {{position}}",
                    ),
                ],
                "percentunit",
                8,
                {
                    "fieldConfig": {
                        "overrides": [
                            {
                                "matcher": {"id": "byRegexp", "options": "predicted.*"},
                                "properties": [
                                    {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}}
                                ],
                            }
                        ]
                    }
                },
            ),
            (
                "timeseries",
                "Calibration gap (predicted − realised)",
                "Above 0 the calibration is over-confident and the planner verifies too much; re-run "
                "`dspark calibrate` when it drifts.",
                [q(f"avg by (position) (dspark_spec_calibration_gap{{{S}}})", "pos {{position}}")],
                "percentunit",
                8,
                {},
            ),
            (
                "xychart",
                "Live SPS curve (verify steps/s vs batch tokens)",
                "The planner's cost table: verify steps per second at each probed batch size -- profiled, "
                "live (profile blended with recent step timings, what the planner uses now) and measured "
                "(median of recent steps).",
                [
                    q(
                        f"avg by (batch_tokens) (dspark_spec_sps_live_steps_per_second{{{S}}})",
                        "live",
                        instant=True,
                        fmt="table",
                    ),
                    q(
                        f"avg by (batch_tokens) (dspark_spec_sps_base_steps_per_second{{{S}}})",
                        "profile",
                        instant=True,
                        fmt="table",
                    ),
                    q(
                        f"avg by (batch_tokens) (dspark_spec_sps_measured_steps_per_second{{{S}}})",
                        "measured",
                        instant=True,
                        fmt="table",
                    ),
                ],
                "none",
                12,
                _xy(
                    "batch_tokens",
                    [
                        {"id": "merge", "options": {}},
                        {
                            "id": "organize",
                            "options": {
                                "excludeByName": {"Time": True},
                                "renameByName": {
                                    "Value #A": "live",
                                    "Value #B": "profile",
                                    "Value #C": "measured",
                                },
                            },
                        },
                        _number("batch_tokens"),
                        _sort("batch_tokens"),
                    ],
                    lines=True,
                ),
            ),
            (
                "timeseries",
                "SPS live / profile by batch size",
                "How far live step timings have moved the planner's curve from the profile (clamped to "
                "0.5..2).",
                [
                    q(
                        f"avg by (batch_tokens) (dspark_spec_sps_live_steps_per_second{{{S}}})\n"
                        f"  / avg by (batch_tokens) (dspark_spec_sps_base_steps_per_second{{{S}}})",
                        "{{batch_tokens}} tokens",
                    )
                ],
                "none",
                12,
                {},
            ),
        ],
    ),
    (
        "Latency",
        [
            (
                "timeseries",
                "Time to first token (TTFT) p50 / p90 / p99",
                "Arrival to first generated token.",
                percentiles("dspark_time_to_first_token_seconds"),
                "s",
                8,
                {},
            ),
            (
                "timeseries",
                "Inter-token latency (ITL) p50 / p90 / p99",
                "Time between successive token deliveries of a request (a round that emits several tokens "
                "is one delivery).",
                percentiles("dspark_inter_token_latency_seconds"),
                "s",
                8,
                {},
            ),
            (
                "timeseries",
                "End-to-end request latency p50 / p90 / p99",
                "Arrival to finish.",
                percentiles("dspark_e2e_request_latency_seconds"),
                "s",
                8,
                {},
            ),
            (
                "timeseries",
                "Queue time and time per output token",
                "Queue: arrival to first schedule. TPOT: (finish - first token) / (output tokens - 1).",
                [
                    q(quantile(0.5, "dspark_request_queue_time_seconds"), "queue p50"),
                    q(quantile(0.99, "dspark_request_queue_time_seconds"), "queue p99"),
                    q(quantile(0.5, "dspark_time_per_output_token_seconds"), "TPOT p50"),
                    q(quantile(0.99, "dspark_time_per_output_token_seconds"), "TPOT p99"),
                ],
                "s",
                12,
                {},
            ),
            (
                "timeseries",
                "Latency percentiles per replica (recording rules)",
                "p90 TTFT, ITL and end-to-end latency of each replica over 1m windows.",
                [
                    q(
                        f'max by (instance) (dspark:time_to_first_token_seconds:quantile1m{{{S}, quantile="0.9"}})',
                        "{{instance}} TTFT p90",
                    ),
                    q(
                        f'max by (instance) (dspark:inter_token_latency_seconds:quantile1m{{{S}, quantile="0.9"}})',
                        "{{instance}} ITL p90",
                    ),
                    q(
                        f'max by (instance) (dspark:e2e_request_latency_seconds:quantile1m{{{S}, quantile="0.9"}})',
                        "{{instance}} e2e p90",
                    ),
                ],
                "s",
                12,
                {},
            ),
        ],
    ),
    (
        "Cost model",
        [
            (
                "timeseries",
                "Predicted vs measured step time",
                "The DSpark cost model's price of each planned step (draft pass + bookkeeping + "
                "verification forward) next to the measured step time; the ratio is measured / predicted.",
                [
                    q(
                        ratio(
                            "dspark_spec_plan_predicted_step_seconds_sum",
                            "dspark_spec_plan_predicted_step_seconds_count",
                        ),
                        "{{instance}} predicted",
                    ),
                    q(
                        ratio("dspark_engine_step_seconds_sum", "dspark_engine_step_seconds_count"),
                        "{{instance}} measured",
                    ),
                    q(
                        quantile(0.5, "dspark_spec_plan_step_time_ratio", "le, instance"),
                        "{{instance}} ratio p50",
                    ),
                ],
                "s",
                8,
                {},
            ),
            (
                "timeseries",
                "Verification budget chosen",
                "Draft tokens admitted for verification per step (sum of l) and per request.",
                [
                    q(
                        ratio(
                            "dspark_spec_verify_tokens_per_step_sum",
                            "dspark_spec_verify_tokens_per_step_count",
                        ),
                        "{{instance}} per step",
                    ),
                    q(
                        f"max by (instance) (dspark_spec_verify_length_mean{{{S}}})",
                        "{{instance}} per request",
                    ),
                ],
                "none",
                8,
                {},
            ),
            (
                "timeseries",
                "Steps with no draft verified, by load",
                "Share of speculative-mode steps at each load (decoding requests) that verified no draft: "
                "nothing drafted (plain) or drafted and none admitted.",
                [
                    q(
                        f'sum by (running) (rate(dspark_spec_steps_total{{{S}, choice!="drafts"}}[{RI}])) '
                        f"/ sum by (running) (rate(dspark_spec_steps_total{{{S}}}[{RI}]))",
                        "{{running}} requests",
                    ),
                ],
                "percentunit",
                8,
                {},
            ),
        ],
    ),
    (
        "Engine",
        [
            (
                "timeseries",
                "Engine step and target forward time",
                "Wall time of one engine step (draft, plan, forward, sample, commit) and of the target "
                "forward inside it.",
                [
                    q(quantile(0.5, "dspark_engine_step_seconds"), "step p50"),
                    q(quantile(0.99, "dspark_engine_step_seconds"), "step p99"),
                    q(quantile(0.5, "dspark_model_forward_seconds"), "forward p50"),
                    q(quantile(0.99, "dspark_model_forward_seconds"), "forward p99"),
                ],
                "s",
                8,
                {},
            ),
            (
                "timeseries",
                "Tokens per target forward",
                "Tokens in one target forward: prefill chunks + decodes + verification blocks.",
                [
                    q(ratio("dspark_batch_tokens_sum", "dspark_batch_tokens_count"), "{{instance}} mean"),
                    q(quantile(0.9, "dspark_batch_tokens", "le, instance"), "{{instance}} p90"),
                ],
                "none",
                8,
                {},
            ),
            (
                "timeseries",
                "Engine steps/s and preemptions/s",
                "Preemptions drop a request's KV cache to recompute it later (KV cache full).",
                [
                    q(
                        f"sum by (instance) (rate(dspark_engine_steps_total{{{S}}}[{RI}]))",
                        "{{instance}} steps/s",
                    ),
                    q(
                        f"sum by (instance) (rate(dspark_num_preemptions_total{{{S}}}[{RI}]))",
                        "{{instance}} preemptions/s",
                    ),
                ],
                "none",
                8,
                {},
            ),
            (
                "stat",
                "Replicas: ready, draining, requests in flight",
                "Replicas whose /ready answers 200, replicas draining after SIGTERM, and /v1/* requests "
                "being handled.",
                [
                    q(f"sum(dspark_server_ready{{{S}}})", "ready", instant=True),
                    q(f"sum(dspark_server_draining{{{S}}})", "draining", instant=True),
                    q(f"sum(dspark_http_requests_in_flight{{{S}}})", "in flight", instant=True),
                ],
                "none",
                12,
                {"options": {"textMode": "value_and_name", "colorMode": "value", "reduceOptions": LAST}},
            ),
            (
                "timeseries",
                "KV cache pages used / total",
                "KV cache capacity and pages in use (pages of --page-size token slots).",
                [
                    q(f"sum by (instance) (dspark_kv_cache_used_pages{{{S}}})", "{{instance}} used"),
                    q(f"sum by (instance) (dspark_kv_cache_total_pages{{{S}}})", "{{instance}} total"),
                ],
                "none",
                12,
                {},
            ),
        ],
    ),
]

HEIGHT = 8


def _panel(pid: int, x: int, y: int, panel: Panel) -> dict[str, Any]:
    ptype, title, desc, queries, unit, width, extra = panel
    targets = [
        {"refId": chr(ord("A") + i), "datasource": DS, "editorMode": "code", **t}
        for i, t in enumerate(queries)
    ]
    defaults: dict[str, Any] = {"unit": unit, "color": {"mode": "palette-classic"}}
    field_config = {"defaults": defaults, "overrides": []}
    if ptype == "timeseries":
        defaults["custom"] = {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10,
            "showPoints": "never",
            "spanNulls": True,
        }
    if "custom" in extra:
        defaults["custom"] = extra["custom"]
    if "fieldConfig" in extra:
        defaults.update(extra["fieldConfig"].get("defaults", {}))
        field_config["overrides"] = extra["fieldConfig"].get("overrides", [])
    out: dict[str, Any] = {
        "id": pid,
        "type": ptype,
        "title": title,
        "description": desc,
        "datasource": DS,
        "gridPos": {"h": HEIGHT, "w": width, "x": x, "y": y},
        "targets": targets,
        "fieldConfig": field_config,
        "options": extra.get(
            "options",
            {
                "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                "tooltip": {"mode": "multi", "sort": "none"},
            },
        ),
    }
    if "transformations" in extra:
        out["transformations"] = extra["transformations"]
    return out


def _variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DS,
        "query": {"query": query, "refId": f"{name}-variable"},
        "definition": query,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "refresh": 2,
        "sort": 1,
        "options": [],
        "hide": 0,
    }


def dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    pid, y = 1, 0
    for section, items in SECTIONS:
        panels.append(
            {
                "id": pid,
                "type": "row",
                "title": section,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        pid, y, x = pid + 1, y + 1, 0
        for item in items:
            width = item[5]
            if x + width > 24:
                x, y = 0, y + HEIGHT
            panels.append(_panel(pid, x, y, item))
            pid, x = pid + 1, x + width
        y += HEIGHT
    return {
        "uid": "dspark-server",
        "title": "dspark-server",
        "description": "Throughput vs concurrency, DSpark speculative decoding (acceptance, "
        "verification budget, calibration, SPS curve), latency, queue and KV cache. "
        "Panels are described in docs/deploy.md.",
        "tags": ["dspark", "llm", "speculative-decoding"],
        "editable": True,
        "graphTooltip": 1,
        "refresh": "10s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "annotations": {"list": []},
        "links": [],
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                    "includeAll": False,
                    "multi": False,
                    "options": [],
                    "refresh": 1,
                    "regex": "",
                },
                _variable("model", "Model", "label_values(dspark_server_ready, model)"),
                _variable(
                    "instance", "Instance", 'label_values(dspark_server_ready{model=~"$model"}, instance)'
                ),
            ]
        },
        "panels": panels,
    }


def prometheus_rule() -> dict[str, Any]:
    rules = yaml.safe_load(RULES_PATH.read_text())
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "dspark-server",
            "labels": {"app.kubernetes.io/name": "dspark-server", "app.kubernetes.io/component": "server"},
        },
        "spec": {"groups": rules["groups"]},
    }


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _str)


def render() -> dict[Path, str]:
    rule_header = (
        "# GENERATED by deploy/generate.py from deploy/prometheus/rules/dspark.rules.yml:\n"
        "# edit that file and re-run the script. Recording rules for the Prometheus Operator.\n"
    )
    return {
        DASHBOARD_PATH: json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n",
        PROMETHEUS_RULE_PATH: rule_header
        + yaml.dump(prometheus_rule(), Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=120),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale files")
    args = parser.parse_args(argv)
    stale = []
    for path, text in render().items():
        if path.exists() and path.read_text() == text:
            continue
        stale.append(path)
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    for path in stale:
        print(f"{'stale' if args.check else 'wrote'}: {path.relative_to(DEPLOY.parent)}")
    return 1 if (args.check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())
