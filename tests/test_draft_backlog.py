"""Steps that do not draft defer the drafter-context write; the next drafting step catches up, and
drafts exactly what it would have drafted had every step written its context at once."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from test_speculative import Collector, generate, make_engine, run_all

from dspark_server.engine.engine import LLMEngine
from dspark_server.engine.request import SamplingParams
from dspark_server.engine.spec.draft_gate import DraftGate
from dspark_server.testing.tiny import build_tiny_drafter, build_tiny_model


class ScriptedGate(DraftGate):
    """The gate's choice pinned to a fixed pattern (its real policy depends on timings): True
    drafts for every request, False for none, "even" / "odd" for the requests at even / odd
    places (a partial exploration: the others take plain tokens in the same forward)."""

    def __init__(self, pattern: Sequence[bool | str]) -> None:
        super().__init__()
        self._pattern = itertools.cycle(pattern)

    def holds(self, request_ids: Sequence[str]) -> bool:
        return True  # a scripted choice reads no estimate: plain steps wait to be filed in batches

    def choose(
        self, request_ids: Sequence[str], regimes: Sequence[float] | None = None, room: int | None = None
    ) -> list[int]:
        pick = next(self._pattern)
        if isinstance(pick, str):
            return list(range(0 if pick == "even" else 1, len(request_ids), 2))
        return list(range(len(request_ids))) if pick else []


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("backlog")
    target = build_tiny_model(root / "target", layers=3, with_eos=False, seed=11, vocab_size=32)
    return target, build_tiny_drafter(target, root / "draft", gamma=4, seed=12)


def _scripted_engine(
    pair: tuple[Path, Path], pattern: Sequence[bool | str], max_backlog: int, max_running: int
) -> LLMEngine:
    """Fixed mode (every drafted position verified, so the rounds do not depend on measured
    costs) with the gate's choices scripted and the backlog bounded at ``max_backlog`` steps."""
    target, draft = pair
    engine = make_engine(target, draft, "fixed", max_running=max_running)
    assert engine.spec is not None
    engine.spec.gate = ScriptedGate(pattern)
    engine.spec.deferred.max_steps = max_backlog
    return engine


def _run(
    pair: tuple[Path, Path], max_backlog: int, pattern: Sequence[bool | str]
) -> tuple[LLMEngine, list[torch.Tensor], list[torch.Tensor], dict[str, list[int]], int]:
    engine = _scripted_engine(pair, pattern, max_backlog, max_running=6)
    spec = engine.spec
    assert spec is not None
    tokens: list[torch.Tensor] = []
    logits: list[torch.Tensor] = []
    observe = spec._observe
    most = 0

    def spy(decodes, drafts, plan, outcome, *rest):  # type: ignore[no-untyped-def]
        if drafts.confidence_logits is not None:
            tokens.append(drafts.tokens.clone())
            logits.append(drafts.confidence_logits.clone())
        return observe(decodes, drafts, plan, outcome, *rest)

    after_plain = spec.after_plain  # where a plain step's writes wait, then are put off

    def after_keep(alloc, decodes, *rest):  # type: ignore[no-untyped-def]
        nonlocal most
        after_plain(alloc, decodes, *rest)
        most = max(most, len(spec.deferred) + len(spec.lessons.plain))  # put off, filed or not

    spec._observe = spy  # type: ignore[method-assign]
    spec.after_plain = after_keep  # type: ignore[method-assign]
    rng = random.Random(3)
    prompts = [[rng.randrange(4, 32) for _ in range(rng.randrange(3, 30))] for _ in range(6)]
    col = generate(engine, prompts, [SamplingParams(temperature=0, max_tokens=80)] * 6)
    return engine, tokens, logits, {str(i): col.tokens(str(i)) for i in range(6)}, most


@pytest.mark.parametrize(
    "pattern",
    [(True, False, False, False, False), (False,) * 9 + (True,), ("even", False, "odd", True, "odd", False)],
)
def test_deferred_context_drafts_exactly_what_immediate_writes_draft(
    pair: tuple[Path, Path], pattern: tuple[bool | str, ...]
) -> None:
    _, eager_tokens, eager_logits, eager_out, eager_most = _run(pair, 1, pattern)
    _, lazy_tokens, lazy_logits, lazy_out, lazy_most = _run(pair, 64, pattern)
    # the lazy run did defer: the plain steps between drafting steps, and the first (prefill) step
    # (with partial steps, which defer some of their rows and write others, at least those)
    assert eager_most == 0
    if all(isinstance(p, bool) for p in pattern):
        assert len(pattern) - 1 <= lazy_most <= len(pattern)
    else:
        assert lazy_most >= 2, lazy_most
    assert len(lazy_tokens) == len(eager_tokens) > 4
    for a, b in zip(lazy_tokens, eager_tokens, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(lazy_logits, eager_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    assert lazy_out == eager_out


def test_backlog_is_bounded_and_drafting_after_a_long_plain_run_still_matches(
    pair: tuple[Path, Path],
) -> None:
    pattern = (False,) * 20 + (True,)
    _, eager_tokens, _, _, _ = _run(pair, 1, pattern)
    engine, lazy_tokens, _, _, most = _run(pair, 3, pattern)
    assert most == 2  # never max_steps deferred steps after a step: they are written then
    assert all(torch.equal(a, b) for a, b in zip(lazy_tokens, eager_tokens, strict=True))
    alloc = engine.scheduler.allocator
    assert alloc.free_pages == alloc.capacity_pages  # nothing leaked


def test_take_writes_running_requests_computed_positions_only() -> None:
    """Rows of a finished request are dropped; a running request's rows are written for the
    positions it has computed (a prefill chunk's too), each at the slot that position holds."""
    from dspark_server.engine.kv_cache import PageAllocator
    from dspark_server.engine.request import Request, Status
    from dspark_server.engine.spec.deferred_context import DeferredContext, Run

    alloc = PageAllocator(num_pages=16, page_size=4)

    def request(name: str, length: int, status: Status) -> Request:
        r = Request(name, [1, 2, 3], SamplingParams(max_tokens=4), lambda _o: None, status=status)
        assert alloc.reserve(r.table, length)
        r.table.length = length
        return r

    decoding = request("a", 10, Status.RUNNING)
    finished = request("b", 6, Status.FINISHED)
    prefilling = request("c", 3, Status.RUNNING)  # a 6-token chunk deferred, 3 positions computed
    deferred = DeferredContext()
    features = torch.arange(8.0)[:, None].repeat(1, 5)  # row i holds i
    runs = [Run(decoding, 8), Run(finished, 5), Run(prefilling, 0, 6)]
    assert not deferred.defer(runs, features)
    writes = deferred.take(alloc)
    assert writes is not None and len(deferred) == 0
    assert writes.features[:, 0].tolist() == [0.0, 2.0, 3.0, 4.0]
    assert writes.positions.tolist() == [8, 0, 1, 2]
    expect = [alloc.slots(decoding.table, 8, 9), alloc.slots(prefilling.table, 0, 3)]
    assert writes.slots.tolist() == torch.cat(expect).tolist()
    # c's rows are its prompt's (3 tokens), a's is a generated token's: the prompts' rows are
    # priced as drafting's own cost, not as the switch from plain steps
    assert writes.prompt_rows == 3
    assert deferred.take(alloc) is None  # emptied


def test_steps_whose_requests_all_left_are_dropped_when_deferring() -> None:
    from dspark_server.engine.request import Request, Status
    from dspark_server.engine.spec.deferred_context import DROP_EVERY, DeferredContext, Run

    a = Request("a", [1], SamplingParams(max_tokens=4), lambda _o: None, status=Status.RUNNING)
    b = Request("b", [1], SamplingParams(max_tokens=4), lambda _o: None, status=Status.RUNNING)
    deferred = DeferredContext()
    deferred.defer([Run(a, 0)], torch.zeros(1, 4))
    deferred.defer([Run(b, 0)], torch.zeros(1, 4))
    a.status = Status.FINISHED
    for i in range(DROP_EVERY):  # a look for departed steps every DROP_EVERY deferrals
        deferred.defer([Run(b, 1 + i)], torch.zeros(1, 4))
    assert len(deferred) == 1 + DROP_EVERY  # a's step went; b's stay


def test_a_partial_step_writes_the_drafting_requests_context_and_puts_off_the_others(
    pair: tuple[Path, Path],
) -> None:
    """Drafting for a few requests (the gate exploring) catches up their put-off rows only and
    puts off the plain decodes' new rows, whose tokens come from the plain sampler."""
    target, draft = pair
    engine = make_engine(target, draft, "fixed", max_running=4)
    spec = engine.spec
    assert spec is not None
    spec.gate = ScriptedGate((False, "even", True))  # asked from the first step with decodes
    plain = make_engine(target, None, "off", max_running=4)
    cols = []
    for eng in (engine, plain):
        col = Collector()
        for i in range(4):
            eng.add_request(
                str(i), [5 + i, 6, 7, 8 + i], SamplingParams(temperature=0, max_tokens=12), col.sink(str(i))
            )
        cols.append(col)
    engine.step()  # prefill: every row put off
    engine.step()  # a plain step: more put off
    reqs = [engine.requests[str(i)] for i in range(4)]
    spec.file_lessons()  # plain steps' rows wait to be put off in batches: file them to look
    assert [spec.deferred.pending(r) for r in reqs] == [5, 5, 5, 5]
    engine.step()  # "even": requests 0 and 2 draft
    assert [spec.deferred.pending(r) for r in reqs] == [0, 6, 0, 6]
    assert all(len(r.output_ids) == 3 for r in (reqs[1], reqs[3]))  # one plain token each
    engine.step()  # everyone drafts: everything written
    assert [spec.deferred.pending(r) for r in reqs] == [0, 0, 0, 0] and len(spec.deferred) == 0
    run_all(engine)
    run_all(plain)
    assert all(cols[0].tokens(str(i)) == cols[1].tokens(str(i)) for i in range(4))
    alloc = engine.scheduler.allocator
    assert alloc.free_pages == alloc.capacity_pages


@pytest.mark.parametrize(
    ("pattern", "max_backlog"),
    [
        ((False, False, "even", False, True, "odd", False), 64),
        ((False,) * 6 + (True,), 64),
        ((False,) * 6 + (True,), 3),  # a full backlog is written for every request
        ((True, "even", True, False), 64),  # newcomers' prompts prefilled in drafting steps
    ],
)
def test_each_requests_put_off_rows_are_known_without_scanning_the_backlog(
    pair: tuple[Path, Path], pattern: tuple[bool | str, ...], max_backlog: int
) -> None:
    """What a switch into drafting must write first (the gate prices an exploration with it):
    per request, its computed positions without the drafter's K/V equal the rows the backlog
    holds for it, after plain, partial and drafting steps, prefills and departures alike."""
    engine = _scripted_engine(pair, pattern, max_backlog, max_running=4)
    spec = engine.spec
    assert spec is not None
    rng = random.Random(5)
    for i in range(7):  # more requests than run at once: newcomers join as others leave
        prompt = [rng.randrange(4, 32) for _ in range(rng.randrange(3, 30))]
        engine.add_request(
            str(i), prompt, SamplingParams(temperature=0, max_tokens=rng.randrange(6, 30)), lambda _out: None
        )
    checked = drafted_before = 0
    while engine.has_work():
        engine.step()
        spec.file_lessons()  # plain steps' rows wait to be put off in batches: file them to look
        for req in engine.scheduler.running:
            truth = spec.deferred.pending(req)
            assert req.num_computed - req.drafter_context == truth, (req.request_id, truth)
            checked += truth > 0
            drafted_before += req.drafter_context > 0
        running = [r for r in engine.scheduler.running if not r.context_gap]
        spec.context.row_seconds = 1e-3
        rows = sum(spec.deferred.pending(r) for r in running)
        assert spec.context.pending_seconds(running) == pytest.approx(rows * 1e-3)
    assert checked > 20 and drafted_before > 20  # rows were put off, and drafting wrote some
