"""Speculative decoding is lossless: greedy equality, exact distributions, oracle drafts, rollback."""

from __future__ import annotations

import functools
import random
import tempfile
import time
from pathlib import Path

import pytest
import torch
from test_engine import Collector, run_all

from dspark_server.config import EngineConfig, SpeculativeConfig
from dspark_server.engine.engine import LLMEngine
from dspark_server.engine.request import SamplingParams
from dspark_server.engine.sampling import SamplingTensors, shape_probs
from dspark_server.engine.spec.drafting import Drafts
from dspark_server.models.attention import DenseCausalAttention
from dspark_server.planner import (
    CalibrationSet,
    RegimeCalibration,
    StsCalibration,
    SurvivalMap,
    save_calibration_set,
    save_sts_calibration,
)
from dspark_server.testing.tiny import build_tiny_drafter, build_tiny_model, write_flat_sps_profile

MODES = ("fixed", "threshold", "dspark")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("pair")
    # A small vocabulary lets random drafts be right now and then: accepts and rejections both occur.
    target = build_tiny_model(root / "target", layers=3, with_eos=False, seed=5, vocab_size=24)
    return target, build_tiny_drafter(target, root / "draft", gamma=4, seed=6)


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("small")
    target = build_tiny_model(root / "target", layers=2, with_eos=False, seed=7, vocab_size=12, init_std=0.08)
    return target, build_tiny_drafter(target, root / "draft", gamma=3, seed=8, init_std=0.05)


@functools.cache
def pinned_costs() -> str:
    """An SPS table in which a step costs the same at any batch size (verifying more is free):
    the planner's choices then depend on the drafts alone, never on a start-up profile's timings."""
    return str(write_flat_sps_profile(Path(tempfile.mkdtemp(prefix="pinned-sps-")) / "flat.json"))


def make_engine(target: Path, draft: Path | None, mode: str = "off", **kw: object) -> LLMEngine:
    # The measured-time parts of dspark mode (draft gate, step-overhead pricing, the start-up SPS
    # profile and its live refresh) are pinned unless a test asks for the draft gate: random tiny
    # drafters rarely pay off, a busy machine's profile can make verification look ruinous, and
    # these tests need rounds to happen. So is the prompt lookup off: these tests count the
    # drafter's rounds (tests/test_prompt_lookup.py).
    measured = bool(kw.pop("draft_gate", False))
    spec = SpeculativeConfig(
        mode=mode if draft else "off",
        threshold=0.3,  # type: ignore[arg-type]
        draft_gate=measured,
        price_step_overhead=bool(kw.pop("price_step_overhead", False)),
        prompt_lookup=bool(kw.pop("prompt_lookup", False)),
        profile_path=None if measured else pinned_costs(),
        live_sps_refresh=measured,
    )
    cfg = EngineConfig(
        model_dir=str(target),
        draft_dir=str(draft) if draft else None,
        dtype="float64",
        max_batch_tokens=kw.pop("max_batch_tokens", 1024),
        spec=spec,
        **kw,
    )  # type: ignore[arg-type]
    return LLMEngine(cfg)


def generate(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> Collector:
    col = Collector()
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), p, sp, col.sink(str(i)))
    run_all(engine)
    return col


@pytest.mark.parametrize("concurrency", [1, 8, 32])
def test_greedy_output_equals_plain_decoding_in_every_mode(pair: tuple[Path, Path], concurrency: int) -> None:
    target, draft = pair
    rng = random.Random(concurrency)
    prompts = [[rng.randrange(4, 24) for _ in range(rng.randrange(2, 40))] for _ in range(concurrency)]
    params = [SamplingParams(temperature=0, max_tokens=256)] * concurrency
    ref = generate(make_engine(target, None), prompts, params)
    for mode in MODES:
        engine = make_engine(target, draft, mode, max_running=concurrency)
        col = generate(engine, prompts, params)
        for i in range(concurrency):
            assert col.tokens(str(i)) == ref.tokens(str(i)), f"{mode} differs on request {i}"
            assert len(col.tokens(str(i))) == 256
        st = engine.stats
        assert st.spec_rounds > 0 and st.spec_accepted_tokens > 0
        assert st.spec_accepted_tokens < st.spec_verified_tokens  # random drafts: rejections happen
    # the server's default dspark mode: measured step costs and the draft gate choose ℓ (and
    # whether to draft at all) from timings, which must not change a single token
    engine = make_engine(
        target, draft, "dspark", max_running=concurrency, draft_gate=True, price_step_overhead=True
    )
    col = generate(engine, prompts, params)
    assert all(col.tokens(str(i)) == ref.tokens(str(i)) for i in range(concurrency))


def test_stops_inside_an_accepted_block_cut_exactly_where_plain_decoding_stops(
    pair: tuple[Path, Path],
) -> None:
    target, draft = pair
    prompts = [[9, 10, 11], [20, 21], [10, 7, 7, 7]]
    free = generate(make_engine(target, None), prompts, [SamplingParams(temperature=0, max_tokens=60)] * 3)
    params = []
    for i in range(3):
        toks, text = free.tokens(str(i)), free.text(str(i))
        params.append(
            SamplingParams(
                temperature=0,
                max_tokens=60,
                stop_token_ids=(toks[20],),
                stop=(text[len(text) // 3 : len(text) // 3 + 2],),
            )
        )
    ref = generate(make_engine(target, None), prompts, params)
    for mode in MODES:
        col = generate(make_engine(target, draft, mode), prompts, params)
        for i in range(3):
            assert col.tokens(str(i)) == ref.tokens(str(i))
            assert col.text(str(i)) == ref.text(str(i))
            assert col.final(str(i)).finish_reason == ref.final(str(i)).finish_reason == "stop"


def _exact_distribution_of_tokens_2_and_3(
    engine: LLMEngine, prompt: list[int], sp: SamplingParams
) -> torch.Tensor:
    """P(t2, t3) = sum_a P(t1 = a) P(t2 | a) P(t3 | a, t2): the tokens of the first speculative round
    (t1 comes from the prefill step)."""
    target = engine.runner.target
    vocab = target.config.vocab_size
    s = SamplingTensors.from_params([sp])

    def probs_after(ids: list[int]) -> torch.Tensor:
        out = target(torch.tensor(ids), torch.arange(len(ids)), DenseCausalAttention(1, len(ids)))
        return shape_probs(out.logits[-1:].double(), s)[0].double()

    joint = torch.zeros(vocab, vocab, dtype=torch.float64)
    with torch.no_grad():
        first = probs_after(prompt)
        for a in range(vocab):
            second = probs_after(prompt + [a])
            for b in range(vocab):
                joint[b] += first[a] * second[b] * probs_after(prompt + [a, b])
    return joint.flatten()


def _empirical(engine: LLMEngine, prompt: list[int], sp: SamplingParams, n: int, seed0: int) -> torch.Tensor:
    vocab = engine.runner.target.config.vocab_size
    col = Collector()
    for i in range(n):
        params = SamplingParams(
            temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, seed=seed0 + i, max_tokens=4
        )
        engine.add_request(f"s{seed0}-{i}", prompt, params, col.sink(str(i)))
    run_all(engine)
    counts = torch.zeros(vocab * vocab, dtype=torch.float64)
    for i in range(n):
        _, b, c, _ = col.tokens(str(i))
        counts[b * vocab + c] += 1
    return counts / n


@pytest.mark.parametrize(
    "sp", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_p=0.8, top_k=6)]
)
def test_emitted_distribution_equals_target_distribution(
    small_vocab_pair: tuple[Path, Path], sp: SamplingParams
) -> None:
    target, draft = small_vocab_pair
    engine = make_engine(target, draft, "fixed", max_running=256)
    prompt = [5, 3, 9]
    exact = _exact_distribution_of_tokens_2_and_3(engine, prompt, sp)
    small = _empirical(engine, prompt, sp, 200, seed0=0)
    large = _empirical(engine, prompt, sp, 4000, seed0=10_000)
    assert engine.stats.spec_accepted_tokens > 0
    assert engine.stats.spec_accepted_tokens < engine.stats.spec_verified_tokens
    gen = torch.Generator().manual_seed(0)
    refs = [
        torch.distributions.Dirichlet(torch.ones(exact.numel(), dtype=torch.float64)).sample()
        for _ in range(5)
    ]
    refs += [
        shape_probs(
            torch.randn(1, exact.numel(), generator=gen).double() * 2,
            SamplingTensors.from_params([SamplingParams()]),
        )[0]
        for _ in range(5)
    ]

    def tv(a: torch.Tensor, b: torch.Tensor) -> float:
        return 0.5 * float((a - b).abs().sum())

    assert tv(large, exact) < 0.6 * tv(small, exact)  # converges to the exact distribution ...
    assert tv(large, exact) < 0.25 * min(tv(large, r) for r in refs)  # ... and to nothing else


class _FixedDrafts:
    """Test drafter policy: propose the target's greedy continuation, optionally all wrong."""

    def __init__(self, engine: LLMEngine, wrong: bool) -> None:
        self.engine = engine
        self.wrong = wrong

    def __call__(self, decodes, block, anchors, sampling, generators) -> Drafts:
        target, gamma = self.engine.runner.target, self.engine.spec.gamma  # type: ignore[union-attr]
        vocab = target.config.vocab_size
        rows = []
        for req in decodes:
            ids = list(req.all_ids)
            for _ in range(gamma):
                out = target(torch.tensor(ids), torch.arange(len(ids)), DenseCausalAttention(1, len(ids)))
                ids.append(int(out.logits[-1].argmax()))
            proposal = ids[-gamma:]
            rows.append([(t + 1) % vocab for t in proposal] if self.wrong else proposal)
        return Drafts(torch.tensor(rows), None, torch.full((len(decodes), gamma), 5.0))


@pytest.mark.parametrize("wrong", [False, True])
def test_oracle_and_always_wrong_drafters(pair: tuple[Path, Path], wrong: bool) -> None:
    target, draft = pair
    prompts = [[7, 8, 9], [15, 16]]
    params = [SamplingParams(temperature=0, max_tokens=41)] * 2
    ref = generate(make_engine(target, None), prompts, params)
    engine = make_engine(target, draft, "fixed")
    engine.spec.sample_drafts = _FixedDrafts(engine, wrong)  # type: ignore[union-attr,method-assign]
    col = generate(engine, prompts, params)
    for i in range(2):
        assert col.tokens(str(i)) == ref.tokens(str(i))
        spec = col.final(str(i)).spec
        gamma = engine.spec.gamma  # type: ignore[union-attr]
        if wrong:
            assert spec.accepted_tokens == 0 and spec.mean_acceptance_length == 1.0
        else:
            # 41 tokens: the first comes from prefill, then 8 full rounds of γ + 1 = 5 tokens.
            assert spec.rounds == 8 and spec.accepted_tokens == 8 * gamma
            assert spec.mean_acceptance_length == gamma + 1


def test_rollback_keeps_kv_accounting_exact_over_thousands_of_rounds(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    # The draft gate would skip most drafting with this random (slow, rarely right) drafter.
    engine = make_engine(
        target,
        draft,
        "dspark",
        page_size=4,
        num_pages=120,
        max_running=12,
        max_model_len=160,
        prefill_chunk=24,
        max_batch_tokens=96,
        draft_gate=False,
    )
    alloc = engine.runner.allocator
    start = alloc.free_pages
    rng = random.Random(3)
    col = Collector()
    for i in range(120):
        prompt = [rng.randrange(4, 24) for _ in range(rng.randrange(1, 50))]
        sp = SamplingParams(temperature=rng.choice([0.0, 1.0]), seed=i, max_tokens=rng.randrange(1, 100))
        engine.add_request(str(i), prompt, sp, col.sink(str(i)))
        for _ in range(rng.randrange(0, 4)):
            engine.step()
        if rng.random() < 0.15:
            engine.abort(str(rng.randrange(0, i + 1)))
    run_all(engine)
    assert engine.stats.spec_rounds > 1000
    assert engine.stats.spec_accepted_tokens < engine.stats.spec_verified_tokens
    assert alloc.free_pages == start
    assert all(col.final(str(i)).finished for i in range(120))
    assert {col.final(str(i)).finish_reason for i in range(120)} <= {"length", "abort"}


def test_spec_statistics_add_up(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    engine = make_engine(target, draft, "fixed")
    col = generate(engine, [[5, 6, 7]], [SamplingParams(temperature=0, max_tokens=50)])
    spec = col.final("0").spec
    gamma = engine.spec.gamma  # type: ignore[union-attr]
    assert spec.draft_tokens == spec.rounds * gamma
    assert spec.accepted_tokens <= spec.verified_tokens <= spec.draft_tokens
    assert 1 + spec.emitted_tokens == 50  # first token from prefill, the rest from rounds
    assert spec.emitted_tokens == spec.accepted_tokens + spec.rounds  # one target token per round


def test_temperature_zero_rows_are_planned_with_the_greedy_calibration(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    target, draft = pair  # the tiny drafter has γ = 4 and no calibration files of its own
    greedy_file = tmp_path / "greedy.json"
    save_sts_calibration(StsCalibration(temperatures=(0.5, 0.5, 2.0, 2.0)), greedy_file)

    def engine(greedy: str | None) -> LLMEngine:
        spec = SpeculativeConfig(mode="fixed", greedy_calibration_path=greedy)
        return LLMEngine(EngineConfig(model_dir=str(target), draft_dir=str(draft), spec=spec))

    raw = torch.tensor([[1.0, -1.0, 2.0, 0.5]] * 2)
    temperatures = torch.tensor([0.0, 0.7])  # a greedy row and a sampled one
    with_file = engine(str(greedy_file)).spec
    assert with_file is not None
    conf = with_file.calibrate(raw, temperatures)
    assert torch.allclose(conf[0], torch.sigmoid(raw[0] / torch.tensor([0.5, 0.5, 2.0, 2.0])), atol=1e-6)
    assert torch.allclose(conf[1], torch.sigmoid(raw[1]), atol=1e-6)  # sampled: the (identity) STS
    without = engine(None).spec  # no greedy file: every row by the sampled STS
    assert without is not None
    assert torch.allclose(without.calibrate(raw, temperatures), torch.sigmoid(raw), atol=1e-6)
    with pytest.raises(FileNotFoundError):
        engine(str(tmp_path / "missing.json"))


def test_rows_are_planned_with_the_regime_of_their_sampling_temperature(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    target, draft = pair
    survivals = {0.0: (0.9, 0.8, 0.7, 0.6), 0.5: (0.6, 0.3, 0.2, 0.1), 1.0: (0.4, 0.2, 0.1, 0.05)}
    regimes = [  # constant survival per regime (one knot per position)
        RegimeCalibration(t, (1.0,) * 4, SurvivalMap(((0.0,),) * 4, tuple((s,) for s in surv)))
        for t, surv in survivals.items()
    ]
    cal_file = tmp_path / "cal.json"
    save_calibration_set(CalibrationSet(tuple(regimes)), cal_file)
    spec = SpeculativeConfig(mode="fixed", calibration_path=str(cal_file))
    decoder = LLMEngine(EngineConfig(model_dir=str(target), draft_dir=str(draft), spec=spec)).spec
    assert decoder is not None
    raw = torch.randn(4, 4)
    survival = torch.cumprod(decoder.calibrate(raw, torch.tensor([0.0, 0.5, 1.0, 0.75])), dim=1)
    halfway = [(a + b) / 2 for a, b in zip(survivals[0.5], survivals[1.0], strict=True)]
    want = torch.tensor([survivals[0.0], survivals[0.5], survivals[1.0], halfway])
    assert torch.allclose(survival, want, atol=1e-6)


def test_the_loops_time_between_steps_reaches_the_gate_not_idle_time(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    engine = make_engine(target, draft, "dspark", draft_gate=True, price_step_overhead=True)
    spec = engine.spec
    assert spec is not None and spec.gate is not None
    seen: list[tuple[int, bool, float]] = []
    record = spec.record_outside

    def spy(n: int, drafted: bool, seconds: float) -> None:
        seen.append((n, drafted, seconds))
        record(n, drafted, seconds)

    spec.record_outside = spy  # type: ignore[method-assign]
    params = [SamplingParams(temperature=0, max_tokens=40)]
    generate(engine, [[5, 6, 7]], params)
    steps = engine.stats.steps
    time.sleep(0.3)  # idle: not a cost of the step before it
    generate(engine, [[8, 9, 10, 11]], params)
    # every step after a decoding step of the same request reported the gap, nothing more
    assert len(seen) == engine.stats.steps - 4 and steps >= 30
    assert all(n == 1 and 0.0 <= s < 0.3 for n, _, s in seen)
    bucket = spec.gate._buckets[spec.gate.bucket_of(1)]
    assert bucket.outside_draft.count + bucket.outside_plain.count == len(seen)
    assert {d for _, d, _ in seen} == {True, False}  # warm-up steps of both kinds


def _engine_holding(pair: tuple[Path, Path], drafting: bool) -> tuple[LLMEngine, list[int]]:
    """A dspark engine whose gate, once warm, holds one choice (drafting or plain) for 8 steps at
    a time, and the number of lessons waiting at each of its full choices."""
    engine = make_engine(*pair, "dspark", draft_gate=True, price_step_overhead=True)
    spec = engine.spec
    assert spec is not None and spec.gate is not None
    gate = spec.gate
    waiting_at_full_choice: list[int] = []
    full_choose = gate._choose
    hold = gate._hold_drafting if drafting else gate._hold_plain

    def spy_choose(
        ids: list[str],
        regimes: list[float] | None,
        whole: bool,
        remaining: list[int] | None,
        able: list[int] | None,
        catch_up_seconds: float = 0.0,
    ) -> list[int]:
        lessons = spec.lessons
        waiting_at_full_choice.append(len(lessons.plain) + len(lessons.outside) + len(lessons.drafts))
        if gate._bucket(len(ids)).measured(gate.min_samples):
            gate._steps += 1
            return hold(ids, gate._bucket(len(ids)), 8)
        return full_choose(ids, regimes, whole, remaining, able, catch_up_seconds)

    gate._choose = spy_choose  # type: ignore[method-assign]
    return engine, waiting_at_full_choice


def test_held_plain_steps_teach_the_gate_before_its_next_full_choice(pair: tuple[Path, Path]) -> None:
    # plain steps' lessons wait while the gate holds a plain choice (HeldLessons), and must all
    # be filed before it chooses in full and when the engine goes idle
    engine, waiting_at_full_choice = _engine_holding(pair, drafting=False)
    spec = engine.spec
    assert spec is not None and spec.gate is not None
    gate = spec.gate
    filed = []
    record_plain = gate.record_plain

    def spy_plain(n: int, seconds: float) -> None:
        filed.append(n)
        record_plain(n, seconds)

    record_plain_many = gate.record_plain_many  # a held run of plain steps is filed in one call

    def spy_plain_many(n: int, seconds: list[float]) -> None:
        filed.extend([n] * len(seconds))
        record_plain_many(n, seconds)

    gate.record_plain = spy_plain  # type: ignore[method-assign]
    gate.record_plain_many = spy_plain_many  # type: ignore[method-assign]
    # decode-only plain forwards also time the live SPS table
    assert spec.live_sps is not None
    live_record, after_plain, file_lessons = spec.live_sps.record, spec.after_plain, spec.file_lessons
    timed: list[int] = []  # forwards the live table timed while the plain lessons were filed
    decode_only: list[int] = []
    filing = [False]

    def spy_live(batch_tokens: int, seconds: float) -> bool:
        if filing[0]:
            timed.append(batch_tokens)
        return live_record(batch_tokens, seconds)

    def spy_file(alloc: object = None) -> None:
        filing[0] = True
        file_lessons(alloc)  # type: ignore[arg-type]
        filing[0] = False

    def spy_after(alloc: object, decodes: list, positions: list, prefills: list, *rest: object) -> None:
        if decodes and not prefills:
            decode_only.append(len(decodes))
        after_plain(alloc, decodes, positions, prefills, *rest)  # type: ignore[arg-type]

    live_record_many = spec.live_sps.record_many

    def spy_live_many(batch_tokens: int, seconds: list[float]) -> None:
        if filing[0]:
            timed.extend([batch_tokens] * len(seconds))
        live_record_many(batch_tokens, seconds)

    spec.live_sps.record = spy_live  # type: ignore[method-assign]
    spec.live_sps.record_many = spy_live_many  # type: ignore[method-assign]
    spec.after_plain = spy_after  # type: ignore[method-assign]
    spec.file_lessons = spy_file  # type: ignore[method-assign]
    plain_steps = engine.stats.spec_steps_by_choice
    generate(engine, [[5, 6, 7], [8, 9]], [SamplingParams(temperature=0, max_tokens=60)] * 2)
    plain = sum(n for (_, choice), n in plain_steps.items() if choice == "plain")
    assert plain >= 40 and len(waiting_at_full_choice) >= 5
    assert all(n == 0 for n in waiting_at_full_choice)  # nothing waited into a full choice
    assert len(filed) == plain and not spec.lessons  # idle: every plain step filed
    assert decode_only and timed == decode_only  # one token per decoding request, each filed


def test_held_drafting_steps_teach_the_gate_before_its_next_full_choice(pair: tuple[Path, Path]) -> None:
    # while the gate holds drafting, each drafting step's lesson waits (HeldLessons) and must be
    # filed before the gate chooses in full, and when the engine goes idle
    engine, waiting_at_full_choice = _engine_holding(pair, drafting=True)
    spec = engine.spec
    assert spec is not None and spec.gate is not None
    gate = spec.gate
    filed: list[int] = []
    gate_record = gate.record

    def spy_record(ids: list[str], drafted: bool, *args: object, **kwargs: object) -> None:
        if drafted:
            filed.append(len(ids))
        gate_record(ids, drafted, *args, **kwargs)  # type: ignore[arg-type]

    gate.record = spy_record  # type: ignore[method-assign]
    waiting_after_step: list[int] = []
    record = spec.record

    def spy_step_record(*args: object) -> None:
        record(*args)  # type: ignore[arg-type]
        waiting_after_step.append(len(spec.lessons.drafts))

    spec.record = spy_step_record  # type: ignore[method-assign]
    generate(engine, [[5, 6, 7], [8, 9]], [SamplingParams(temperature=0, max_tokens=60)] * 2)
    drafting_steps = len(waiting_after_step)
    assert drafting_steps >= 10 and len(waiting_at_full_choice) >= 3
    assert max(waiting_after_step) >= 4  # lessons did wait while drafting was held ...
    assert all(n == 0 for n in waiting_at_full_choice)  # ... but never into a full choice
    assert len(filed) == drafting_steps and not spec.lessons  # idle: every drafting step filed
