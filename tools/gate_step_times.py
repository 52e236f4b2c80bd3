"""Drafting-step times by what preceded them, one request at a time, in-process.

    python -m tools.gate_step_times --mode dspark --prompts ../shared/prompts/mt-bench.jsonl --limit 12

Runs the prompts one after another (chat template, 128 tokens, ignore_eos, temperature 0 unless
given) on the bundled pair (or --model / --draft) in the given speculation mode and prints
tokens/s; the median time of drafting steps that follow a drafting step ("warm") and of those
that follow a plain step ("cold"); plain steps' median; tokens emitted per drafting step; and,
in dspark mode, the draft gate's state at the end (its load-1 bucket's step times and prior, the
regime priors and the kept / expected ratio). A diagnostic of the gate at concurrency 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from dspark_server.config import EngineConfig, SpeculativeConfig
from dspark_server.engine.engine import LLMEngine
from dspark_server.engine.request import RequestOutput, SamplingParams

DEMO = Path(__file__).resolve().parent.parent / "dspark_server" / "assets" / "demo"


def _median_ms(xs: list[float]) -> str:
    return f"{len(xs)} steps, median {statistics.median(xs) * 1e3:.2f} ms" if xs else "none"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", default="dspark", choices=("fixed", "threshold", "dspark"))
    p.add_argument("--prompts", required=True, help='JSONL with {"turns": [...]} per line')
    p.add_argument("--limit", type=int, default=12)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--model", default=str(DEMO / "target"))
    p.add_argument("--draft", default=str(DEMO / "draft"))
    a = p.parse_args()
    lines = Path(a.prompts).read_text().splitlines()
    prompts = [json.loads(line)["turns"][0] for line in lines if line.strip()][: a.limit]
    cfg = EngineConfig(model_dir=a.model, draft_dir=a.draft, spec=SpeculativeConfig(mode=a.mode))
    engine = LLMEngine(cfg)
    steps: list[tuple[str, float]] = []
    record = engine.stats.record_spec_step

    def spy(n: int, choice: str, predicted: float | None, measured: float) -> None:
        steps.append((choice, measured))
        record(n, choice, predicted, measured)

    engine.stats.record_spec_step = spy  # type: ignore[method-assign, assignment]
    params = SamplingParams(temperature=a.temperature, max_tokens=128, ignore_eos=True)
    tokens, t0 = 0, time.perf_counter()
    for i, text in enumerate(prompts):
        outs: list[RequestOutput] = []
        ids = engine.tokenizer.encode_chat([{"role": "user", "content": text}])
        engine.add_request(f"q{i}", ids, params, outs.append)
        while engine.has_work():
            engine.step()
        tokens += sum(len(o.new_token_ids) for o in outs)
    seconds = time.perf_counter() - t0
    pairs = list(zip(steps, steps[1:], strict=False))
    warm = [m for (before, _), (c, m) in pairs if c == "drafts" and before == "drafts"]
    cold = [m for (before, _), (c, m) in pairs if c == "drafts" and before != "drafts"]
    plain = [m for c, m in steps if c == "plain"]
    s = engine.stats
    print(f"{a.mode}: {tokens / seconds:.0f} tok/s")
    print(f"  drafting after drafting: {_median_ms(warm)}; after plain: {_median_ms(cold)}")
    per_step = s.spec_emitted_tokens / max(1, s.spec_rounds)
    print(f"  plain: {_median_ms(plain)}; tokens per drafting step {per_step:.2f}")
    gate = engine.spec.gate if engine.spec is not None else None
    if gate is not None and gate.bucket_of(1) in gate._buckets:
        b = gate._buckets[gate.bucket_of(1)]
        print(
            f"  gate at load 1: drafting step {b.draft_seconds.value * 1e3:.2f} ms, plain "
            f"{b.plain_seconds.value * 1e3:.2f} ms, prior {b.tokens_per_request.value:.2f} tokens, "
            f"kept / expected {gate.realised_ratio(a.temperature, 1):.2f}"
        )


if __name__ == "__main__":
    main()
