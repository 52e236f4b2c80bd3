"""The llama.cpp peer of `dspark bench --suite peers`: its request shape against our real server,
its command lines and ratios, and (with DSPARK_LLAMA_SERVER=path/to/llama-server) the whole run
against a real llama-server."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import httpx
import pytest

from dspark_server.bench.common import BenchError
from dspark_server.bench.gguf_convert import find_converter
from dspark_server.bench.llama_cpp import llama_argv, llama_markdown, ratios
from dspark_server.bench.load_client import completion_payload, endpoint_of, send_request
from dspark_server.bench.main import main as bench_main
from dspark_server.bench.serving_config import ServingConfig


def test_ratios_pair_every_system_and_name_the_best_llama() -> None:
    systems = {
        "ours-off": {"output_tokens_per_s": 600.0},
        "ours-dspark": {"output_tokens_per_s": 900.0},
        "llama-plain": {"output_tokens_per_s": 1200.0},
        "llama-dspark": {"output_tokens_per_s": 450.0},
    }
    r = ratios(systems)
    assert r["ours-dspark / llama-dspark"] == pytest.approx(2.0)
    assert r["ours-off / llama-plain"] == pytest.approx(0.5)
    assert r["ours-dspark / best llama.cpp"] == pytest.approx(0.75)
    assert len(r) == 2 * 2 + 2


def test_markdown_has_one_row_per_point() -> None:
    point = {
        "prompt_set": "code",
        "concurrency": 4,
        "systems": {
            n: {"output_tokens_per_s": v, "ttft_p50_s": 0.01, "tpot_p50_s": 0.002}
            for n, v in (("ours-dspark", 300.0), ("llama-plain", 200.0))
        },
    }
    point["ratios"] = ratios(point["systems"])
    cfg = {
        "command": "dspark bench ...",
        "systems": ["ours-dspark", "llama-plain"],
        "max_tokens": 8,
        "ignore_eos": True,
        "temperature": 0.0,
        "rounds": 1,
        "pre_tokenizer": "qwen2",
    }
    md = llama_markdown({"config": cfg, "points": [point]})
    assert "| code | 4 | 300 | 200 | 1.50 | 1.50 |" in md
    assert "| code | 4 | 10 / 2.0 | 10 / 2.0 |" in md


def test_llama_argv_adds_the_drafter_only_for_dspark(tmp_path: Path) -> None:
    t, d = tmp_path / "t.gguf", tmp_path / "d.gguf"
    plain = llama_argv("llama-server", t, None, 0, 2, 64, 2048)
    assert plain == ["llama-server", "-m", str(t), "-t", "2", "-np", "64", "-c", str(64 * 2048)]
    spec = llama_argv("llama-server", t, d, 7, 2, 16, 1024)
    assert spec[-6:] == ["-md", str(d), "--spec-type", "draft-dspark", "--spec-draft-n-max", "7"]


def test_converter_is_found_in_the_binary_source_tree(tmp_path: Path) -> None:
    tree = tmp_path / "llama.cpp"
    (tree / "build" / "bin").mkdir(parents=True)
    binary = tree / "build" / "bin" / "llama-server"
    binary.write_text("")
    with pytest.raises(BenchError, match="--llama-converter"):
        find_converter(binary)
    (tree / "convert_hf_to_gguf.py").write_text("")
    with pytest.raises(BenchError):  # the script without its conversion/ package is not the converter
        find_converter(binary)
    (tree / "conversion").mkdir()
    assert find_converter(binary) == tree / "convert_hf_to_gguf.py"


def test_completion_payload_streams_token_id_prompts(tiny_model: Path, start_server) -> None:
    """The peer's request (token-id prompt, streamed /v1/completions, usage) against our server."""
    server = start_server(["--model", str(tiny_model), "--spec-mode", "off"])
    shape = ServingConfig(prompt_files=(), concurrency=(1,), out="", max_tokens=6, ignore_eos=True)
    body = completion_payload([5, 6, 7, 8], shape, 0)
    assert endpoint_of(body) == "/v1/completions" and body["prompt"] == [5, 6, 7, 8]

    async def go() -> object:
        async with httpx.AsyncClient(timeout=60) as client:
            return await send_request(client, server.base_url, body, 0)

    res = asyncio.run(go())
    assert res.ok, res.error
    assert res.prompt_tokens == 4 and res.completion_tokens == 6
    assert res.chunks >= 1 and res.ttft is not None and res.e2e is not None and res.e2e >= res.ttft


LLAMA = os.environ.get("DSPARK_LLAMA_SERVER")


@pytest.mark.skipif(not LLAMA, reason="set DSPARK_LLAMA_SERVER to a llama-server binary")
def test_peer_run_against_a_real_llama_server(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in ("def add(a, b):", "Hello there")))
    out = tmp_path / "out"
    args = ["--suite", "peers", "--llama-server", str(LLAMA), "--prompts", str(prompts)]
    args += ["--concurrency", "1,2"]
    args += ["--max-tokens", "8", "--ignore-eos", "--quiet", "--no-plots", "--out", str(out)]
    assert bench_main(args) == 0
    result = json.loads((out / "llama_cpp.json").read_text())
    assert result["config"]["systems"] == ["ours-off", "ours-dspark", "llama-plain", "llama-dspark"]
    assert [(p["prompt_set"], p["concurrency"]) for p in result["points"]] == [("p", 1), ("p", 2)]
    for p in result["points"]:
        assert all(s["output_tokens_per_s"] > 0 for s in p["systems"].values())
        assert p["ratios"]["ours-dspark / best llama.cpp"] > 0
    for run in result["round_runs"]:  # closed loop: max(prompts, 2c) requests of 8 tokens each
        assert run["output_tokens"] == 8 * max(2, 2 * run["concurrency"])
