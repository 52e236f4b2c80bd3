"""In-process A/B of speculation modes under churn: a new request arrives whenever one finishes.

    python -m tools.churn_ab --concurrency 16 --temperature 1 --requests 64 --variants off dspark pinned

Each variant's engine is built once (bundled demo pair unless --model / --draft) and warmed at
concurrency 1, 4, 16 and the measured one, as the earlier points of a serving sweep warm a server;
then rounds of ``--requests`` requests (chat-formatted prompts from --prompts, 128 tokens,
ignore_eos) run variant after variant, interleaved. Variants: ``off``, ``fixed``, ``dspark`` (the
draft gate deciding), ``pinned`` (dspark mode with the gate pinned to plain steps: what dspark
mode's bookkeeping costs a plain step), ``no-margin`` (the gate entering drafting as soon as
its forecast wins at all: ``DraftGate.enter_margin`` 1), ``no-hold`` (the gate choosing in
full at every step: ``DraftGate.max_hold`` 0), ``odds-square`` (explorations budgeted by the
square of drafting's rate ratio, not its fourth power: ``DraftGate.odds_power`` 2),
``fast-prior`` (the gate's priors moving as fast as its step times:
``RequestForecasts.prior_smoothing`` 0.05) and ``no-gate`` (dspark mode without the draft gate:
every step drafts and the planner alone decides what to verify). Prints tokens/s per round, then each
variant's median and its ratio to ``off``. A diagnostic of the engine alone: the serving sweep is
the figure that counts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from dspark_server.assets import DEMO_DRAFT, DEMO_TARGET
from dspark_server.config import EngineConfig, SpeculativeConfig
from dspark_server.engine.engine import LLMEngine
from dspark_server.engine.request import RequestOutput, SamplingParams
from dspark_server.engine.spec.draft_gate import DraftGate

GATE_VARIANTS = ("pinned", "no-margin", "no-hold", "odds-square", "fast-prior", "no-gate")
VARIANTS = ("off", "fixed", "dspark", *GATE_VARIANTS)


def _pin_plain(gate: DraftGate) -> None:
    """Every full choice of ``gate`` is a plain one, held as long as the gate holds any (so that
    the held steps cost what the gate's own held plain steps cost)."""

    def choose(
        request_ids: Sequence[str],
        regimes: Sequence[float] | None,
        whole: bool,
        remaining: Sequence[int] | None,
        able: Sequence[int] | None = None,
        catch_up_seconds: float = 0.0,
    ) -> list[int]:
        gate._steps += 1
        return gate._hold_plain(request_ids, gate._bucket(len(request_ids)), gate.max_hold)

    gate._choose = choose  # type: ignore[method-assign]
    gate.expects_drafting = lambda num_requests: False  # type: ignore[method-assign]
    gate.keeps_context = lambda num_requests: False  # type: ignore[method-assign]


def build(
    variant: str, model: str, draft: str, max_running: int, weight_dtype: str, threads: int | None
) -> LLMEngine:
    mode = "dspark" if variant in GATE_VARIANTS else variant
    spec = SpeculativeConfig(mode=mode, draft_gate=variant != "no-gate")  # type: ignore[arg-type]
    cfg = EngineConfig(
        model_dir=model,
        draft_dir=None if mode == "off" else draft,
        max_running=max_running,
        spec=spec,
        weight_dtype=weight_dtype,  # type: ignore[arg-type]
        num_threads=threads,
    )
    engine = LLMEngine(cfg)
    gate = engine.spec.gate if engine.spec is not None else None
    if variant == "pinned" and gate is not None:
        _pin_plain(gate)
    if variant == "no-margin" and gate is not None:
        gate.enter_margin = 1.0
    if variant == "no-hold" and gate is not None:
        gate.max_hold = 0
    if variant == "odds-square" and gate is not None:
        gate.odds_power = 2.0
    if variant == "fast-prior" and gate is not None:  # the priors as fast as the step times
        gate.forecasts.prior_smoothing = gate.smoothing
    return engine


def drive(
    engine: LLMEngine, prompts: list[str], concurrency: int, temp: float, total: int, tag: str
) -> float:
    """Tokens/s while ``total`` requests run, ``concurrency`` at a time."""
    state = {"done": 0, "tokens": 0, "sent": 0}

    def sink(out: RequestOutput) -> None:
        state["tokens"] += len(out.new_token_ids)
        state["done"] += out.finished

    def add() -> None:
        text = prompts[state["sent"] % len(prompts)]
        ids = engine.tokenizer.encode_chat([{"role": "user", "content": text}])
        params = SamplingParams(temperature=temp, max_tokens=128, ignore_eos=True)
        engine.add_request(f"{tag}-{state['sent']}", ids, params, sink)
        state["sent"] += 1

    for _ in range(min(concurrency, total)):
        add()
    t0 = time.perf_counter()
    while state["done"] < total:
        before = state["done"]
        engine.step()
        for _ in range(state["done"] - before):
            if state["sent"] < total:
                add()
    return state["tokens"] / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--requests", type=int, default=64, help="requests per measured round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", nargs="+", default=["off", "dspark", "pinned"], choices=VARIANTS)
    p.add_argument(
        "--prompts", default="benchmarks/prompts/examples.jsonl", help="JSONL with turns or prompt"
    )
    p.add_argument("--model", default=str(DEMO_TARGET))
    p.add_argument("--draft", default=str(DEMO_DRAFT))
    p.add_argument("--weight-dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None, help="engine threads (default: every CPU)")
    a = p.parse_args(argv)
    prompts = []
    for line in Path(a.prompts).read_text().splitlines():
        row = json.loads(line)
        prompts.append(row["turns"][0] if "turns" in row else row["prompt"])
    engines = {
        v: build(v, a.model, a.draft, max(64, a.concurrency), a.weight_dtype, a.threads) for v in a.variants
    }
    for engine in engines.values():
        for c in sorted({1, 4, 16, a.concurrency}):
            drive(engine, prompts, c, a.temperature, max(c, 8), f"warm{c}")
    results: dict[str, list[float]] = {v: [] for v in a.variants}
    for r in range(a.rounds):
        for v, engine in engines.items():
            results[v].append(drive(engine, prompts, a.concurrency, a.temperature, a.requests, f"r{r}"))
            print(f"round {r} {v}: {results[v][-1]:.0f} tok/s", flush=True)
    base = statistics.median(results["off"]) if "off" in results else None
    for v, tps in results.items():
        ratio = f"  ({statistics.median(tps) / base:.3f} x off)" if base else ""
        print(f"{v}: median {statistics.median(tps):.0f} tok/s{ratio}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
