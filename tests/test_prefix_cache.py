"""Automatic prefix caching: full pages outlive their request and start a later prompt that
shares their prefix; the tokens are those of a cold prefill, pages are never lost or shared
wrongly, and a request that may draft reuses only pages whose drafter K/V are written."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from test_engine import Collector, run_all
from test_speculative import make_engine

from dspark_server.engine.engine import LLMEngine
from dspark_server.engine.kv_cache import PageAllocator, PageTable
from dspark_server.engine.request import SamplingParams
from dspark_server.testing.tiny import build_tiny_drafter, build_tiny_model

PS = 4


def filled(alloc: PageAllocator, tokens: list[int], need_context: bool = False) -> PageTable:
    """A table started from the cache, then reserved and 'computed' up to all but the last token."""
    t = PageTable()
    alloc.match_prefix(t, tokens, need_context)
    assert alloc.reserve(t, len(tokens) - 1)
    t.length = len(tokens) - 1
    return t


def test_a_released_prefix_is_found_again_page_by_page() -> None:
    alloc = PageAllocator(num_pages=32, page_size=PS, prefix_cache=True)
    first = list(range(100, 114))  # 14 tokens: 13 cached = 3 full pages + 1
    t = filled(alloc, first)
    pages = list(t.pages)
    alloc.release(t, first)

    same = PageTable()
    assert alloc.match_prefix(same, first, need_context=False) == 12  # full pages only
    assert same.pages == pages[:3] and same.length == 12
    alloc.release(same)

    # a token changed in page 2: pages 0 and 1 still match
    other = first[:9] + [7] + first[10:]
    t2 = PageTable()
    assert alloc.match_prefix(t2, other, need_context=False) == 8
    assert t2.pages == pages[:2]
    alloc.release(t2)

    # the prompt's last token is always computed (its logits give the next token): a prompt of
    # exactly 3 pages reuses 2
    t3 = PageTable()
    assert alloc.match_prefix(t3, first[:12], need_context=False) == 8
    alloc.release(t3)

    # a different first page: nothing, though later pages hold the same tokens
    t4 = PageTable()
    assert alloc.match_prefix(t4, [1] + first[1:], need_context=False) == 0


def test_a_prefix_is_shared_while_its_first_owner_runs() -> None:
    alloc = PageAllocator(num_pages=32, page_size=PS, prefix_cache=True)
    system = list(range(50, 58))  # two pages of a shared system prompt
    a_tokens = system + [1, 2, 3]
    a = filled(alloc, a_tokens)
    alloc.name_full_pages(a, a_tokens)  # what the scheduler does as pages fill
    b_tokens = system + [4, 5, 6, 7]
    b = PageTable()
    assert alloc.match_prefix(b, b_tokens, need_context=False) == 8
    assert b.pages[:2] == a.pages[:2]
    assert alloc.reserve(b, 11)
    assert b.pages[2] != a.pages[2]  # the pages each writes are its own
    free = alloc.free_pages
    alloc.release(a, a_tokens)
    assert alloc.free_pages == free + 1  # only a's own page: b still holds the shared two
    b.length = 11
    alloc.release(b, b_tokens)
    assert alloc.free_pages == alloc.capacity_pages


def test_idle_pages_are_evicted_least_recently_left_first_tail_before_head() -> None:
    alloc = PageAllocator(num_pages=7, page_size=PS, prefix_cache=True)  # 6 usable pages
    old = list(range(10, 23))  # 3 full pages + 1 token
    new = list(range(30, 43))
    for tokens in (old, new):
        t = filled(alloc, tokens)
        alloc.release(t, tokens)
    assert alloc.free_pages == 6  # idle pages count as free
    taker = PageTable()
    assert alloc.reserve(taker, 2 * PS)  # two pages: both from `old`, its tail first
    probe = PageTable()
    assert alloc.match_prefix(probe, old, need_context=False) == PS  # its head page survived
    alloc.release(probe)
    assert alloc.match_prefix(probe, new, need_context=False) == 3 * PS
    alloc.release(probe)


def test_a_prefix_that_may_be_drafted_from_needs_the_drafters_context() -> None:
    alloc = PageAllocator(num_pages=16, page_size=PS, prefix_cache=True)
    tokens = list(range(60, 73))
    t = filled(alloc, tokens)
    assert alloc.cache is not None
    alloc.cache.mark_context(t.slots[: PS + 2])  # page 0 and half of page 1 written
    alloc.release(t, tokens)
    probe = PageTable()
    assert alloc.match_prefix(probe, tokens, need_context=True) == PS
    alloc.release(probe)
    assert alloc.match_prefix(probe, tokens, need_context=False) == 3 * PS
    alloc.release(probe)
    # a page handed out afresh forgets what its slots held of the drafter
    grab = PageTable()
    assert alloc.reserve(grab, 15 * PS)
    assert not alloc.cache.context.any()


def test_a_cached_page_is_never_truncated_into() -> None:
    alloc = PageAllocator(num_pages=16, page_size=PS, prefix_cache=True)
    tokens = list(range(9))
    t = filled(alloc, tokens)
    alloc.release(t, tokens)
    t = filled(alloc, tokens)
    with pytest.raises(ValueError, match="cached pages"):
        alloc.truncate(t, PS + 1)
    alloc.truncate(t, 2 * PS)


def test_random_traffic_never_hands_a_page_to_two_writers_or_loses_one() -> None:
    rng = random.Random(3)
    alloc = PageAllocator(num_pages=40, page_size=PS, prefix_cache=True)
    stems = [[rng.randrange(5) for _ in range(rng.randint(3, 20))] for _ in range(4)]
    live: list[tuple[PageTable, list[int]]] = []
    for _ in range(600):
        if live and (rng.random() < 0.45 or alloc.free_pages < 8):
            t, tokens = live.pop(rng.randrange(len(live)))
            alloc.release(t, tokens if rng.random() < 0.8 else None)
        else:
            tokens = rng.choice(stems) + [rng.randrange(5) for _ in range(rng.randint(1, 12))]
            t = PageTable()
            found = alloc.match_prefix(t, tokens, need_context=False)
            assert found % PS == 0 and found < len(tokens)
            if not alloc.reserve(t, len(tokens)):
                alloc.release(t)
                continue
            # write the new positions: a page a table writes must be held by that table alone
            for p in range(found // PS, len(t.pages)):
                assert sum(p2 == t.pages[p] for x, _ in live for p2 in x.pages) == 0
            t.length = len(tokens) - 1
            alloc.name_full_pages(t, tokens)
            live.append((t, tokens))
        held = {p for x, _ in live for p in x.pages}
        assert alloc.free_pages == alloc.capacity_pages - len(held)
    for t, tokens in live:
        alloc.release(t, tokens)
    assert alloc.free_pages == alloc.capacity_pages


# ---- the engine ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("prefix-pair")
    target = build_tiny_model(root / "target", layers=2, with_eos=False, seed=11, vocab_size=24)
    return target, build_tiny_drafter(target, root / "draft", gamma=4, seed=12)


def serve(engine: LLMEngine, waves: list[list[list[int]]], max_tokens: int = 12) -> Collector:
    """Each wave's prompts together, the waves one after another."""
    col = Collector()
    for w, prompts in enumerate(waves):
        for i, prompt in enumerate(prompts):
            rid = f"{w}-{i}"
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            engine.add_request(rid, prompt, params, col.sink(rid))
        run_all(engine)
    return col


def waves_sharing_prefixes(seed: int) -> list[list[list[int]]]:
    rng = random.Random(seed)
    system = [rng.randrange(24) for _ in range(21)]
    first = [system + [rng.randrange(24) for _ in range(rng.randint(2, 9))] for _ in range(3)]
    return [first, [first[0], first[1][:-1], system + [5, 6], first[2] + [7, 8, 9, 10, 11]]]


def full_pages(n: int) -> int:
    return n // PS * PS


@pytest.mark.parametrize("mode", ["off", "fixed", "dspark"])
def test_cached_prefixes_give_the_tokens_and_drafts_of_a_cold_prefill(
    pair: tuple[Path, Path], mode: str
) -> None:
    target, draft = pair
    waves = waves_sharing_prefixes(1)
    draft_dir = None if mode == "off" else draft
    engines = [make_engine(target, draft_dir, mode, page_size=PS, prefix_cache=c) for c in (False, True)]
    cold, warm = (serve(e, waves) for e in engines)
    # a next turn: the last prompt, its answer and a new message
    turn = waves[1][3] + cold.tokens("1-3")[:9] + [1]
    cold_turn, warm_turn = (serve(e, [[turn]]) for e in engines)
    for a, b in ((cold, warm), (cold_turn, warm_turn)):
        for rid in a.outputs:
            assert b.tokens(rid) == a.tokens(rid), rid
            # the drafter read the same context: its drafts, hence what was accepted, are the same
            assert b.final(rid).spec == a.final(rid).spec, rid
            assert a.final(rid).cached_tokens == 0
    cached = {rid: warm.final(rid).cached_tokens for rid in warm.outputs}
    first, again = waves
    assert [cached[f"0-{i}"] for i in range(3)] == [0, 0, 0]  # admitted in one step: nothing to share
    assert cached["1-0"] == full_pages(len(again[0]) - 1)  # the same prompt again
    assert cached["1-1"] == full_pages(len(again[1]) - 1)  # a prefix of one
    assert cached["1-2"] == full_pages(21)  # the shared system prompt's full pages
    assert cached["1-3"] == full_pages(len(first[2]))  # a prompt seen, then more
    assert warm_turn.final("0-0").cached_tokens == full_pages(len(turn) - 1)  # its answer's pages too
    stats = engines[1].stats
    assert stats.prefix_cache_hits == sum(cached.values()) + warm_turn.final("0-0").cached_tokens
    prompts = sum(len(p) for w in waves for p in w) + len(turn)
    assert stats.prompt_tokens == prompts - stats.prefix_cache_hits
    assert stats.prefix_cache_queries == prompts - sum(len(w) for w in waves) - 1  # each less its last
    assert engines[0].stats.prompt_tokens == prompts
    alloc = engines[1].runner.allocator
    assert alloc.free_pages == alloc.capacity_pages  # everything idle or free: nothing leaked


def test_a_prefix_without_drafter_context_is_prefilled_again(pair: tuple[Path, Path]) -> None:
    """A request that never drafted (one token: prefill, sample, done) leaves pages whose drafter
    K/V were put off and never written; a drafting request must not start from them."""
    target, draft = pair
    prompt = [int(t) for t in np.random.default_rng(4).integers(0, 24, 30)]
    engine = make_engine(target, draft, "fixed", page_size=PS)
    serve(engine, [[prompt]], max_tokens=1)
    second = serve(engine, [[prompt]])
    assert second.final("0-0").cached_tokens == 0
    cold = serve(make_engine(target, draft, "fixed", page_size=PS, prefix_cache=False), [[prompt]])
    assert second.tokens("0-0") == cold.tokens("0-0")
    assert second.final("0-0").spec == cold.final("0-0").spec
    # the second request drafted, so its pages' drafter K/V are written: a third one reuses them
    third = serve(engine, [[prompt]])
    assert third.final("0-0").cached_tokens == 28
    assert third.final("0-0").spec == cold.final("0-0").spec


def test_a_running_requests_prompt_is_shared_with_prompts_admitted_after_it(pair: tuple[Path, Path]) -> None:
    target, _ = pair
    engine = make_engine(target, None, "off", page_size=PS)
    system = list(range(1, 22))
    col = Collector()
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine.add_request("a", system + [2, 3], greedy, col.sink("a"))
    for _ in range(3):
        engine.step()
    engine.add_request("b", system + [4], greedy, col.sink("b"))
    engine.step()
    assert "a" in engine.requests  # still decoding when b arrived
    run_all(engine)
    assert col.final("b").cached_tokens == full_pages(21)
    cold = serve(make_engine(target, None, "off", page_size=PS, prefix_cache=False), [[system + [4]]], 40)
    assert col.tokens("b") == cold.tokens("0-0")


def test_where_drafting_stopped_a_prefix_without_drafter_context_is_reused_without_drafting(
    pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where drafting is not expected (pinned here), a prompt reuses cached pages whose drafter
    K/V were never written, and that request decodes without drafting; the tokens are a cold
    prefill's. At such a load plain steps keep no features either, so a request with a prompt
    of its own does not draft there; with drafting expected it does."""
    target, draft = pair
    prompt = [int(t) for t in np.random.default_rng(4).integers(0, 24, 30)]
    other = [int(t) for t in np.random.default_rng(5).integers(0, 24, 30)]
    engine = make_engine(target, draft, "fixed", page_size=PS)
    assert engine.spec is not None
    monkeypatch.setattr(engine.spec, "prefix_needs_context", lambda load, request: False)
    monkeypatch.setattr(engine.spec, "keeps_features", lambda load: False)
    serve(engine, [[prompt]], max_tokens=1)  # never drafts: its pages lack the drafter's K/V
    warm = serve(engine, [[prompt, other]])
    cold = serve(make_engine(target, draft, "fixed", page_size=PS, prefix_cache=False), [[prompt, other]])
    assert warm.final("0-0").cached_tokens == 28
    assert warm.final("0-0").spec.rounds == 0  # no context to draft from: plain decoding
    assert cold.final("0-0").spec.rounds > 0
    assert warm.final("0-1").spec.rounds == 0  # its own prompt, at a load that keeps no features
    assert cold.final("0-1").spec.rounds > 0  # (drafting expected: it drafts)
    assert warm.tokens("0-0") == cold.tokens("0-0") and warm.tokens("0-1") == cold.tokens("0-1")


def test_a_load_that_relearns_reuses_cached_prompts_and_lets_new_ones_draft(
    pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """At a load where drafting is not expected but whose requests keep the drafter's context
    again (the gate relearning it: ``DraftGate.keeps_context``), a prompt cached without the
    drafter's K/V is reused as it is (not prefilled again) and decodes without drafting, while
    a prompt of its own keeps its features and drafts; the tokens are a cold prefill's."""
    target, draft = pair
    prompt = [int(t) for t in np.random.default_rng(4).integers(0, 24, 30)]
    other = [int(t) for t in np.random.default_rng(5).integers(0, 24, 30)]
    engine = make_engine(target, draft, "fixed", page_size=PS)
    assert engine.spec is not None
    monkeypatch.setattr(engine.spec, "prefix_needs_context", lambda load, request: False)
    keeps = {"on": False}
    monkeypatch.setattr(engine.spec, "keeps_features", lambda load: keeps["on"])
    serve(engine, [[prompt]], max_tokens=1)  # cached without the drafter's K/V
    keeps["on"] = True
    warm = serve(engine, [[prompt, other]])
    cold = serve(make_engine(target, draft, "fixed", page_size=PS, prefix_cache=False), [[prompt, other]])
    assert warm.final("0-0").cached_tokens == 28 and warm.final("0-0").spec.rounds == 0
    assert warm.final("0-1").spec.rounds > 0
    assert warm.tokens("0-0") == cold.tokens("0-0") and warm.tokens("0-1") == cold.tokens("0-1")


def test_a_prefix_without_drafter_context_is_reused_where_the_load_it_joins_does_not_draft(
    pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whether a new request reuses cached pages that lack the drafter's K/V follows the load it
    joins (every request running or waiting), not the gate's latest choice: with the gate
    having found drafting worth it at one request only (``drafts_at``), a prompt sent alone
    prefills again (it may draft), and the same prompt in a wave of three reuses the pages and
    decodes without drafting."""
    target, draft = pair
    prompt = [int(t) for t in np.random.default_rng(4).integers(0, 24, 30)]
    others = [[int(t) for t in np.random.default_rng(s).integers(0, 24, 30)] for s in (5, 6)]
    engine = make_engine(target, draft, "dspark", page_size=PS, draft_gate=True)
    assert engine.spec is not None and engine.spec.gate is not None
    loads: list[int] = []

    def drafts_at(load: int, regime: float) -> bool:
        loads.append(load)
        return load < 2

    monkeypatch.setattr(engine.spec.gate, "drafts_at", drafts_at)
    monkeypatch.setattr(engine.spec, "drafting", lambda decodes, room=None: [])  # plain steps
    serve(engine, [[prompt]], max_tokens=1)  # plain steps put its context writes off: never written
    alone = serve(engine, [[prompt]], max_tokens=1)
    assert alone.final("0-0").cached_tokens == 0  # it may draft at one request: no reuse
    wave = serve(engine, [[prompt, *others]])
    assert wave.final("0-0").cached_tokens == 28
    assert 3 in loads
    cold = serve(make_engine(target, draft, "off", page_size=PS, prefix_cache=False), [[prompt, *others]])
    assert [wave.tokens(f"0-{i}") for i in range(3)] == [cold.tokens(f"0-{i}") for i in range(3)]


def test_plain_steps_keep_no_drafter_features_at_a_load_where_drafting_is_not_expected(
    pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """At a load where the gate does not expect drafting, a plain step captures no features for
    the drafter (nothing is put off: at 64 requests on the demo pair, holding them cost ~9% of
    the time in page faults) and its requests never draft; at a load where it does, the step
    keeps them. The tokens are plain decoding's either way."""
    target, draft = pair
    prompts = [[int(t) for t in np.random.default_rng(s).integers(0, 24, 30)] for s in (4, 5, 6)]
    engine = make_engine(target, draft, "dspark", page_size=PS, draft_gate=True)
    assert engine.spec is not None and engine.spec.gate is not None
    monkeypatch.setattr(engine.spec.gate, "expects_drafting", lambda load: load < 2)
    monkeypatch.setattr(engine.spec, "drafting", lambda decodes, room=None: [])  # plain steps
    kept: list[tuple[bool, bool]] = []  # per plain step: (features kept, all its requests gapped)
    after_plain = engine.spec.after_plain

    def spy(alloc, decodes, positions, prefills, forward, seconds):  # type: ignore[no-untyped-def]
        requests = decodes + [c.request for c in prefills]
        gapped = all(r.context_gap for r in requests)
        kept.append((forward.output.hidden is not None, gapped))
        after_plain(alloc, decodes, positions, prefills, forward, seconds)

    monkeypatch.setattr(engine.spec, "after_plain", spy)
    alone = serve(engine, [[prompts[0]]], max_tokens=6)
    assert kept and all(k and not gapped for k, gapped in kept)
    kept.clear()
    held = len(engine.spec.deferred)
    wave = serve(engine, [prompts])
    assert kept and all(not k and gapped for k, gapped in kept)
    assert len(engine.spec.deferred) <= held  # nothing put off
    cold = serve(make_engine(target, None, "off", page_size=PS), [[prompts[0]]], max_tokens=6)
    assert alone.tokens("0-0") == cold.tokens("0-0")
    off = serve(make_engine(target, None, "off", page_size=PS), [prompts])
    assert [wave.tokens(f"0-{i}") for i in range(3)] == [off.tokens(f"0-{i}") for i in range(3)]


def test_a_running_request_keeps_its_drafter_context_when_the_load_moves_where_drafting_is_not_expected(
    pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whether a request keeps the drafter's context is settled when it is admitted: requests
    that join a load where drafting is not expected never draft, and one already running keeps
    its features (and its ability to draft) through their steps. Served on the K=8 twin at 16
    requests, the load dipped to 15 between a request leaving and the next arriving, and
    marking every running request there left one in 16 able to draft."""
    target, draft = pair
    prompts = [[int(t) for t in np.random.default_rng(s).integers(0, 24, 30)] for s in (10, 11, 12)]
    engine = make_engine(target, draft, "dspark", page_size=PS, draft_gate=True)
    spec = engine.spec
    assert spec is not None
    monkeypatch.setattr(spec, "keeps_features", lambda load: load < 2)
    monkeypatch.setattr(spec, "prefix_needs_context", lambda load, request: load < 2)
    monkeypatch.setattr(spec, "drafting", lambda decodes, room=None: [])  # plain steps
    kept: list[tuple[bool, bool]] = []  # per plain step with the first request decoding
    after_plain = spec.after_plain

    def spy(alloc, decodes, positions, prefills, forward, seconds):  # type: ignore[no-untyped-def]
        if any(r.request_id == "a" for r in decodes):
            kept.append((forward.output.hidden is not None, len(decodes) + len(prefills) > 1))
        after_plain(alloc, decodes, positions, prefills, forward, seconds)

    monkeypatch.setattr(spec, "after_plain", spy)
    col = Collector()
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine.add_request("a", prompts[0], greedy, col.sink("a"))
    for _ in range(4):
        engine.step()
    short = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts[1:]):
        engine.add_request(f"b{i}", prompt, short, col.sink(f"b{i}"))
    engine.step()  # (admits them)
    joined = [engine.requests[f"b{i}"] for i in range(2)]
    first = engine.requests["a"]
    run_all(engine)
    assert all(r.context_gap for r in joined) and not first.context_gap
    assert any(shared for _, shared in kept) and all(hidden for hidden, _ in kept)
    off = make_engine(target, None, "off", page_size=PS)
    alone = serve(off, [[prompts[0]]], max_tokens=24)
    assert col.tokens("a") == alone.tokens("0-0")


def test_steps_where_no_request_can_draft_do_not_ask_the_gate(
    pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where every decoding request of a step was admitted without the drafter's context, the
    step is plain without a choice: asked anyway, the gate chose to explore requests that could
    not draft (in-process on the demo pair at one request, MT-Bench, temperature 1: ~2300
    explorations in 3072 steps, a full choice at nearly every step, ~8% of the time), and no
    choice could teach it anything. The steps count towards the load's ``relearn_steps``."""
    target, draft = pair
    prompts = [[int(t) for t in np.random.default_rng(s).integers(0, 24, 30)] for s in (7, 8, 9)]
    engine = make_engine(target, draft, "dspark", page_size=PS, draft_gate=True)
    gate = engine.spec.gate if engine.spec is not None else None
    assert gate is not None
    monkeypatch.setattr(gate, "expects_drafting", lambda load: False)
    asked, skipped = [], []
    choose, skip = gate.choose, gate.skip
    monkeypatch.setattr(gate, "choose", lambda *a, **k: asked.append(1) or choose(*a, **k))
    monkeypatch.setattr(gate, "skip", lambda n: skipped.append(n) or skip(n))
    wave = serve(engine, [prompts])
    assert not asked and skipped and set(skipped) <= {1, 2, 3}
    off = serve(make_engine(target, None, "off", page_size=PS), [prompts])
    assert [wave.tokens(f"0-{i}") for i in range(3)] == [off.tokens(f"0-{i}") for i in range(3)]


def test_a_request_that_stops_inside_a_round_leaves_only_the_pages_its_tokens_name(tmp_path: Path) -> None:
    """A request that stops inside a speculative round (a stop token among the drafts the
    target accepted) keeps the K/V of drafts past its last token. Its pages are named only as
    far as its tokens go: greedy and sampled, each request ends for its own reason, never an
    engine error, with a cold engine's tokens, and no page leaks."""
    from mimic_pair import VOCAB, build_mimic_pair

    target, draft = build_mimic_pair(tmp_path)
    n_requests = 32
    for temperature in (0.0, 1.0):
        engines = [make_engine(target, draft, "fixed", page_size=PS, prefix_cache=c) for c in (False, True)]
        cols = []
        for engine in engines:
            col = Collector()
            for n in range(n_requests):
                stop = ((n * 3) % VOCAB,)
                params = SamplingParams(max_tokens=40, temperature=temperature, seed=n, stop_token_ids=stop)
                prompt = [1 + n % 5, 2, 3, 4, 5, (n * 7) % VOCAB, 6]
                engine.add_request(str(n), prompt, params, col.sink(str(n)))
            run_all(engine)
            cols.append(col)
            alloc = engine.runner.allocator
            assert alloc.free_pages == alloc.capacity_pages
        cold, warm = cols
        reasons = [warm.final(str(n)).finish_reason for n in range(n_requests)]
        assert reasons == [cold.final(str(n)).finish_reason for n in range(n_requests)], temperature
        assert "error" not in reasons and "stop" in reasons, reasons
        for n in range(n_requests):
            assert warm.tokens(str(n)) == cold.tokens(str(n)), (temperature, n)
        assert sum(warm.final(str(n)).spec.rounds for n in range(n_requests)) > 2 * n_requests


def test_a_prefix_without_drafter_context_is_reused_at_a_load_the_gate_has_not_chosen_at(
    pair: tuple[Path, Path],
) -> None:
    """In dspark mode a cached prompt lacking the drafter's K/V is prefilled again only where the
    gate has found drafting worth it (``DraftGate.drafts_at``), not merely expected it for want
    of choices: on a fresh engine a request joining any load reuses it as it is (and never
    drafts), while a new prompt there still keeps the drafter's context. Served at 16 requests,
    the first requests of each wave joined loads of 1-7 and prefilled again ~960 prompt tokens a
    round that off mode took from the cache."""
    target, draft = pair
    prompt = [int(t) for t in np.random.default_rng(4).integers(0, 24, 30)]
    engine = make_engine(target, draft, "dspark", page_size=PS, draft_gate=True)
    spec = engine.spec
    assert spec is not None and spec.gate is not None
    assert spec.keeps_features(1) and spec.gate.drafts_at(1, 0.0) is False
    serve(engine, [[prompt]], max_tokens=1)  # its pages' drafter K/V are put off, never written
    second = serve(engine, [[prompt]], max_tokens=6)
    assert second.final("0-0").cached_tokens == 28  # reused, not prefilled again
    assert engine.stats.prompt_tokens == len(prompt) + len(prompt) - 28
    cold = serve(make_engine(target, None, "off", page_size=PS, prefix_cache=False), [[prompt]], 6)
    assert second.tokens("0-0") == cold.tokens("0-0")
