"""Prometheus metrics of a speculative (`--spec-mode dspark`) server: counters equal what a known
workload produced, the speculative gauges are there and sane, and docs/metrics.md lists exactly
the families the server exports."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from test_api_support import LoggedServer, Samples, family_total, scrape, start, value, wait_idle

from dspark_server.testing.tiny import build_tiny_drafter, build_tiny_model, write_flat_sps_profile

GAMMA = 4
PROBES = [1, 8, 64, 512]
DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoggedServer]:
    root = tmp_path_factory.mktemp("spec_server")
    # A small vocabulary lets random drafts be right now and then: accepts and rejections both occur.
    target = build_tiny_model(root / "target", layers=2, with_eos=False, seed=5, vocab_size=24)
    draft = build_tiny_drafter(target, root / "draft", gamma=GAMMA, seed=6)
    # A flat SPS curve: verifying more costs nothing, so the planner verifies (no startup profiling).
    profile = write_flat_sps_profile(root / "sps.json", tuple(PROBES))
    s = start(
        [
            "--model",
            str(target),
            "--draft",
            str(draft),
            "--spec-mode",
            "dspark",
            "--no-draft-gate",
            "--profile",
            str(profile),
            "--max-model-len",
            "256",
        ]
    )
    yield s
    s.stop()


def _delta(after: Samples, before: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def _hist_delta(after: Samples, before: Samples, name: str) -> tuple[float, float]:
    return (_delta(after, before, f"{name}_count"), _delta(after, before, f"{name}_sum"))


def test_counters_equal_the_workload(server: LoggedServer) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    before = wait_idle(server.base_url)
    usages: list[Any] = []
    jobs = [
        dict(prompt=[5, 6, 7, 8], max_tokens=40, temperature=0),
        dict(prompt=[9, 10, 11], max_tokens=33, temperature=0),
        dict(prompt=[12, 13, 14, 15, 16], max_tokens=25, temperature=1.0, seed=3),
        dict(prompt=[17, 18], max_tokens=30, temperature=0.7, top_p=0.9, seed=4),
    ]
    for job in jobs:
        usages.append(client.completions.create(model=model, **job).usage)
    stream = client.completions.create(
        model=model,
        prompt=[4, 5, 6],
        max_tokens=21,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    usages += [c.usage for c in stream if c.usage]
    n = len(jobs) + 1
    assert len(usages) == n
    after = wait_idle(server.base_url)

    spec = [u.model_extra["spec"] for u in usages]
    completion = sum(u.completion_tokens for u in usages)
    assert _delta(after, before, "dspark_generation_tokens_total") == completion
    prompt = sum(u.prompt_tokens for u in usages)
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages)
    assert _delta(after, before, "dspark_prompt_tokens_total") == prompt - cached
    assert _delta(after, before, "dspark_prefix_cache_hits_total") == cached
    assert _delta(after, before, "dspark_prefix_cache_queries_total") == prompt - len(usages)
    assert _delta(after, before, "dspark_requests_total", endpoint="/v1/completions", status="200") == n
    assert _delta(after, before, "dspark_request_success_total", finished_reason="length") == n
    rounds = sum(s["rounds"] for s in spec)
    accepted = sum(s["accepted_tokens"] for s in spec)
    verified = sum(s["verified_tokens"] for s in spec)
    assert rounds > 0 and 0 < accepted < verified  # the workload exercised speculation both ways
    assert _delta(after, before, "dspark_spec_decode_num_drafts_total") == rounds
    assert _delta(after, before, "dspark_spec_decode_num_accepted_tokens_total") == accepted
    assert _delta(after, before, "dspark_spec_decode_num_verified_tokens_total") == verified
    assert (
        _delta(after, before, "dspark_spec_decode_num_draft_tokens_total")
        == sum(s["draft_tokens"] for s in spec)
        == GAMMA * rounds
    )
    # every token after the first comes from a speculative round
    assert _delta(after, before, "dspark_spec_decode_num_emitted_tokens_total") == completion - n
    per_pos = [
        _delta(after, before, "dspark_spec_decode_num_accepted_tokens_per_pos_total", position=str(k))
        for k in range(GAMMA)
    ]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    ver_pos = [
        _delta(after, before, "dspark_spec_decode_num_verified_tokens_per_pos_total", position=str(k))
        for k in range(GAMMA)
    ]
    assert sum(ver_pos) == verified and all(a <= v for a, v in zip(per_pos, ver_pos, strict=True))
    # histograms: one acceptance length per round, summing to the emitted tokens; the per-step
    # verification budget sums to the verified tokens; one sample per request where one is due
    assert _hist_delta(after, before, "dspark_spec_accept_length") == (rounds, completion - n)
    count, total = _hist_delta(after, before, "dspark_spec_verify_tokens_per_step")
    assert total == verified and 0 < count <= rounds
    assert _hist_delta(after, before, "dspark_spec_request_verify_length_mean")[0] == n
    # cost model: one step count per step with decodes, by load and choice (one request at a
    # time here: load "1", the gate is off so every step drafted); every step with a table is priced
    drafted = _delta(after, before, "dspark_spec_steps_total", running="1", choice="drafts")
    none = _delta(after, before, "dspark_spec_steps_total", running="1", choice="none")
    assert drafted > 0 and drafted + none == count  # every step with decodes, once
    assert _delta(after, before, "dspark_spec_steps_total", running="1", choice="plain") == 0
    priced = _hist_delta(after, before, "dspark_spec_plan_predicted_step_seconds")
    # at least the forward: SPS 50/s, which the live refresh may raise to at most twice that
    assert priced[0] == count and priced[1] >= count / 100.0
    assert _hist_delta(after, before, "dspark_spec_plan_step_time_ratio")[0] == count
    for name in (
        "dspark_time_to_first_token_seconds",
        "dspark_e2e_request_latency_seconds",
        "dspark_request_queue_time_seconds",
        "dspark_time_per_output_token_seconds",
    ):
        assert _hist_delta(after, before, name)[0] == n, name
    assert _hist_delta(after, before, "dspark_request_generation_tokens") == (n, completion)
    itl_count = _hist_delta(after, before, "dspark_inter_token_latency_seconds")[0]
    assert n <= itl_count <= completion - n  # one per delivery after the first; rounds deliver several


def test_speculative_gauges(server: LoggedServer) -> None:
    # decoding steps of its own, so the test holds when it runs alone (the live SPS samples
    # come only from steps that decode without prefill)
    body = {"model": "target", "prompt": [5, 6, 7], "max_tokens": 40, "temperature": 0}
    assert httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60).status_code == 200
    s = wait_idle(server.base_url)
    assert value(s, "dspark_spec_planner_info", mode="dspark") == 1
    assert value(s, "dspark_spec_gamma") == GAMMA
    for b in PROBES:
        assert value(s, "dspark_spec_sps_base_steps_per_second", batch_tokens=str(b)) == 50.0
        live = value(s, "dspark_spec_sps_live_steps_per_second", batch_tokens=str(b))
        assert 12.5 <= live <= 200.0  # clamped to [base / 4, base * 4]
    assert sum(value(s, "dspark_spec_sps_samples", batch_tokens=str(b)) for b in PROBES) > 0
    assert value(s, "dspark_spec_calibration_samples", position="0") > 0
    for name in (
        "dspark_spec_calibration_predicted_acceptance",
        "dspark_spec_calibration_realised_acceptance",
    ):
        assert 0.0 <= value(s, name, position="0") <= 1.0
    gap = value(s, "dspark_spec_calibration_gap", position="0")
    assert gap == pytest.approx(
        value(s, "dspark_spec_calibration_predicted_acceptance", position="0")
        - value(s, "dspark_spec_calibration_realised_acceptance", position="0")
    )
    # while a request decodes, the gauges show the planner's budget of the latest step
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    budgets, means = [], []
    stream = client.completions.create(
        model=client.models.list().data[0].id, prompt=[5, 6, 7], max_tokens=150, temperature=0, stream=True
    )
    for i, _ in enumerate(stream):
        if i % 5 == 2:
            live = scrape(server.base_url)
            budgets.append(value(live, "dspark_spec_verify_tokens"))
            means.append(value(live, "dspark_spec_verify_length_mean"))
    assert budgets and max(budgets) > 0 and all(0 <= b <= GAMMA for b in budgets)  # one request
    assert means == budgets
    assert value(s, "dspark_kv_cache_free_pages") == value(s, "dspark_kv_cache_total_pages") > 0
    assert value(s, "dspark_kv_cache_usage_ratio") == 0
    assert value(s, "dspark_server_ready") == 1 and value(s, "dspark_server_draining") == 0


def _exported_families(base_url: str) -> set[str]:
    text = httpx.get(f"{base_url}/metrics").text
    return {m.group(1) for m in re.finditer(r"^# TYPE (\S+) ", text, re.M)}


def test_docs_list_exactly_the_exported_metrics(server: LoggedServer) -> None:
    exported = _exported_families(server.base_url)  # counters carry _total in their TYPE line
    documented = set(re.findall(r"^\| `(dspark_[a-z0-9_]+)`", DOC.read_text(), re.M))
    assert exported - documented == set(), "exported but not in docs/metrics.md"
    assert documented - exported == set(), "documented but not exported"


def test_metric_names_follow_the_conventions(server: LoggedServer) -> None:
    text = httpx.get(f"{server.base_url}/metrics").text
    for m in re.finditer(r"^# TYPE (\S+) (\S+)$", text, re.M):
        name, kind = m.groups()
        assert name.startswith("dspark_"), name
        assert not re.search(r"_(ms|milliseconds|percent|perc)$", name), name  # base units
        samples = [
            line.split("{")[0].split(" ")[0]
            for line in text.splitlines()
            if line.startswith(name) and not line.startswith("#")
        ]
        if kind == "counter":
            assert name.endswith("_total") and all(x == name for x in samples), (name, samples)
    assert family_total(scrape(server.base_url), "dspark_requests_total") > 0


def test_the_draft_gate_exports_both_rates_of_the_loads_it_has_seen(tmp_path: Path) -> None:
    """With the draft gate on (the default), each load bucket it decided at shows a request's
    tokens per second in drafting and in plain steps, measured: one request at a time here."""
    target = build_tiny_model(tmp_path / "target", layers=2, with_eos=False, seed=5, vocab_size=24)
    draft = build_tiny_drafter(target, tmp_path / "draft", gamma=GAMMA, seed=6)
    profile = write_flat_sps_profile(tmp_path / "sps.json", tuple(PROBES))
    args = ["--model", str(target), "--draft", str(draft), "--spec-mode", "dspark", "--profile", str(profile)]
    s = start(args + ["--max-model-len", "256"])
    try:
        assert family_total(scrape(s.base_url), "dspark_draft_gate_tokens_per_second") == 0  # nothing yet
        client = openai.OpenAI(base_url=f"{s.base_url}/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        client.completions.create(model=model, prompt=[5, 6, 7, 8], max_tokens=24, temperature=0)
        after = scrape(s.base_url)
        draft_rate = value(after, "dspark_draft_gate_tokens_per_second", running="1", choice="draft")
        plain_rate = value(after, "dspark_draft_gate_tokens_per_second", running="1", choice="plain")
        # a tiny model's plain step takes well under 100 ms, well over 10 us
        assert 10 < plain_rate < 100_000 and 0 < draft_rate < 100_000, (draft_rate, plain_rate)
        steps = {
            c: value(after, "dspark_spec_steps_total", running="1", choice=c)
            for c in ("plain", "drafts", "none")
        }
        assert steps["plain"] >= 1 and steps["drafts"] + steps["none"] >= 1  # warm-up measured both
        # the step times behind the rates: each kind's own and the engine loop's after it
        t = {
            (c, part): value(after, "dspark_draft_gate_step_seconds", running="1", choice=c, part=part)
            for c in ("draft", "plain")
            for part in ("step", "loop")
        }
        assert all(0 < x < 1 for x in t.values()), t
        assert 1 / (t["plain", "step"] + t["plain", "loop"]) == pytest.approx(plain_rate)
    finally:
        s.stop()
