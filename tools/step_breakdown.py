"""Where an engine step's time goes: draft / plan / forward / verify (sampling) / commit / other.

    python -m tools.step_breakdown --requests 1 64 --modes off dspark --out runs/step_breakdown.json

Runs the engine in-process on the bundled demo pair (or --model / --draft) with the given number of
concurrent requests (code prompts from --prompts, chat-formatted, 128 tokens, ignore_eos), lets
every request reach decoding, then times --steps decode steps phase by phase by wrapping the
speculative decoder's named phases, the target forward and the engine's commit. The draft gate is
off (every step drafts) unless --gate, so the figures describe one kind of step.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dspark_server.assets import DEMO_DRAFT, DEMO_TARGET
from dspark_server.bench.common import write_json
from dspark_server.config import EngineConfig, SpeculativeConfig
from dspark_server.engine.engine import LLMEngine
from dspark_server.engine.request import SamplingParams
from dspark_server.engine.spec import decoder as decoder_module

PHASES = ("_draft", "_plan", "_observe")


def _wrap(obj: object, name: str, totals: dict[str, float], key: str) -> None:
    inner: Callable[..., Any] = getattr(obj, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - t0

    setattr(obj, name, timed)


def breakdown(
    requests: int,
    mode: str,
    prompts: list[str],
    model: str,
    draft: str,
    steps: int,
    gate: bool,
    temp: float,
    dtype: str = "float32",
    weight_dtype: str = "float32",
) -> dict[str, Any]:
    spec = SpeculativeConfig(mode=mode, draft_gate=gate)  # type: ignore[arg-type]
    cfg = EngineConfig(
        model_dir=model,
        draft_dir=draft if mode != "off" else None,
        max_running=requests,
        spec=spec,
        dtype=dtype,
        weight_dtype=weight_dtype,
    )
    eng = LLMEngine(cfg)
    totals: dict[str, float] = collections.defaultdict(float)
    if eng.spec is not None:
        for name in PHASES:
            _wrap(eng.spec, name, totals, name.strip("_"))
        _wrap(eng.spec.context, "keep_accepted", totals, "keep_accepted")
        _wrap(decoder_module, "verify_forward", totals, "verify")
    _wrap(eng.runner, "forward", totals, "forward")
    _wrap(eng, "commit", totals, "commit")
    for i in range(requests):
        ids = eng.tokenizer.encode_chat([{"role": "user", "content": prompts[i % len(prompts)]}])
        params = SamplingParams(temperature=temp, max_tokens=128, ignore_eos=True)
        eng.add_request(str(i), ids, params, lambda _out: None)
    while eng.scheduler.waiting or any(not r.is_decoding for r in eng.scheduler.running):
        eng.step()
    totals.clear()
    done = 0
    tokens0 = eng.stats.generation_tokens
    verified0 = eng.stats.spec_verified_tokens
    request_steps = 0
    t0 = time.perf_counter()
    while eng.has_work() and done < steps:
        request_steps += sum(r.is_decoding for r in eng.scheduler.running)
        eng.step()
        done += 1
    wall = time.perf_counter() - t0
    ms = {k: 1000 * v / done for k, v in totals.items()}
    # verify contains the forward; the rest of a step is scheduling, sampling and bookkeeping
    if "verify" in ms:
        ms["verify_without_forward"] = ms["verify"] - ms["forward"]
    ms["other"] = 1000 * wall / done - sum(
        v for k, v in ms.items() if k in ("draft", "plan", "verify", "keep_accepted", "observe", "commit")
    )
    if "verify" not in ms:
        ms["other"] -= ms["forward"]
    tokens = eng.stats.generation_tokens - tokens0
    return {
        "requests": requests,
        "mode": mode,
        "temperature": temp,
        "steps": done,
        "tokens_per_s": round(tokens / wall, 1),
        "ms_per_step": round(1000 * wall / done, 3),
        "phases_ms": {k: round(v, 3) for k, v in sorted(ms.items())},
        # drafts verified per decoding request per step, plain steps included (paper's Figure 8)
        "verified_per_request_step": round(
            (eng.stats.spec_verified_tokens - verified0) / max(1, request_steps), 3
        ),
        "threads": torch.get_num_threads(),
        "dtype": dtype,
        "weight_dtype": weight_dtype,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, nargs="+", default=[1, 64])
    p.add_argument(
        "--modes", nargs="+", default=["off", "dspark"], choices=["off", "fixed", "threshold", "dspark"]
    )
    p.add_argument(
        "--prompts", default="benchmarks/prompts/examples.jsonl", help="JSONL with turns or prompt"
    )
    p.add_argument("--model", default=str(DEMO_TARGET))
    p.add_argument("--draft", default=str(DEMO_DRAFT))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--gate", action="store_true", help="keep the draft gate on")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--weight-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    prompts = []
    for line in Path(a.prompts).read_text().splitlines():
        row = json.loads(line)
        prompts.append(row["turns"][0] if "turns" in row else row["prompt"])
    rows = []
    for n in a.requests:
        for mode in a.modes:
            row = breakdown(
                n, mode, prompts, a.model, a.draft, a.steps, a.gate, a.temperature, a.dtype, a.weight_dtype
            )
            print(json.dumps(row))
            rows.append(row)
    if a.out:
        write_json(a.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
