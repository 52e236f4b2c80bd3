"""Prompt-lookup drafts: the proposal continues the latest earlier occurrence of the request's
suffix; the source is chosen from past rounds; verified lookup drafts keep greedy output equal
to plain decoding and sampled output distributed as plain sampling; the drafter's calibration
never sees the lookup's rounds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from exact_sampling import ExactTarget
from test_engine import Collector, run_all
from test_spec_distribution import SEED, Kind, check_against_exact, pair  # noqa: F401 (fixture)
from test_speculative import _FixedDrafts, generate, make_engine

from dspark_server.engine.request import Request, SamplingParams
from dspark_server.engine.spec.lookup import PromptLookup
from dspark_server.engine.spec.rounds import RoundRecord
from dspark_server.testing.tiny import build_tiny_drafter, build_tiny_model


def request(prompt: list[int], output: list[int] = ()) -> Request:  # type: ignore[assignment]
    req = Request("r", list(prompt), SamplingParams(temperature=0.0, max_tokens=64), lambda _o: None)
    req.output_ids.extend(output)
    return req


def test_proposal_continues_the_latest_occurrence_of_the_longest_suffix() -> None:
    lookup = PromptLookup(gamma=5)
    # "1 2 3" occurs twice before the suffix: the latest occurrence (followed by 7) wins
    assert lookup.propose(request([1, 2, 3, 4, 5, 1, 2, 3, 7, 8, 0, 1, 2, 3])) == [7, 8, 0, 1, 2]
    # the longest suffix decides: "5 1 2 3" occurs once (followed by 9), "1 2 3" later (by 4)
    assert lookup.propose(request([5, 1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3])) == [9, 1, 2, 3, 4]
    # a repetition shorter than γ repeats: period 3
    assert lookup.propose(request([4, 5], [6, 4, 5, 6, 4, 5])) == [6, 4, 5, 6, 4]
    assert lookup.propose(request([1, 2, 3, 4, 5, 6])) == []  # nothing repeats
    # incremental: tokens appended later are indexed too
    req = request([1, 2, 3])
    assert lookup.propose(req) == []
    req.output_ids.extend([1, 2])
    assert lookup.propose(req) == [3, 1, 2, 3, 1]


def test_lookup_drafts_where_its_proposals_kept_more_than_the_drafter() -> None:
    lookup = PromptLookup(gamma=4)
    req = request([1, 2, 1, 2])
    assert lookup.propose(req) == [1, 2, 1, 2]
    assert not lookup.prefers(req)  # nothing watched yet: the drafter drafts
    # the drafter's block kept one draft, the proposal matched both tokens the step emitted
    lookup.record(req, False, [1, 2, 1, 2], [1, 2], 4)
    assert lookup.prefers(req)
    # then its own rounds keep nothing, and the drafter's average (1) is not beaten any more
    for _ in range(8):
        lookup.record(req, True, [1, 2, 1, 2], [5], 4)
    assert not lookup.prefers(req)
    # the planner prices lookup rows by the lookup's acceptance per position: position 0 was
    # verified 8 times and never accepted, the later ones never verified (their prior)
    conf = lookup.confidences([4, 2])
    assert conf.shape == (2, 4)
    assert conf[0, 0] < 0.1 and conf[0, 1] == pytest.approx(0.5)
    assert float(conf[1, 2:].abs().sum()) == 0.0  # past a proposal: nothing to accept


@pytest.fixture(scope="module")
def loop_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("loop")
    # a small random target decoding greedily falls into loops
    target = build_tiny_model(root / "target", layers=3, with_eos=False, seed=5, vocab_size=24)
    return target, build_tiny_drafter(target, root / "draft", gamma=4, seed=6)


@pytest.mark.parametrize("mode", ["fixed", "dspark"])
def test_lookup_drafts_keep_greedy_output_and_are_accepted_where_the_drafter_fails(
    loop_pair: tuple[Path, Path], mode: str
) -> None:
    target, draft = loop_pair
    prompts = [[7, 8, 9], [15, 16], [3, 4, 3, 4, 3]]
    params = [SamplingParams(temperature=0, max_tokens=60)] * 3
    ref = generate(make_engine(target, None), prompts, params)
    engine = make_engine(target, draft, mode, prompt_lookup=True)
    spec = engine.spec
    assert spec is not None and spec.lookup is not None
    spec.sample_drafts = _FixedDrafts(engine, wrong=True)  # type: ignore[method-assign]
    rounds: list[RoundRecord] = []
    spec.round_observers.append(rounds.append)
    col = generate(engine, prompts, params)
    for i in range(3):
        assert col.tokens(str(i)) == ref.tokens(str(i))
    # every accepted draft came from the lookup (the drafter is always wrong) ...
    assert engine.stats.spec_accepted_tokens > 60
    # ... and the drafter's rounds, all the calibration sees, accepted nothing
    assert rounds and all(a == 0 for r in rounds for a in r.accepted)
    assert sum(len(r.requests) for r in rounds) < engine.stats.spec_rounds


class _AlwaysLookup(PromptLookup):
    """Drafts by lookup wherever there is a proposal (any token seen before: min_n = 1)."""

    def prefers(self, request: Request) -> bool:
        return True


def test_sampled_lookup_drafts_follow_plain_sampling(pair: tuple[Path, Path]) -> None:  # noqa: F811
    """Verifying the lookup's deterministic drafts (q one-hot) keeps the distribution of the
    first tokens that of plain sampling, for unseeded and top-k rows."""
    kinds = (
        Kind("t1", [5, 6, 7, 5, 6], SamplingParams(temperature=1.0, max_tokens=4), 1500),
        Kind("t0.7-topk4", [1, 2, 1, 2, 1], SamplingParams(temperature=0.7, top_k=4, max_tokens=4), 1500),
    )
    exact_target = ExactTarget.load(pair[0])
    exact = {k.name: exact_target.distribution(k.prompt, k.params, 4) for k in kinds}
    engine = make_engine(pair[0], pair[1], "fixed", prompt_lookup=True, max_model_len=32, max_running=512)
    assert engine.spec is not None
    engine.spec.lookup = _AlwaysLookup(engine.spec.gamma, min_n=1)
    torch.manual_seed(SEED)
    col = Collector()
    for i in range(1500):
        for k in kinds:
            engine.add_request(f"{k.name}/{i}", k.prompt, k.params, col.sink(f"{k.name}/{i}"))
    run_all(engine)
    outputs = {k.name: [tuple(col.tokens(f"{k.name}/{i}")) for i in range(k.count)] for k in kinds}
    check_against_exact(outputs, exact, "lookup", kinds)
    st = engine.stats
    assert st.spec_rounds > 0 and 0.05 < st.spec_accepted_tokens / st.spec_verified_tokens < 0.95
