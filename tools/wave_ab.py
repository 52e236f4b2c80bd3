"""In-process A/B of engine variants over waves of concurrent requests, interleaved.

    python -m tools.wave_ab --concurrency 64 --variants off:float32 off:bfloat16 dspark:bfloat16 \
        --prompts ../shared/prompts/humaneval.jsonl,../shared/prompts/mt-bench.jsonl --rounds 3

A variant is ``MODE:KV`` (MODE off / fixed / threshold / dspark, ``dspark-nogate`` for dspark
with the draft gate off; KV the ``--kv-cache-dtype``: auto / float32 / bfloat16). Every variant's
engine is built once (weight-only bf16 unless ``--weight-dtype``), warmed with one wave, then
each round runs one wave of ``--concurrency`` fresh requests (128 tokens, ignore_eos, greedy
unless ``--temperature``; ``--seed`` gives each request a seed) on every variant in turn, so
slow drifts of the machine fall on all alike. Prints each variant's tokens/s per round
(prefill included) and the median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from dspark_server.assets import DEMO_DRAFT, DEMO_TARGET
from dspark_server.config import EngineConfig, SpeculativeConfig
from dspark_server.engine.engine import LLMEngine
from dspark_server.engine.request import SamplingParams


def build(variant: str, a: argparse.Namespace) -> LLMEngine:
    mode, kv = variant.split(":")
    gate = not mode.endswith("-nogate")
    mode = mode.removesuffix("-nogate")
    cfg = EngineConfig(
        model_dir=a.model,
        draft_dir=a.draft if mode != "off" else None,
        weight_dtype=a.weight_dtype,
        kv_cache_dtype=kv,
        max_running=a.concurrency,
        spec=SpeculativeConfig(mode=mode, draft_gate=gate),  # type: ignore[arg-type]
    )
    return LLMEngine(cfg)


def wave(engine: LLMEngine, prompts: list[str], tag: str, temperature: float, seed: int | None) -> float:
    """One wave of these prompts at once -> output tokens/s (prefill included); ``seed``: request
    i carries seed + i (the keyed-noise path)."""
    for i, prompt in enumerate(prompts):
        ids = engine.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        s = None if seed is None else seed + i
        params = SamplingParams(temperature=temperature, max_tokens=128, ignore_eos=True, seed=s)
        engine.add_request(f"{tag}-{i}", ids, params, lambda _out: None)
    tokens, t0 = engine.stats.generation_tokens, time.perf_counter()
    while engine.has_work():
        engine.step()
    return (engine.stats.generation_tokens - tokens) / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", default=["off:float32", "off:bfloat16"])
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--prompts", default="benchmarks/prompts/examples.jsonl", help="comma-separated JSONL files"
    )
    p.add_argument("--model", default=str(DEMO_TARGET))
    p.add_argument("--draft", default=str(DEMO_DRAFT))
    p.add_argument("--weight-dtype", default="bfloat16", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=None, help="request i carries seed + i")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    prompts = [
        json.loads(line)["turns"][0]
        for path in a.prompts.split(",")
        for line in Path(path).read_text().splitlines()
        if line.strip()
    ]
    engines = {v: build(v, a) for v in a.variants}
    results: dict[str, list[float]] = {v: [] for v in a.variants}
    c = a.concurrency
    for engine in engines.values():
        wave(engine, [prompts[i % len(prompts)] for i in range(c)], "warm", a.temperature, a.seed)
    for r in range(a.rounds):
        chunk = [prompts[(r * c + i) % len(prompts)] for i in range(c)]
        for v, engine in engines.items():
            results[v].append(wave(engine, chunk, f"r{r}", a.temperature, a.seed))
    for v, tps in results.items():
        print(f"{v}: rounds {[round(x) for x in tps]} median {statistics.median(tps):.0f} tokens/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
