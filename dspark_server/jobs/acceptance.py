"""`dspark eval acceptance`: the paper's offline setting — one request at a time, full-γ
verification, no scheduler — mean τ (bonus included) and per-position conditional acceptance."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dspark_server.config import EngineConfig
from dspark_server.engine.engine import LLMEngine
from dspark_server.engine.spec.rounds import RoundRecord
from dspark_server.offline import GenerateConfig, generate


@dataclass(frozen=True)
class AcceptanceConfig:
    engine: EngineConfig
    generate: GenerateConfig
    out_dir: str | None = None


class AcceptanceRecorder:
    def __init__(self, gamma: int) -> None:
        self.gamma = gamma
        self.accepted: list[int] = []

    def __call__(self, record: RoundRecord) -> None:
        self.accepted += [
            a for a, ell in zip(record.accepted, record.verify_lens, strict=True) if ell == self.gamma
        ]

    def summary(self) -> dict[str, Any]:
        n = len(self.accepted)
        reached = [sum(a >= k for a in self.accepted) for k in range(self.gamma + 1)]
        conditional = [reached[k + 1] / reached[k] if reached[k] else float("nan") for k in range(self.gamma)]
        return {
            "rounds": n,
            "gamma": self.gamma,
            "mean_acceptance_length": (sum(self.accepted) + n) / n if n else float("nan"),
            "per_position_conditional_acceptance": conditional,
            "per_position_prefix_survival": [
                reached[k + 1] / n if n else float("nan") for k in range(self.gamma)
            ],
        }


def run_acceptance(cfg: AcceptanceConfig) -> dict[str, Any]:
    engine = LLMEngine(replace(cfg.engine, spec=replace(cfg.engine.spec, mode="fixed")))
    assert engine.spec is not None, "acceptance evaluation needs a drafter"
    recorder = AcceptanceRecorder(engine.spec.gamma)
    engine.spec.round_observers.append(recorder)
    for _ in generate(engine, replace(cfg.generate, concurrency=1)):
        pass
    result = {
        "prompts": cfg.generate.prompts,
        "limit": cfg.generate.limit,
        "temperature": cfg.generate.temperature,
        "max_tokens": cfg.generate.max_tokens,
        "draft": cfg.engine.draft_dir,
        **recorder.summary(),
    }
    if cfg.out_dir:
        out = Path(cfg.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "acceptance.json").write_text(json.dumps(result, indent=2))
        plot_acceptance([result], out / "acceptance.png")
    return result


def plot_acceptance(results: list[dict[str, Any]], path: Path, labels: list[str] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    for i, r in enumerate(results):
        ks = list(range(1, r["gamma"] + 1))
        label = labels[i] if labels else f"τ = {r['mean_acceptance_length']:.2f}"
        ax.plot(ks, r["per_position_conditional_acceptance"], marker="o", label=label)
    ax.set_xlabel("draft position k")
    ax.set_ylabel("P(accept k | accepted k-1)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
