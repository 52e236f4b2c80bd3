"""A speculative round never verifies drafts past the tokens a request may still emit.

After the prefill's token a request with max_tokens = m may emit m - 1 more; a round that verifies
ℓ drafts emits up to ℓ + 1 tokens, so ℓ is capped at (tokens left) - 1 — a cap on lengths only, so
it cannot bias the output, but verifying beyond it is work whose tokens would be thrown away.
In fixed mode (ℓ = γ otherwise) the verified totals are then exact for short requests.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mimic_pair import GAMMA, build_mimic_pair
from test_engine import Collector, run_all

from dspark_server.config import EngineConfig, SpeculativeConfig
from dspark_server.engine.engine import LLMEngine
from dspark_server.engine.request import SamplingParams


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return build_mimic_pair(tmp_path_factory.mktemp("mimic"))


def test_verify_length_is_capped_by_the_tokens_left(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    spec = SpeculativeConfig(mode="fixed")
    engine = LLMEngine(EngineConfig(model_dir=str(target), draft_dir=str(draft), dtype="float64", spec=spec))
    torch.manual_seed(0)
    col = Collector()
    cases = [(m, t) for m in (2, 3) for t in (0.0, 1.0, 0.7)] * 4
    for i, (m, t) in enumerate(cases):
        engine.add_request(
            str(i), [5, 6, 7][: 1 + i % 3], SamplingParams(temperature=t, max_tokens=m), col.sink(str(i))
        )
    run_all(engine)
    for i, (m, _) in enumerate(cases):
        out = col.final(str(i))
        assert len(col.tokens(str(i))) == m
        # m = 2: one round with nothing to verify. m = 3: the first round verifies one draft, and
        # a second round (if the first emitted one token) verifies none.
        assert out.spec.verified_tokens == m - 2, f"request {i} (max_tokens={m}): {out.spec}"
        assert out.spec.draft_tokens == out.spec.rounds * GAMMA
