"""Speculation shares the step's token budget with prefill: drafts get what prefill leaves,
prefill gets what plain decoding would give it, and seeded requests emit the same tokens in
every mode and at every load."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from test_engine import Collector
from test_speculative import generate, make_engine

from dspark_server.engine.engine import LLMEngine
from dspark_server.engine.request import SamplingParams
from dspark_server.planner import PlannerConfig, SpsCostTable, cap_lengths, make_planner
from dspark_server.testing.tiny import build_tiny_drafter, build_tiny_model


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("sched_pair")
    target = build_tiny_model(root / "target", layers=2, with_eos=False, seed=11, vocab_size=24)
    return target, build_tiny_drafter(target, root / "draft", gamma=4, seed=12)


def _decoding_engine(
    target: Path, draft: Path | None, mode: str, running: int
) -> tuple[LLMEngine, Collector]:
    engine = make_engine(target, draft, mode, max_running=running + 1, max_batch_tokens=48, prefill_chunk=48)
    col = Collector()
    for i in range(running):
        engine.add_request(
            str(i), [5, 6, 7 + i % 9], SamplingParams(temperature=0, max_tokens=200), col.sink(str(i))
        )
    while not all(r.is_decoding for r in engine.scheduler.running) or len(engine.scheduler.running) < running:
        engine.step()
    return engine, col


@pytest.mark.parametrize("mode", ["fixed", "dspark"])
def test_new_prompt_gets_the_prefill_tokens_plain_decoding_gives_it(
    pair: tuple[Path, Path], mode: str
) -> None:
    target, draft = pair
    running = 20
    plain, _ = _decoding_engine(target, None, "off", running)
    spec, _ = _decoding_engine(target, draft, mode, running)
    long_prompt = list(range(4, 24)) * 10
    chunks = {}
    for name, engine in (("plain", plain), ("spec", spec)):
        engine.add_request("new", long_prompt, SamplingParams(temperature=0, max_tokens=4), lambda _out: None)
        engine.process_inbox()
        sched = engine.scheduler.schedule()
        assert len(sched.decodes) == running
        chunks[name] = [c.num_tokens for c in sched.prefills]
    assert chunks["spec"] == chunks["plain"] == [48 - running]


def test_verification_uses_only_what_prefill_leaves(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    running = 20
    engine, _ = _decoding_engine(target, draft, "fixed", running)
    engine.add_request(
        "new", list(range(4, 24)) * 10, SamplingParams(temperature=0, max_tokens=4), lambda _o: None
    )
    assert engine.spec is not None
    verified = engine.stats.spec_verified_tokens
    engine.step()  # 20 decodes + a 28-token prefill chunk: no room left for drafts
    assert engine.stats.spec_verified_tokens == verified
    while engine.scheduler.waiting or any(not r.is_decoding for r in engine.scheduler.running):
        engine.step()
    engine.step()  # decodes only: 48 - 21 anchors = 27 draft tokens at most (fixed wants 4 x 21)
    assert sum(engine.spec.last_verify_lens) == 48 - 21


def test_a_step_whose_budget_prefill_fills_drafts_for_nobody(pair: tuple[Path, Path]) -> None:
    """No draft pass where no draft can be verified: the step is plain (fixed mode drafts for
    every decode otherwise), and beyond the room left, requests take plain tokens."""
    target, draft = pair
    running = 20
    engine, _ = _decoding_engine(target, draft, "fixed", running)
    stats = engine.stats.spec_steps_by_choice
    before = dict(stats)
    engine.add_request(
        "new", list(range(4, 24)) * 10, SamplingParams(temperature=0, max_tokens=4), lambda _o: None
    )
    engine.step()  # 20 decodes + a 28-token prefill chunk: room 0
    new = {k: v - before.get(k, 0) for k, v in stats.items() if v != before.get(k, 0)}
    assert [choice for _bucket, choice in new] == ["plain"]
    while "new" in engine.requests:  # a free running slot for the next prompt
        engine.step()
    rounds = {r.request_id: r.spec.rounds for r in engine.scheduler.running}
    engine.add_request(
        # (not a prefix of the last prompt, which the prefix cache would serve)
        "more",
        list(range(23, 3, -1)),
        SamplingParams(temperature=0, max_tokens=4),
        lambda _o: None,
    )
    engine.step()  # 20 decodes + the 20-token prompt: room for 8 draft tokens, so 8 requests draft
    drafted = [r for r in engine.scheduler.running if r.spec.rounds > rounds.get(r.request_id, 0)]
    assert len(drafted) == 48 - 20 - 20


def test_cap_admits_positions_position_major() -> None:
    lens = np.array([4, 1, 3, 0])
    assert cap_lengths(lens, None).tolist() == [4, 1, 3, 0]
    assert cap_lengths(lens, 100).tolist() == [4, 1, 3, 0]
    assert cap_lengths(lens, 0).tolist() == [0, 0, 0, 0]
    assert cap_lengths(lens, 2).tolist() == [1, 1, 0, 0]
    assert cap_lengths(lens, 3).tolist() == [1, 1, 1, 0]
    assert cap_lengths(lens, 6).tolist() == [3, 1, 2, 0]
    for cap in range(10):
        out = cap_lengths(lens, cap)
        assert out.sum() == min(cap, lens.sum()) and (out <= lens).all()
        # position-major: whether row r keeps position j never depends on row r's later positions
        longer = cap_lengths(np.array([4, 1, 4, 0]), cap)
        assert min(out[2], 3) == min(longer[2], 3) or longer[2] >= out[2]


def test_table_ending_below_the_reachable_batch_never_makes_verification_free() -> None:
    # Profiling stopped at 16 batch tokens; 32 requests already make B = 32 on their anchors alone.
    short = SpsCostTable((1, 8, 16), (100.0, 90.0, 60.0), 16)
    conf = torch.full((32, 4), 0.6)
    lens = make_planner(PlannerConfig(mode="dspark", gamma=4), short).plan(conf)
    # Past its end the table prices step time in proportion to B: every batch token costs what an
    # anchor costs, and a draft that survives with 0.6 yields less than the anchor's one token.
    assert int(lens.sum()) == 0
    flat_would = make_planner(
        PlannerConfig(mode="dspark", gamma=4), SpsCostTable((1, 8, 16), (100.0, 90.0, 60.0), 512)
    )
    assert int(flat_would.plan(conf).sum()) == 128  # the old flat extrapolation: everything looks free
    assert short.lookup(64) == pytest.approx(60.0 * 16 / 64)


def test_prefill_tokens_in_the_same_forward_price_the_drafts() -> None:
    table = SpsCostTable((1, 8, 9), (100.0, 100.0, 50.0), 64)  # flat to 8, then half speed
    conf = torch.full((2, 3), 0.9)
    planner = make_planner(PlannerConfig(mode="dspark", gamma=3), table)
    assert int(planner.plan(conf).sum()) == 6  # B = 8: all drafts free
    # With 6 prefill tokens in the forward the flat part is gone after 2 drafts.
    assert int(planner.plan(conf, extra_batch_tokens=6).sum()) == 0
    assert int(planner.plan(conf, max_draft_tokens=2).sum()) == 2


@pytest.mark.parametrize("top_k", [0, 5])
def test_seeded_requests_emit_the_same_tokens_in_every_mode_and_load(
    pair: tuple[Path, Path], top_k: int
) -> None:
    target, draft = pair
    rng = random.Random(top_k)
    prompts = [[rng.randrange(4, 24) for _ in range(rng.randrange(2, 12))] for _ in range(6)]
    params = [SamplingParams(temperature=1.0, top_k=top_k, seed=100 + i, max_tokens=24) for i in range(6)]
    ref = generate(make_engine(target, None), prompts, params)
    alone = generate(make_engine(target, None), prompts[:1], params[:1])
    assert alone.tokens("0") == ref.tokens("0")
    for mode in ("fixed", "threshold", "dspark"):
        for running in (1, 6):
            # Unseeded neighbours change the batch (and, in dspark mode, the plan) around them.
            noise = [SamplingParams(temperature=1.0, max_tokens=24)] * 4
            col = generate(
                make_engine(target, draft, mode, max_running=running), prompts + prompts[:4], params + noise
            )
            for i in range(6):
                assert col.tokens(str(i)) == ref.tokens(str(i)), f"{mode} at {running} differs on {i}"
