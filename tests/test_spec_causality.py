"""Causality of drafting and planning inside the engine: x_k never influences its own admission.

Intervention tests: the drafter's sequential head is made to propose a chosen token at position K
(everything before K unchanged), and two engine runs that differ only in that token are
compared. The confidence of positions 1..K — computed from x_{k-1} and the backbone state — must
be the same in both; position K+1's, which reads x_K, must differ (the head does look at the
previous token). Through the planner, whether position K is verified must not depend on x_K
either; the paper's appendix-A numbers make a planner that searches past its first
non-improvement verify x1 exactly when x1 is the token that makes c2 high.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from mimic_pair import CONFIDENCE_BY_PREV, GAMMA, build_mimic_pair
from test_engine import Collector, run_all

from dspark_server.config import EngineConfig, SpeculativeConfig
from dspark_server.engine.engine import LLMEngine
from dspark_server.engine.request import SamplingParams
from dspark_server.models.drafter import DSparkDrafter
from dspark_server.planner import SpsCostTable, save_sps_table

CONFIDENT, DOUBTFUL = 0, 1  # previous tokens with high / low raw confidence
assert CONFIDENCE_BY_PREV[CONFIDENT] > CONFIDENCE_BY_PREV[DOUBTFUL]
PROMPTS = [[5, 6, 7], [1, 2], [6, 4], [2, 5, 7], [3, 3], [4]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return build_mimic_pair(tmp_path_factory.mktemp("mimic"))


@pytest.fixture
def force_draft(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[int, int], None]]:
    """force(position, token): the sequential head proposes ``token`` at draft position
    ``position`` (1-based) in every block, from the same step the real head would take."""
    forced: dict[str, int] = {}
    calls = {"k": 0}
    backbone, step_logits = DSparkDrafter.backbone, DSparkDrafter.step_logits

    def counted_backbone(self: DSparkDrafter, *args: object, **kwargs: object) -> object:
        calls["k"] = 0
        return backbone(self, *args, **kwargs)  # type: ignore[arg-type]

    def forcing_step_logits(self: DSparkDrafter, *args: object, **kwargs: object) -> object:
        logits, state = step_logits(self, *args, **kwargs)  # type: ignore[arg-type]
        calls["k"] += 1
        if calls["k"] == forced.get("position"):
            logits = torch.full_like(logits, -30.0)
            logits[:, forced["token"]] = 30.0
        return logits, state

    monkeypatch.setattr(DSparkDrafter, "backbone", counted_backbone)
    monkeypatch.setattr(DSparkDrafter, "step_logits", forcing_step_logits)

    def force(position: int, token: int) -> None:
        forced.update(position=position, token=token)

    yield force


def first_rounds(engine: LLMEngine, params: list[SamplingParams]) -> list[tuple[torch.Tensor, int]]:
    """Every request's first speculative round: (raw confidence logits [γ], verify length)."""
    assert engine.spec is not None
    seen: dict[str, tuple[torch.Tensor, int]] = {}

    def observe(record: object) -> None:
        conf = record.confidence_logits  # type: ignore[attr-defined]
        assert conf is not None, "the drafter has a confidence head: rounds must carry its logits"
        for i, req in enumerate(record.requests):  # type: ignore[attr-defined]
            if req.request_id not in seen:
                seen[req.request_id] = (conf[i].detach().clone(), record.verify_lens[i])  # type: ignore[attr-defined]

    engine.spec.round_observers.append(observe)
    torch.manual_seed(0)
    col = Collector()
    for i, sp in enumerate(params):
        engine.add_request(str(i), PROMPTS[i % len(PROMPTS)], sp, col.sink(str(i)))
    run_all(engine)
    return [seen[str(i)] for i in range(len(params))]


def make_engine(target: Path, draft: Path, mode: str, max_running: int = 64, **spec: object) -> LLMEngine:
    cfg = SpeculativeConfig(
        mode=mode,  # type: ignore[arg-type]
        draft_gate=False,
        price_step_overhead=False,
        live_sps_refresh=False,
        **{"prompt_lookup": False, **spec},  # type: ignore[arg-type]
    )
    return LLMEngine(
        EngineConfig(
            model_dir=str(target),
            draft_dir=str(draft),
            dtype="float64",
            max_model_len=64,
            max_running=max_running,
            spec=cfg,
        )
    )


MIXED = [SamplingParams(temperature=t, top_k=k, max_tokens=12) for t, k in [(0, 0), (1.0, 0), (0.7, 4)] * 4]
GREEDY = [SamplingParams(temperature=0, max_tokens=12)] * 6  # the all-greedy drafting path


@pytest.mark.parametrize("batch", ["mixed", "greedy"])
@pytest.mark.parametrize("position", range(1, GAMMA))
def test_confidence_of_position_k_reads_x_k_minus_1_and_the_backbone_only(
    pair: tuple[Path, Path], force_draft: Callable[[int, int], None], position: int, batch: str
) -> None:
    params = MIXED if batch == "mixed" else GREEDY
    runs = []
    for token in (CONFIDENT, DOUBTFUL):
        force_draft(position, token)
        runs.append(first_rounds(make_engine(*pair, "fixed"), params))
    for i, ((conf_a, _), (conf_b, _)) in enumerate(zip(*runs, strict=True)):
        up_to_k = conf_a[:position] - conf_b[:position]
        assert torch.equal(conf_a[:position], conf_b[:position]), (
            f"request {i} ({_describe(params[i])}): the confidence of positions 1..{position} changed "
            f"with the token drafted at position {position} (differences {up_to_k.tolist()})"
        )
        gap = float(conf_a[position] - conf_b[position])
        expected = CONFIDENCE_BY_PREV[CONFIDENT] - CONFIDENCE_BY_PREV[DOUBTFUL]
        assert abs(gap - expected) < 0.5 * expected, (
            f"request {i}: the confidence of position {position + 1} does not follow x_{position} "
            f"(gap {gap:.2f}, the head's weights give {expected:.2f})"
        )


@pytest.fixture(scope="module")
def steep_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SPS(B) = 1 / (2 + B): at R = 1 the planner admits a draft only when its survival beats
    τ / (2 + B), so with the mimic drafter's confidences some rounds verify 0, 1, 2 or 3 drafts."""
    path = tmp_path_factory.mktemp("steep") / "sps.json"
    probes = tuple(range(1, 9))
    save_sps_table(SpsCostTable(probes, tuple(1.0 / (2 + b) for b in probes), probes[-1]), path)
    return path


@pytest.mark.parametrize("mode", ["threshold", "dspark"])
@pytest.mark.parametrize("position", range(1, GAMMA + 1))
def test_planner_admission_of_a_position_never_depends_on_its_own_token(
    pair: tuple[Path, Path],
    force_draft: Callable[[int, int], None],
    steep_profile: Path,
    mode: str,
    position: int,
) -> None:
    # dspark plans all requests together, and another request's x_k may legitimately move this
    # one's admission (its candidates rank among them); one request at a time isolates the rule.
    spec: dict[str, object] = (
        {"threshold": 0.5} if mode == "threshold" else {"profile_path": str(steep_profile)}
    )
    lens = []
    for token in (CONFIDENT, DOUBTFUL):
        force_draft(position, token)
        engine = make_engine(*pair, mode, max_running=64 if mode == "threshold" else 1, **spec)
        lens.append([ell for _, ell in first_rounds(engine, MIXED)])
    for i, (a, b) in enumerate(zip(*lens, strict=True)):
        assert (a >= position) == (b >= position), (
            f"request {i} ({_describe(MIXED[i])}): position {position} was verified with one drafted token "
            f"there and not with another (ℓ = {a} vs {b})"
        )
    later = [(a, b) for a, b in zip(*lens, strict=True) if a != b]
    if position < GAMMA:  # the confidences after x_k do follow it: later positions may differ
        assert later or mode == "dspark", f"no plan changed with x_{position}: {lens}"
    assert len(set(lens[0])) > 1, f"the plans do not vary, the test shows nothing: {lens[0]}"


def _describe(sp: SamplingParams) -> str:
    return f"temperature {sp.temperature}, top_k {sp.top_k}"


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


@pytest.fixture
def appendix_a(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The method doc's counterexample: γ = 2, SPS(1) = 1.0, SPS(2) = 0.5, SPS(3) = 0.45,
    c1 = 0.8 and c2 = 0.95 after the confident token, 0.1 after any other. The confidences are
    a function of x_{k-1} only (the contract), whatever inputs the engine hands the head."""

    def confidence_logits(
        self: DSparkDrafter, hidden: torch.Tensor, prev_tokens: torch.Tensor
    ) -> torch.Tensor:
        out = torch.full(prev_tokens.shape, _logit(0.1), dtype=torch.float32)
        out[prev_tokens == CONFIDENT] = _logit(0.95)
        out[..., 0] = _logit(0.8)  # position 1: its "previous token" is the anchor
        return out

    monkeypatch.setattr(DSparkDrafter, "confidence_logits", confidence_logits)
    path = tmp_path / "appendix_a.json"
    save_sps_table(SpsCostTable((1, 2, 3), (1.0, 0.5, 0.45), 3), path)
    return path


def test_planner_admission_of_x1_does_not_depend_on_x1(
    pair: tuple[Path, Path], force_draft: Callable[[int, int], None], appendix_a: Path
) -> None:
    params = [SamplingParams(temperature=t, max_tokens=6) for t in (0.0, 1.0, 0.7)] * 3
    lens = {}
    for token in (CONFIDENT, DOUBTFUL):
        force_draft(1, token)
        # one request at a time, so every round plans R = 1 as in the appendix
        engine = make_engine(*pair, "dspark", max_running=1, gamma=2, profile_path=str(appendix_a))
        lens[token] = [ell for _, ell in first_rounds(engine, params)]
    for i, (a, b) in enumerate(zip(lens[CONFIDENT], lens[DOUBTFUL], strict=True)):
        assert (a >= 1) == (b >= 1), (
            f"request {i}: x1 was verified (ℓ={a}) when it was the confident token and not "
            f"(ℓ={b}) otherwise: the value of x1 decided whether x1 is verified"
        )
    # Θ0 = 1.0 > Θ1 = 1.8 · 0.5: DSpark verifies nothing, whatever x1 is.
    assert lens[CONFIDENT] == lens[DOUBTFUL] == [0] * len(params)
