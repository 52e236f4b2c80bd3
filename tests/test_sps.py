"""SPS cost table: lookup semantics, file format errors, builders, live refresh."""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from dspark_server.planner import (
    LiveSpsTable,
    PlannerConfig,
    SpsCostTable,
    build_sps_table,
    load_sps_table,
    make_planner,
    plot_sps_table,
    probe_batch_sizes,
    save_sps_table,
)


@pytest.fixture
def table() -> SpsCostTable:
    return SpsCostTable((4, 16, 64), (10.0, 8.0, 5.0), 128)


def test_lookup_uses_largest_probe_at_or_below(table: SpsCostTable) -> None:
    assert table.lookup(4) == 10.0
    assert table.lookup(15) == 10.0
    assert table.lookup(16) == 8.0
    assert table.lookup(63) == 8.0
    assert table.lookup(64) == 5.0
    assert table.lookup(127) == 5.0


def test_lookup_clamps_below_first_probe_and_grows_past_the_table(table: SpsCostTable) -> None:
    # Below the first probe reads the first value (SGLang's reading); past max_batch_tokens the
    # step time grows in proportion to B instead of staying flat: unmeasured tokens are never free.
    assert table.lookup(1) == 10.0
    assert table.lookup(0) == 10.0
    assert table.lookup(-5) == 10.0
    assert table.lookup(128) == 5.0
    assert table.lookup(256) == pytest.approx(2.5)
    assert table.lookup(10_000) == pytest.approx(5.0 * 128 / 10_000)
    assert 128 * table.lookup(128) == pytest.approx(10_000 * table.lookup(10_000))


def test_vectorised_lookups_match_scalar(table: SpsCostTable) -> None:
    bs = torch.arange(-3, 300)
    expected = torch.tensor([table.lookup(int(b)) for b in bs], dtype=torch.float64)
    assert torch.equal(table.lookup_tensor(bs), expected)
    assert np.array_equal(table.lookup_array(bs.numpy()), expected.numpy())
    for start, count in [(-3, 303), (0, 1), (5, 10), (120, 50), (200, 7), (128, 1), (1, 0)]:
        want = [table.lookup(b) for b in range(start, start + count)]
        assert table.lookup_range(start, count).tolist() == want, (start, count)


@pytest.mark.parametrize(
    ("tokens", "sps", "max_bt", "match"),
    [
        ((), (), 1, "at least one probe"),
        ((4, 4), (1.0, 1.0), 8, "strictly increasing"),
        ((8, 4), (1.0, 1.0), 8, "strictly increasing"),
        ((4, 8), (1.0,), 8, "lengths differ"),
        ((4, 8), (1.0, 0.0), 8, "> 0"),
        ((4, 8), (1.0, -2.0), 8, "> 0"),
        ((4, 8), (1.0, math.nan), 8, "finite"),
        ((4, 8), (1.0, math.inf), 8, "finite"),
        ((0, 8), (1.0, 1.0), 8, ">= 1"),
        ((4, 8), (1.0, 1.0), 7, "below the largest probe"),
        ((4, 8.5), (1.0, 1.0), 9, "ints"),
        ((True, 8), (1.0, 1.0), 9, "ints"),
    ],
)
def test_invalid_tables_rejected(tokens: tuple, sps: tuple, max_bt: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SpsCostTable(tokens, sps, max_bt)


def test_save_load_roundtrip_with_metadata(tmp_path: Path, table: SpsCostTable) -> None:
    path = tmp_path / "sps.json"
    save_sps_table(table, path, metadata={"device": "test", "gamma": 7})
    data = json.loads(path.read_text())
    assert data["sample_batch_tokens"] == [4, 16, 64]
    assert data["sample_steps_per_sec"] == [10.0, 8.0, 5.0]
    assert data["max_batch_tokens"] == 128
    assert data["device"] == "test"
    assert load_sps_table(path) == table


def test_metadata_may_not_shadow_keys_or_look_additive(tmp_path: Path, table: SpsCostTable) -> None:
    with pytest.raises(ValueError, match="override"):
        save_sps_table(table, tmp_path / "a.json", metadata={"max_batch_tokens": 3})
    with pytest.raises(ValueError, match="bias_seconds"):
        save_sps_table(table, tmp_path / "b.json", metadata={"note": "no bias_seconds here"})
    assert not (tmp_path / "b.json").exists()


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"sample_batch_tokens": [1], "sample_steps_per_sec": [1.0]}', "missing key"),
        ('{"sample_batch_tokens": 1, "sample_steps_per_sec": [1.0], "max_batch_tokens": 1}', "lists"),
        (
            '{"sample_batch_tokens": [1, 3, 2], "sample_steps_per_sec": [1, 1, 1], "max_batch_tokens": 3}',
            "strictly increasing",
        ),
        ('{"sample_batch_tokens": [1, 2], "sample_steps_per_sec": [1], "max_batch_tokens": 3}', "lengths"),
        ('{"sample_batch_tokens": [1, 2], "sample_steps_per_sec": [1, 0], "max_batch_tokens": 3}', "> 0"),
        ('{"sample_batch_tokens": [1], "sample_steps_per_sec": [1], "max_batch_tokens": 1.5}', "int"),
        ('{"bias_seconds": 0.1, "bs_probes": [1]}', "additive"),
    ],
)
def test_malformed_files_raise_clear_errors(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as info:
        load_sps_table(path)
    assert str(path) in str(info.value)


def test_missing_file_is_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        load_sps_table(tmp_path / "nope.json")


def test_ints_accepted_as_steps_per_sec(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text('{"sample_batch_tokens": [1, 2], "sample_steps_per_sec": [3, 2], "max_batch_tokens": 2}')
    assert load_sps_table(path).sample_steps_per_sec == (3.0, 2.0)


def test_build_from_samples_uses_median_and_drops_empty() -> None:
    t = build_sps_table({32: [0.02, 0.5, 0.02], 8: [0.01, 0.01, 0.01, 0.04], 16: []})
    assert t.sample_batch_tokens == (8, 32)
    assert t.sample_steps_per_sec == pytest.approx((100.0, 50.0))
    assert t.max_batch_tokens == 32
    assert build_sps_table({8: [0.01]}, max_batch_tokens=64).max_batch_tokens == 64
    with pytest.raises(ValueError, match="no probe"):
        build_sps_table({8: []})
    with pytest.raises(ValueError, match="> 0"):
        build_sps_table({8: [0.01, 0.0]})


@pytest.mark.parametrize("max_bt", [1, 5, 8, 9, 100, 4096, 5000])
def test_probe_batch_sizes(max_bt: int) -> None:
    probes = probe_batch_sizes(max_bt)
    assert probes[0] == 1 and probes[-1] == max_bt
    assert all(b > a for a, b in zip(probes, probes[1:], strict=False))
    powers = [1 << k for k in range(20) if (1 << k) <= max_bt]
    assert set(powers) <= set(probes)
    if max_bt >= 64:
        assert {40, 48, 56} <= set(probes)  # denser than powers of two
    SpsCostTable(tuple(probes), tuple(1.0 for _ in probes), max_bt)
    with pytest.raises(ValueError):
        probe_batch_sizes(0)


def test_plot_writes_png(tmp_path: Path, table: SpsCostTable) -> None:
    out = plot_sps_table(table, tmp_path / "plots" / "sps.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000


# --- live refresh -----------------------------------------------------------------------


def test_live_table_starts_at_base_and_blends_towards_measurements(table: SpsCostTable) -> None:
    live = LiveSpsTable(table, window=64, samples_for_full_weight=32, max_weight=0.8, clamp_factor=2.0)
    assert live.current_table() == table
    assert live.record(20, 0.0625)  # 16 SPS measured at probe 16 (base 8)
    one = live.current_table().lookup(16)
    assert one == pytest.approx(0.975 * 8 + 0.025 * 16)  # weight 0.8 * 1/32 after one sample
    for _ in range(40):
        live.record(30, 0.0625)
    full = live.current_table()
    assert full.lookup(16) == pytest.approx(0.2 * 8 + 0.8 * 16)
    assert full.lookup(4) == 10.0 and full.lookup(64) == 5.0  # untouched buckets
    assert full.sample_batch_tokens == table.sample_batch_tokens


def test_live_table_resists_outliers_and_clamps(table: SpsCostTable) -> None:
    live = LiveSpsTable(table, window=32, samples_for_full_weight=8, max_weight=1.0, clamp_factor=2.0)
    for _ in range(20):
        live.record(64, 0.25)  # 4 SPS (base 5)
    live.record(64, 30.0)  # a stall
    live.record(64, 1e-9)  # a broken timer
    assert live.current_table().lookup(64) == pytest.approx(4.0)
    for _ in range(40):
        live.record(70, 1e-6)  # absurdly fast: clamped at 2x base
    assert live.current_table().lookup(64) == pytest.approx(10.0)
    assert not live.record(64, -1.0) and not live.record(64, math.nan) and not live.record(0, 0.1)


def test_live_table_stays_valid_and_strictly_increasing(table: SpsCostTable) -> None:
    rng = np.random.default_rng(0)
    live = LiveSpsTable(table, window=8, samples_for_full_weight=2)
    for _ in range(500):
        live.record(int(rng.integers(1, 400)), float(rng.lognormal(-4, 2)))
        t = live.current_table()
        assert t.sample_batch_tokens == table.sample_batch_tokens
        for base, now in zip(table.sample_steps_per_sec, t.sample_steps_per_sec, strict=True):
            assert base / 4 <= now <= base * 4  # the default clamp
    curve = live.curve()
    assert [p.batch_tokens for p in curve] == [4, 16, 64]
    assert sum(p.num_samples for p in curve) == 3 * 8  # windows are bounded
    assert all(p.measured_steps_per_sec is not None for p in curve)


def test_live_table_disabled_and_reset(table: SpsCostTable) -> None:
    live = LiveSpsTable(table, enabled=False)
    assert not live.record(16, 0.001)
    assert live.current_table() is table
    live.enabled = True
    for _ in range(50):
        live.record(16, 0.05)
    assert live.current_table().lookup(16) != 8.0
    live.enabled = False
    assert live.current_table() is table
    live.enabled = True
    live.reset()
    assert live.current_table() == table
    assert all(p.num_samples == 0 and p.measured_steps_per_sec is None for p in live.curve())


def test_live_table_feeds_planner() -> None:
    flat = SpsCostTable((1, 4), (10.0, 10.0), 64)
    planner = make_planner(PlannerConfig(mode="dspark", gamma=3), flat)
    conf = torch.tensor([[0.9, 0.9, 0.9]])
    assert planner.plan(conf).tolist() == [3]
    live = LiveSpsTable(flat, samples_for_full_weight=1, max_weight=1.0, clamp_factor=10.0)
    for _ in range(5):
        live.record(4, 1.0)  # B >= 4 measured at 1 SPS: the 4th token now costs too much
    planner.set_sps_table(live.current_table())
    assert planner.plan(conf).tolist() == [2]


def test_live_table_concurrent_record_and_read(table: SpsCostTable) -> None:
    live = LiveSpsTable(table, window=16)
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            for i in range(2000):
                live.record(1 + i % 100, 0.01 + (i % 7) * 1e-3)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer) for _ in range(2)]
    for th in threads:
        th.start()
    for _ in range(200):
        live.current_table()
        live.curve()
    for th in threads:
        th.join()
    assert not errors
    assert sum(p.num_samples for p in live.curve()) == 3 * 16


def test_monotone_envelope_removes_noise_rises_and_keeps_the_best_rate() -> None:
    from dspark_server.planner import monotone_envelope

    t = SpsCostTable((1, 2, 4, 8, 16), (100.0, 80.0, 90.0, 70.0, 75.0), 16)
    env = monotone_envelope(t)
    assert env.sample_steps_per_sec == (100.0, 90.0, 90.0, 75.0, 75.0)
    assert env.sample_batch_tokens == t.sample_batch_tokens
    steps = env.sample_steps_per_sec
    assert all(a >= b for a, b in zip(steps, steps[1:], strict=False))
