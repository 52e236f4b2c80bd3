"""What a run changed on the server: `/metrics` scraped before and after, and the deltas turned into
τ, verified drafts per request per step and the verification budget."""

from __future__ import annotations

import math
from typing import Any

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(client: Any, base_url: str) -> Samples:
    from prometheus_client.parser import text_string_to_metric_families

    resp = await client.get(f"{base_url}/metrics", timeout=30)
    resp.raise_for_status()
    out: Samples = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def _per_position(samples: Samples, name: str) -> dict[int, float]:
    return {
        int(dict(lbl)["position"]): v
        for (n, lbl), v in samples.items()
        if n == name and "position" in dict(lbl)
    }


def detect_mode(samples: Samples) -> str:
    for (name, labels), v in samples.items():
        if name == "dspark_spec_planner_info" and v == 1:
            return dict(labels).get("mode", "spec")
    return "off"


COUNTERS = {
    "generation_tokens": "dspark_generation_tokens_total",
    "prompt_tokens": "dspark_prompt_tokens_total",
    "engine_steps": "dspark_engine_steps_total",
    "preemptions": "dspark_num_preemptions_total",
    "spec_rounds": "dspark_spec_decode_num_drafts_total",
    "spec_draft_tokens": "dspark_spec_decode_num_draft_tokens_total",
    "spec_verified_tokens": "dspark_spec_decode_num_verified_tokens_total",
    "spec_accepted_tokens": "dspark_spec_decode_num_accepted_tokens_total",
    "spec_emitted_tokens": "dspark_spec_decode_num_emitted_tokens_total",
    "verify_steps": "dspark_spec_verify_tokens_per_step_count",
    "verify_budget_sum": "dspark_spec_verify_tokens_per_step_sum",
    "forwards": "dspark_batch_tokens_count",
    "batch_tokens_sum": "dspark_batch_tokens_sum",
    "forward_seconds_sum": "dspark_model_forward_seconds_sum",
}


def metric_deltas(before: Samples, after: Samples) -> dict[str, Any]:
    d: dict[str, Any] = {k: _value(after, n) - _value(before, n) for k, n in COUNTERS.items()}
    for key, name in (
        ("accepted_per_position", "dspark_spec_decode_num_accepted_tokens_per_pos_total"),
        ("verified_per_position", "dspark_spec_decode_num_verified_tokens_per_pos_total"),
    ):
        a, b = _per_position(after, name), _per_position(before, name)
        d[key] = [a.get(k, 0.0) - b.get(k, 0.0) for k in sorted(a)]
    return d


def derived_from_deltas(d: dict[str, Any]) -> dict[str, Any]:
    """Acceptance / verification figures of one run (or the sum of several) from metric deltas.
    Plain decoding (no rounds) emits one token per request per step and verifies no draft."""
    rounds = d["spec_rounds"]
    verified_pp, accepted_pp = d.get("verified_per_position", []), d.get("accepted_per_position", [])
    return {
        "mean_acceptance_length": d["spec_emitted_tokens"] / rounds if rounds else 1.0,
        "mean_verified_drafts_per_request_step": d["spec_verified_tokens"] / rounds if rounds else 0.0,
        "mean_verify_budget_per_step": (
            d["verify_budget_sum"] / d["verify_steps"] if d["verify_steps"] else 0.0
        ),
        "draft_acceptance_rate": (
            d["spec_accepted_tokens"] / d["spec_verified_tokens"] if d["spec_verified_tokens"] else math.nan
        ),
        "mean_batch_tokens": d["batch_tokens_sum"] / d["forwards"] if d["forwards"] else math.nan,
        "mean_requests_per_spec_step": rounds / d["verify_steps"] if d["verify_steps"] else math.nan,
        "per_position_acceptance": [
            a / v if v else math.nan for a, v in zip(accepted_pp, verified_pp, strict=False)
        ],
    }
