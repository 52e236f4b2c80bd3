"""The engine in a process of its own: the same tokens as the engine in this process, statistics
replayed for the metrics layer, aborts and a dying engine that free what they hold."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from dspark_server.config import EngineConfig, ServerConfig, SpeculativeConfig
from dspark_server.engine.engine import LLMEngine
from dspark_server.engine.process import EngineProcessBackend
from dspark_server.engine.request import InvalidRequestError, RequestOutput, SamplingParams
from dspark_server.machine import ALL_CPUS_FROM_BYTES, available_cpus, engine_threads
from dspark_server.server.app import create_app
from dspark_server.testing.tiny import build_tiny_drafter, write_flat_sps_profile

PROMPTS = [[5, 9, 14, 3], [7, 7, 21, 30, 2, 11], [40, 1], [3, 3, 3, 3, 3, 3, 3, 3, 3]]


@pytest.fixture(scope="module")
def cfg(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> EngineConfig:
    root = tmp_path_factory.mktemp("process_pair")
    draft = build_tiny_drafter(tiny_model, root / "draft", gamma=4, seed=5)
    profile = write_flat_sps_profile(root / "sps.json")
    spec = SpeculativeConfig(mode="dspark", profile_path=str(profile), draft_gate=False)
    return EngineConfig(
        model_dir=str(tiny_model), draft_dir=str(draft), max_running=4, num_threads=1, spec=spec
    )


@pytest.fixture(scope="module")
def backend(cfg: EngineConfig) -> Iterator[EngineProcessBackend]:
    b = EngineProcessBackend(cfg)
    b.start()
    yield b
    b.shutdown()


def offline_tokens(cfg: EngineConfig, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    engine = LLMEngine(cfg)
    got: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        sink = got.setdefault(str(i), [])
        engine.add_request(str(i), p, params, lambda o, sink=sink: sink.extend(o.new_token_ids))
    while engine.has_work():
        engine.step()
    return [got[str(i)] for i in range(len(prompts))]


async def collect(
    backend: EngineProcessBackend, rid: str, prompt: list[int], params: SamplingParams
) -> list[RequestOutput]:
    return [out async for out in backend.generate(rid, prompt, params)]


def test_greedy_tokens_and_statistics_match_the_engine_in_this_process(
    cfg: EngineConfig, backend: EngineProcessBackend
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24)
    seen: list[str] = []
    backend.stats.observers.append(lambda name, value: seen.append(name))
    before = backend.stats.generation_tokens

    async def run() -> list[list[RequestOutput]]:
        return await asyncio.gather(*(collect(backend, f"g{i}", p, params) for i, p in enumerate(PROMPTS)))

    results = asyncio.run(run())
    tokens = [[t for o in outs for t in o.new_token_ids] for outs in results]
    assert tokens == offline_tokens(cfg, PROMPTS, params)
    assert all(outs[-1].finished and outs[-1].finish_reason == "length" for outs in results)
    assert backend.stats.generation_tokens - before == 24 * len(PROMPTS)
    assert seen.count("e2e_seconds") == len(PROMPTS)
    assert seen.count("ttft_seconds") == len(PROMPTS)
    assert "acceptance_length" in seen  # speculative rounds ran in the engine process
    assert backend.stats.spec_rounds > 0
    load = backend.load()
    assert (load.running, load.admitted, load.kv_free_pages) == (0, 0, load.kv_total_pages)
    snapshot = backend.spec_snapshot()
    assert snapshot is not None and snapshot.mode == "dspark" and snapshot.gamma == 4


def test_closing_a_stream_aborts_the_request_and_frees_its_pages(backend: EngineProcessBackend) -> None:
    async def run() -> RequestOutput:
        stream = backend.generate("abort-me", PROMPTS[0], SamplingParams(temperature=1.0, max_tokens=2000))
        first = await stream.__anext__()
        stream.close()
        return first

    first = asyncio.run(run())
    assert first.new_token_ids
    deadline = time.monotonic() + 30
    while backend.load().admitted and time.monotonic() < deadline:
        time.sleep(0.02)
    load = backend.load()
    assert load.admitted == 0
    while backend.load().kv_free_pages != load.kv_total_pages and time.monotonic() < deadline:
        time.sleep(0.02)
    assert backend.load().kv_free_pages == load.kv_total_pages
    assert backend.stats.finished_by_reason.get("abort", 0) >= 1


def test_the_engine_leaves_a_core_to_the_http_process_unless_told(
    cfg: EngineConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With --threads unset the engine process computes on the server's CPUs less one (at least
    one): $OMP_NUM_THREADS where set (the Kubernetes manifests set it to the CPU request), else
    what this process may use; an explicit count is kept."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cpus = available_cpus()
    assert 1 <= cpus <= len(os.sched_getaffinity(0))
    unset = EngineProcessBackend(dataclasses.replace(cfg, num_threads=None))
    assert unset.cfg.num_threads == max(1, cpus - 1)
    assert unset.cfg.wide_step_threads == cpus  # one prompt's prefill takes every CPU back
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    four = EngineProcessBackend(dataclasses.replace(cfg, num_threads=None)).cfg
    assert (four.num_threads, four.wide_step_threads) == (3, 4)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert EngineProcessBackend(dataclasses.replace(cfg, num_threads=None)).cfg.num_threads == 1
    told = EngineProcessBackend(dataclasses.replace(cfg, num_threads=3)).cfg
    assert (told.num_threads, told.wide_step_threads) == (3, None)


def test_a_model_bound_by_its_weight_reads_gets_every_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From ALL_CPUS_FROM_BYTES of target weights the engine computes on all the CPUs (the twin:
    28 tokens/s on one of two cores, 48 on both), below it on all but one."""
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    with open(tmp_path / "model.safetensors", "wb") as f:  # a sparse file: its size is what counts
        f.truncate(ALL_CPUS_FROM_BYTES - 1)
    assert engine_threads(str(tmp_path)) == 3
    with open(tmp_path / "model-00002.safetensors", "wb") as f:
        f.truncate(1)
    assert engine_threads(str(tmp_path)) == 4
    assert engine_threads() == 3


def test_invalid_prompts_are_refused_before_reaching_the_engine(backend: EngineProcessBackend) -> None:
    with pytest.raises(InvalidRequestError, match="prompt token ids"):
        backend.generate("bad", [10**6], SamplingParams())
    assert backend.load().admitted == 0


def test_a_dying_engine_ends_open_streams_with_an_error(cfg: EngineConfig) -> None:
    b = EngineProcessBackend(cfg)
    b.start()
    health = TestClient(create_app(b, ServerConfig(), "m"))
    try:
        assert health.get("/health").json() == {"status": "ok"}

        async def run() -> list[RequestOutput]:
            stream = b.generate("doomed", PROMPTS[1], SamplingParams(temperature=1.0, max_tokens=2000))
            outs = [await stream.__anext__()]
            assert b._process is not None
            os.kill(b._process.pid, signal.SIGKILL)
            outs += [out async for out in stream]
            return outs

        outs = asyncio.run(asyncio.wait_for(run(), 60))
        assert outs[-1].finished and outs[-1].error == "the engine process exited"
        assert not b.ready
        r = health.get("/health")  # a liveness probe restarts a server whose engine died
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_down"
        assert b.load().admitted == 0
        with pytest.raises(RuntimeError, match="not running"):
            b.generate("late", PROMPTS[0], SamplingParams())
    finally:
        b.shutdown()


def test_an_engine_that_cannot_load_fails_start_with_its_traceback(tmp_path: Path, tiny_model: Path) -> None:
    cfg = EngineConfig(
        model_dir=str(tiny_model),
        draft_dir=str(tmp_path / "no-such-drafter"),
        num_threads=1,
        spec=SpeculativeConfig(mode="fixed"),
    )
    with pytest.raises(RuntimeError, match="the engine failed to load"):
        EngineProcessBackend(cfg).start()


@pytest.mark.parametrize("flag", ["--engine-process", "--no-engine-process"])
def test_served_greedy_completions_equal_the_offline_engine_in_both_backends(
    flag: str, tiny_model: Path, start_server: Any
) -> None:
    cfg = EngineConfig(model_dir=str(tiny_model), num_threads=1)
    engine = LLMEngine(cfg)
    prompt = "the quick brown fox"
    [tokens] = offline_tokens(
        cfg, [engine.tokenizer.encode(prompt)], SamplingParams(temperature=0.0, max_tokens=16)
    )
    server = start_server(["--model", str(tiny_model), "--spec-mode", "off", "--threads", "1", flag])
    body = {"model": "model", "prompt": prompt, "max_tokens": 16, "temperature": 0}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == engine.tokenizer.decode(tokens)
    assert r.json()["usage"]["completion_tokens"] == 16
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    assert "dspark_generation_tokens_total 16.0" in metrics
