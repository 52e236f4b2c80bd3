"""Plain-decoding throughput of the engine vs concurrency (continuous batching at work).

    python -m tools.decode_throughput --out runs/decode [--model DIR]

Without ``--model`` it builds a random ~5M-parameter Qwen3 (hidden 256, 6 layers) so the figure
does not depend on the demo checkpoint. Concurrency levels run interleaved, several rounds, and
the median tokens/s per level is reported with its ratio to concurrency 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from dspark_server.bench.common import machine_info, save_figure
from dspark_server.config import EngineConfig
from dspark_server.engine.engine import LLMEngine
from dspark_server.engine.request import SamplingParams
from dspark_server.testing.tiny import build_tiny_model


def measure(engine: LLMEngine, concurrency: int, new_tokens: int, prompt_len: int) -> float:
    """Decode tokens/s with ``concurrency`` requests in flight, prefill excluded."""
    for i in range(concurrency):
        prompt = [(7 * i + j) % 200 + 4 for j in range(prompt_len)]
        engine.add_request(
            f"c{concurrency}-{i}-{time.monotonic_ns()}",
            prompt,
            SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True),
            lambda out: None,
        )
    while any(not r.is_decoding for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill everything first
    before = engine.stats.generation_tokens
    t0 = time.perf_counter()
    while engine.has_work():
        engine.step()
    return (engine.stats.generation_tokens - before) / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="runs/decode_throughput")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    levels = [int(x) for x in a.concurrency.split(",")]
    model_dir = a.model or str(
        build_tiny_model(
            Path(tempfile.mkdtemp()) / "m5",
            hidden=256,
            layers=6,
            heads=4,
            kv_heads=2,
            intermediate=768,
            init_std=0.05,
            with_eos=False,
        )
    )
    engine = LLMEngine(
        EngineConfig(
            model_dir=model_dir,
            max_running=max(levels),
            max_batch_tokens=max(512, max(levels) * a.prompt_len),
        )
    )
    params = sum(p.numel() for p in engine.runner.target.parameters())
    measure(engine, 2, 8, a.prompt_len)  # warm-up
    samples: dict[int, list[float]] = {c: [] for c in levels}
    with tqdm(total=a.rounds * len(levels), desc="decode throughput") as bar:
        for _ in range(a.rounds):
            for c in levels:
                samples[c].append(measure(engine, c, a.new_tokens, a.prompt_len))
                bar.update(1)
    tps = {c: statistics.median(v) for c, v in samples.items()}
    result = {
        "kind": "decode_throughput",
        "machine": {**machine_info(), "torch_threads": torch.get_num_threads()},
        "config": {
            "command": "python -m tools.decode_throughput "
            + " ".join(sys.argv[1:] if argv is None else argv),
            "prompt_len": a.prompt_len,
            "rounds": a.rounds,
        },
        "model_parameters": params,
        "new_tokens": a.new_tokens,
        "runs": [
            {
                "concurrency": c,
                "tokens_per_s": tps[c],
                "samples": samples[c],
                "ratio_vs_1": tps[c] / tps[levels[0]],
            }
            for c in levels
        ],
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2))
    _plot(result, out / "decode_throughput.png")
    for r in result["runs"]:
        print(
            f"concurrency {r['concurrency']:>3}: {r['tokens_per_s']:8.1f} tok/s  "
            f"({r['ratio_vs_1']:.2f}x of concurrency {levels[0]})"
        )


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["concurrency"] for r in result["runs"]]
    ys = [r["tokens_per_s"] for r in result["runs"]]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(xs, ys, marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"Plain decoding, {result['model_parameters'] / 1e6:.1f}M params")
    ax.grid(alpha=0.3)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
