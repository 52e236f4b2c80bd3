"""Offline speculation modes side by side (issue C's figure): tokens/s ratio to plain decoding and τ.

    python -m tools.generate_modes --prompts ../shared/prompts/humaneval.jsonl \
        --limit 32 --max-tokens 128 --modes off,fixed,dspark --rounds 2 --out runs/generate_modes

One engine per mode is built up front; each round runs every mode over the same prompts in a
rotated order (A B C, B C A, ...) so machine drift hits every mode alike. Tokens are counted from
the generated token ids; wall time covers the whole generation (prefill included).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import cast

import torch
from tqdm import tqdm

from dspark_server.assets import default_draft, default_target
from dspark_server.bench.common import machine_info
from dspark_server.config import SPEC_MODES, EngineConfig, SpecMode, SpeculativeConfig
from dspark_server.engine.engine import LLMEngine
from dspark_server.offline import GenerateConfig, generate


def run_mode(engine: LLMEngine, gen: GenerateConfig) -> dict:
    t0 = time.perf_counter()
    results = list(generate(engine, gen))
    wall = time.perf_counter() - t0
    tokens = sum(len(r["token_ids"]) for r in results)
    rounds = sum(r["spec"]["rounds"] for r in results)
    emitted = sum(r["spec"]["mean_acceptance_length"] * r["spec"]["rounds"] for r in results)
    return {
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_s": tokens / wall,
        "mean_acceptance_length": emitted / rounds if rounds else 1.0,
        "verified_per_round": (
            sum(r["spec"]["verified_tokens"] for r in results) / rounds if rounds else 0.0
        ),
        "token_ids": [r["token_ids"] for r in results],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--draft", default=None)
    p.add_argument("--prompts", required=True, help="comma-separated JSONL files")
    p.add_argument("--limit", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--modes", default="off,fixed,dspark")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="runs/generate_modes")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    model = a.model or default_target()
    draft = a.draft or default_draft()
    modes = [cast(SpecMode, m) for m in a.modes.split(",")]
    if bad := [m for m in modes if m not in SPEC_MODES]:
        p.error(f"--modes: unknown {bad} (choose from {SPEC_MODES})")
    engines = {
        m: LLMEngine(
            EngineConfig(
                model_dir=model,
                draft_dir=None if m == "off" else draft,
                max_running=max(1, a.concurrency),
                spec=SpeculativeConfig(mode=m),
            )
        )
        for m in modes
    }
    files = a.prompts.split(",")
    samples: dict[tuple[str, str], list[dict]] = {}
    with tqdm(total=a.rounds * len(files) * len(modes), desc="modes", file=sys.stderr) as bar:
        for rnd in range(a.rounds):
            for f in files:
                gen = GenerateConfig(
                    prompts=f,
                    limit=a.limit,
                    max_tokens=a.max_tokens,
                    temperature=a.temperature,
                    seed=0,
                    concurrency=a.concurrency,
                    progress=False,
                )
                order = modes[rnd % len(modes) :] + modes[: rnd % len(modes)]
                for mode in order:
                    samples.setdefault((f, mode), []).append(run_mode(engines[mode], replace(gen)))
                    bar.update(1)
    runs = []
    for (f, m), rs in samples.items():
        base = samples[(f, "off")] if "off" in modes else None
        tps = statistics.median(r["tokens_per_s"] for r in rs)
        row = {
            "prompts": Path(f).name,
            "mode": m,
            "tokens_per_s": tps,
            "mean_acceptance_length": rs[0]["mean_acceptance_length"],
            "verified_per_round": rs[0]["verified_per_round"],
            "tokens": rs[0]["tokens"],
        }
        if base is not None:
            row["ratio_vs_off"] = tps / statistics.median(r["tokens_per_s"] for r in base)
            if a.temperature == 0:
                row["output_equals_off"] = rs[0]["token_ids"] == base[0]["token_ids"]
        runs.append(row)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = {**machine_info(), "torch_threads": torch.get_num_threads()}
    result = {
        "kind": "generate_modes",
        "machine": machine,
        "config": {
            "command": "python -m tools.generate_modes " + " ".join(sys.argv[1:] if argv is None else argv)
        },
        "limit": a.limit,
        "max_tokens": a.max_tokens,
        "temperature": a.temperature,
        "concurrency": a.concurrency,
        "rounds": a.rounds,
        "model": model,
        "draft": draft,
        "runs": runs,
    }
    (out / "results.json").write_text(json.dumps(result, indent=2))
    print("| prompts | mode | tokens/s | × off | τ | drafts verified / round | equal to off |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in runs:
        print(
            f"| {r['prompts']} | {r['mode']} | {r['tokens_per_s']:.1f} | {r.get('ratio_vs_off', 1):.2f} | "
            f"{r['mean_acceptance_length']:.2f} | {r['verified_per_round']:.2f} | "
            f"{r.get('output_equals_off', '')} |"
        )


if __name__ == "__main__":
    main()
