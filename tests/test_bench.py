"""`dspark bench` smoke tests: the short form of the serving sweep with self-hosted servers on the
tiny model pair, loud failure on a failing request, and the oracle replay's arithmetic. The full
sweeps are documented commands (benchmarks/README.md), not tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dspark_server.bench.main import main as bench_main
from dspark_server.bench.oracle import ONLINE, oracle_budget, replay
from dspark_server.planner import SpsCostTable, save_sps_table
from dspark_server.testing.tiny import build_tiny_drafter
from tools.paper import threshold_rows

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def pair(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bench")
    draft = build_tiny_drafter(tiny_model, root / "draft", gamma=4)
    sps = root / "sps.json"  # a fixed table: a dspark server would otherwise profile at start-up
    save_sps_table(SpsCostTable((1, 8, 32, 128), (500.0, 450.0, 300.0, 120.0), 512), sps)
    prompts = root / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"turns": [t]}) + "\n"
            for t in ("def add(a, b):", "The quick brown fox", "class Point:")
        )
    )
    return {"model": tiny_model, "draft": draft, "sps": sps, "prompts": prompts}


@pytest.mark.slow  # two self-hosted servers: minutes on 2 shared cores
def test_self_hosted_sweep_writes_results(pair: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    rc = bench_main(
        [
            "--self-host",
            "--model",
            str(pair["model"]),
            "--draft",
            str(pair["draft"]),
            "--profile",
            str(pair["sps"]),
            "--modes",
            "off,dspark",
            "--concurrency",
            "1,2",
            "--prompts",
            str(pair["prompts"]),
            "--limit",
            "2",
            "--max-tokens",
            str(MAX_TOKENS),
            "--threads",
            "1",
            "--quiet",
            "--out",
            str(out),
            # the random tiny drafter rarely pays off, so the measured-rate draft gate would
            # switch drafting off and leave nothing speculative to count
            "--server-arg=--no-draft-gate",
        ]
    )
    assert rc == 0
    result = json.loads((out / "results.json").read_text())
    assert result["machine"]["cpu"] and result["machine"]["cores"] >= 1
    assert result["config"]["modes"] == ["off", "dspark"]
    runs = {(r["mode"], r["concurrency"]): r for r in result["runs"]}
    assert set(runs) == {("off", 1), ("dspark", 1), ("off", 2), ("dspark", 2)}
    for (mode, _), r in runs.items():
        # closed loop: max(prompts, 2 x concurrency) requests, prompts cycled
        assert r["errors"] == 0 and r["num_requests"] == max(2, 2 * r["concurrency"])
        assert r["prompt_set"] == "prompts"
        # the tiny model has no EOS: every request generates exactly max_tokens token ids, and the
        # usage counts add up to the server's own counter
        assert r["output_tokens"] == r["num_requests"] * MAX_TOKENS
        assert r["server_generation_tokens"] == r["output_tokens"]
        assert r["output_tokens_per_s"] > 0 and r["requests_per_s"] > 0
        for key in ("ttft", "tpot", "itl", "e2e"):
            assert r[f"{key}_p50_s"] > 0 and r[f"{key}_p99_s"] >= r[f"{key}_p50_s"]
        if mode == "off":
            assert r["mean_acceptance_length"] == 1.0
            assert r["mean_verified_drafts_per_request_step"] == 0.0
        else:
            assert 1.0 <= r["mean_acceptance_length"] <= 5.0
            assert 0.0 < r["mean_verified_drafts_per_request_step"] <= 4.0
            assert r["speedup_vs_off"] == pytest.approx(
                r["output_tokens_per_s"] / runs[("off", r["concurrency"])]["output_tokens_per_s"]
            )
    assert len(result["round_runs"]) == 4
    table = (out / "results.md").read_text()
    assert "| dspark | 2 |" in table and "output tok/s" in table
    for png in ("tps_vs_concurrency", "verified_drafts_vs_concurrency", "latency_vs_concurrency"):
        assert (out / f"{png}.png").stat().st_size > 1000


@pytest.mark.slow  # a real server
def test_failing_request_fails_the_bench(
    pair: dict[str, Path], tmp_path: Path, start_server, capsys: pytest.CaptureFixture[str]
) -> None:
    server = start_server(["--model", str(pair["model"]), "--max-model-len", "64", "--threads", "1"])
    prompts = tmp_path / "mixed.jsonl"  # the second prompt does not fit the 64-token context
    prompts.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in ("short", "word " * 200)))
    out = tmp_path / "out"
    rc = bench_main(
        [
            "--url",
            server.base_url,
            "--concurrency",
            "1",
            "--prompts",
            str(prompts),
            "--num-requests",
            "2",
            "--max-tokens",
            "4",
            "--warmup",
            "0",
            "--quiet",
            "--out",
            str(out),
        ]
    )
    assert rc == 1
    err = capsys.readouterr().err
    assert "1 of 2 requests failed" in err and "HTTP 400" in err
    errors = json.loads((out / "errors.json").read_text())
    assert errors["errors"][0]["status"] == 400
    assert not (out / "results.json").exists()


def test_oracle_replay_arithmetic() -> None:
    table = SpsCostTable((1, 4, 8), (100.0, 80.0, 40.0), 64)
    # one step: the K <= sum(accepted) maximising (R + K) * SPS(R + K); R = 2, K = 0..3 gives
    # B = 2, 3, 4, 5 -> 200, 300, 320, 400 tokens/s
    assert oracle_budget(np.array([3, 0]), table, gamma=4) == 3
    assert oracle_budget(np.array([0, 0]), table, gamma=4) == 0
    rng = np.random.default_rng(0)
    requests = []
    for _ in range(6):
        n = int(rng.integers(3, 8))
        requests.append(
            {
                "confidences": rng.uniform(0.2, 1.0, (n, 4)).tolist(),
                "accepted": rng.integers(0, 5, n).tolist(),
            }
        )
    for c in (1, 3):
        res = replay(requests, table, c, gamma=4)
        assert res["oracle"]["ratio_to_oracle"] == 1.0
        assert res["off"]["mean_verify_len"] == 0.0 and res["fixed"]["mean_verify_len"] == 4.0
        total_rounds = sum(len(r["accepted"]) for r in requests)
        for name in ("off", "fixed", "threshold", "dspark"):
            # every planner consumes the same rounds and none beats the oracle
            assert res[name]["tokens"] >= total_rounds
            assert 0 < res[name]["ratio_to_oracle"] <= 1.0 + 1e-9
    # a perfect drafter that is always right: fixed verification equals the oracle when cost is flat
    flat = SpsCostTable((1,), (100.0,), 64)
    perfect = [{"confidences": [[0.9] * 4] * 3, "accepted": [4, 4, 4]}]
    assert replay(perfect, flat, 1, gamma=4)["fixed"]["ratio_to_oracle"] == pytest.approx(1.0)


def test_oracle_replay_of_online_recalibration() -> None:
    """The dspark planner with the server's online recalibration: the file's confidences while
    few rounds are seen, then the acceptance the rounds show (here: far below the confidences)."""
    table = SpsCostTable((1, 4, 8), (100.0, 80.0, 40.0), 64)
    rng = np.random.default_rng(1)

    def overconfident(n: int) -> list[dict[str, list]]:
        return [
            {"confidences": [[0.95] * 4] * n, "accepted": rng.choice([0, 1], n, p=[0.7, 0.3]).tolist()}
            for _ in range(4)
        ]

    few = replay(overconfident(40), table, 2, gamma=4)
    assert few[ONLINE] == few["dspark"]  # 160 rounds: no map yet
    many = replay(overconfident(600), table, 2, gamma=4)
    assert many[ONLINE]["mean_verify_len"] < many["dspark"]["mean_verify_len"] - 1
    assert many[ONLINE]["ratio_to_oracle"] > many["dspark"]["ratio_to_oracle"] + 0.05


def test_threshold_rows() -> None:
    reqs = [{"confidences": [[0.9, 0.5, 0.5, 0.1]], "accepted": [1]}]  # survival .9 .45 .225 .0225
    rows = {r["threshold"]: r for r in threshold_rows(reqs, [0.0, 0.4, 0.95])}
    assert rows[0.0]["mean_verify_len"] == 4 and rows[0.0]["acceptance_rate"] == 0.25
    assert rows[0.4]["mean_verify_len"] == 2 and rows[0.4]["tokens_per_step"] == 2.0
    assert rows[0.95]["mean_verify_len"] == 0 and rows[0.95]["tokens_per_step"] == 1.0


def test_report_renders_engine_level_results_and_an_sps_profile() -> None:
    from tools.report import kind_of, render

    machine = {"cpu": "CPU X", "cores": 2, "torch_threads": 1}
    decode = {
        "kind": "decode_throughput",
        "machine": machine,
        "config": {"command": "c1", "prompt_len": 32, "rounds": 3},
        "model_parameters": 4.8e6,
        "new_tokens": 64,
        "runs": [
            {"concurrency": 1, "tokens_per_s": 60.0, "ratio_vs_1": 1.0},
            {"concurrency": 8, "tokens_per_s": 300.0, "ratio_vs_1": 5.0},
        ],
    }
    assert "| 8 | 300.0 | 5.00 |" in render(decode) and "Command: `c1`" in render(decode)
    timing = {
        "kind": "draft_timing",
        "machine": machine,
        "config": {"command": "c2", "context": 256},
        "rows": [
            {
                "label": "draft",
                "head": "markov",
                "requests": 64,
                "backbone_ms": 40.0,
                "sequential_ms": 10.0,
                "confidence_ms": 0.2,
                "total_ms": 50.2,
                "sequential_share": 0.199,
                "verify_ms": 90.0,
                "round_share": 0.071,
            }
        ],
    }
    assert "| draft | 64 | 40.00 | 10.00 | 0.20 | 50.20 | 19.9% | 90.00 | 7.1% |" in render(timing)
    sps = SpsCostTable((1, 8, 64), (250.0, 125.0, 50.0), 64).to_dict()
    assert kind_of(sps) == "sps"
    assert "| ms / step | 4.00 | 8.00 | 20.00 |" in render(sps)


def test_serve_bench_table_takes_each_systems_median_over_rounds(tmp_path: Path) -> None:
    from tools.serve_bench_table import main as table_main

    lines = [
        f"ours-{m} code c=1 T=0 tps={tps} ttft_ms={ttft} tpot_ms=1.0"
        for m, tps, ttft in [
            ("off", 110, 5),
            ("dspark", 150, 9),
            ("off", 120, 7),
            ("dspark", 130, 7),
            ("off", 90, 6),
            ("dspark", 90, 6),
        ]
    ]
    run = tmp_path / "run.txt"
    run.write_text("\n".join(lines) + "\n")
    assert table_main([str(run), "--out", str(tmp_path / "t")]) == 0
    rows = {r["system"]: r for r in json.loads((tmp_path / "t.json").read_text())}
    assert (rows["ours-off"]["tps"], rows["ours-dspark"]["tps"]) == (110, 130)
    assert (rows["ours-off"]["rounds"], rows["ours-dspark"]["ttft_ms"]) == (3, 7)
    assert "| 1 | 130 | 110 | 1.18 | 1.18 |" in (tmp_path / "t.md").read_text()
