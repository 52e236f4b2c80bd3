"""Seeded requests across loads and speculation modes: same output? and what coupling costs.

    python -m tools.seeded_agreement --loads 1 4 16 32 64 --out runs/seeded.json

Part 1: one seeded request (seed 123, temperature 0.8, 64 tokens) is served by the engine
in-process in every mode (off, fixed, threshold, dspark) next to N - 1 unseeded requests of other
prompts, for each load N; its tokens must be identical everywhere. Part 2: the acceptance rate
(accepted / verified drafts) of fixed-mode rounds at temperature 0.8 on the same prompts, once
with every request seeded (keyed Gumbel-max drafts, coupled verification) and once unseeded
(rejection sampling): the price of reproducibility.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from dspark_server.assets import DEMO_DRAFT, DEMO_TARGET
from dspark_server.bench.common import write_json
from dspark_server.config import EngineConfig, SpeculativeConfig
from dspark_server.engine.engine import LLMEngine
from dspark_server.engine.request import SamplingParams

MODES = ("off", "fixed", "threshold", "dspark")


def _prompts(path: str) -> list[str]:
    out = []
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        out.append(row["turns"][0] if "turns" in row else row["prompt"])
    return out


def _engine(mode: str, running: int) -> LLMEngine:
    spec = SpeculativeConfig(mode=mode, draft_gate=False) if mode != "off" else SpeculativeConfig()  # type: ignore[arg-type]
    return LLMEngine(
        EngineConfig(
            model_dir=str(DEMO_TARGET),
            draft_dir=str(DEMO_DRAFT) if mode != "off" else None,
            max_running=running,
            spec=spec,
        )
    )


def _run(engine: LLMEngine, jobs: list[tuple[str, SamplingParams]]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(jobs))}

    def sink_for(rid: str):  # type: ignore[no-untyped-def]
        return lambda out: tokens[rid].extend(out.new_token_ids)

    for i, (prompt, params) in enumerate(jobs):
        ids = engine.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        engine.add_request(str(i), ids, params, sink_for(str(i)))
    while engine.has_work():
        engine.step()
    return tokens


def agreement(prompts: list[str], loads: list[int]) -> dict[str, Any]:
    seeded = SamplingParams(temperature=0.8, seed=123, max_tokens=64, ignore_eos=True)
    outputs: dict[str, list[int]] = {}
    for mode in MODES:
        for load in loads:
            others = [
                (prompts[(i + 1) % len(prompts)], SamplingParams(temperature=0.8, max_tokens=64))
                for i in range(load - 1)
            ]
            out = _run(_engine(mode, load), [(prompts[0], seeded), *others])
            outputs[f"{mode}@{load}"] = out["0"]
    reference = outputs[f"off@{loads[0]}"]
    same = {k: v == reference for k, v in outputs.items()}
    return {"agreement": sum(same.values()) / len(same), "runs": same, "tokens": reference}


def acceptance_cost(prompts: list[str], requests: int) -> dict[str, float]:
    rates = {}
    for label, seed in (("unseeded", None), ("seeded", 1)):
        torch.manual_seed(0)
        engine = _engine("fixed", requests)
        jobs = [
            (
                prompts[i % len(prompts)],
                SamplingParams(
                    temperature=0.8, seed=None if seed is None else seed + i, max_tokens=96, ignore_eos=True
                ),
            )
            for i in range(requests)
        ]
        _run(engine, jobs)
        st = engine.stats
        rates[label] = st.spec_accepted_tokens / max(1, st.spec_verified_tokens)
        rates[f"{label}_tokens_per_round"] = st.spec_emitted_tokens / max(1, st.spec_rounds)
    return rates


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loads", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    p.add_argument("--prompts", default="benchmarks/prompts/examples.jsonl")
    p.add_argument("--requests", type=int, default=32, help="requests for the acceptance comparison")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    prompts = _prompts(a.prompts)
    result = {"agreement": agreement(prompts, a.loads), "acceptance": acceptance_cost(prompts, a.requests)}
    print(
        json.dumps(
            {
                "agreement": result["agreement"]["agreement"],
                "runs": result["agreement"]["runs"],
                "acceptance": result["acceptance"],
            },
            indent=2,
        )
    )
    if a.out:
        write_json(a.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
