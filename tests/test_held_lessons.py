"""Plain steps filed in one go (``HeldLessons.replay``) teach the gate, the step-overhead estimate
and the live SPS table exactly what filing them one at a time did, and put off the same rows."""

from __future__ import annotations

import math
import random

import pytest
import torch

from dspark_server.engine.kv_cache import PageAllocator
from dspark_server.engine.request import Request, SamplingParams, Status
from dspark_server.engine.scheduler import ScheduledChunk
from dspark_server.engine.spec.deferred_context import DeferredContext, Run
from dspark_server.engine.spec.draft_gate import DraftGate
from dspark_server.engine.spec.held_lessons import HeldLessons, PlainStep
from dspark_server.engine.spec.step_lessons import teach_plain
from dspark_server.engine.spec.step_overhead import StepOverhead
from dspark_server.planner.live import LiveSpsTable
from dspark_server.planner.sps import SpsCostTable

FEATURES = 3


def _requests(alloc: PageAllocator, count: int) -> list[Request]:
    out = []
    for i in range(count):
        r = Request(str(i), [1, 2, 3], SamplingParams(max_tokens=64), lambda _o: None, status=Status.RUNNING)
        assert alloc.reserve(r.table, 60)
        r.table.length = 60
        out.append(r)
    return out


def _steps(reqs: list[Request], rng: random.Random) -> list[PlainStep]:
    """Runs of decode-only steps of two and of four requests, with a step that also prefills,
    one that only prefills, and step times a lesson must skip (zero, NaN), as a held plain choice and
    the steps around it make them."""
    steps, position, row = [], 10, 0
    for kind in ["2"] * 7 + ["4"] * 5 + ["prefill"] + ["2"] * 4 + ["prefill-only"] + ["4"] * 9:
        decodes = [] if kind == "prefill-only" else reqs[: 4 if kind == "4" else 2]
        prefills = [ScheduledChunk(reqs[4], position, 4, False)] if "prefill" in kind else []
        rows = len(decodes) + 4 * len(prefills)
        features = torch.arange(row, row + rows, dtype=torch.float32)[:, None].repeat(1, FEATURES)
        row += rows
        forward = rng.uniform(1e-3, 2e-3)
        step = forward + rng.choice([rng.uniform(1e-4, 3e-4), -forward, math.nan, rng.uniform(1e-4, 3e-4)])
        batch = len(decodes) + 4 * len(prefills)
        prefill = 4 * len(prefills)
        steps.append(
            PlainStep(decodes, [position] * len(decodes), prefills, features, forward, batch, prefill, step)
        )
        position += 1
    return steps


def test_a_batch_of_plain_steps_teaches_and_puts_off_what_each_step_did_one_at_a_time() -> None:
    rng = random.Random(5)
    alloc = PageAllocator(num_pages=96, page_size=4)
    reqs = _requests(alloc, 5)
    steps = _steps(reqs, rng)
    outside = [(len(s.decodes), rng.uniform(1e-4, 2e-4)) for s in steps if s.decodes]
    outside[5] = (outside[5][0], 5e-3)  # a stall: clipped to a multiple of the estimate
    table = SpsCostTable((1, 2, 4, 8), (900.0, 850.0, 700.0, 400.0), 64)

    def estimators() -> tuple[DraftGate, StepOverhead, LiveSpsTable, DeferredContext]:
        return DraftGate(), StepOverhead(), LiveSpsTable(table), DeferredContext()

    one_gate, one_overhead, one_live, one_rows = estimators()
    for step in steps:  # one step at a time, as each step used to file itself
        chunks = [Run(c.request, c.start, c.num_tokens) for c in step.prefills]
        one_rows.defer(chunks, step.features, step.decodes, step.positions)
        if not step.decodes or step.step_seconds is None:
            continue
        if not step.prefill_tokens:
            one_live.record(step.batch_tokens, step.forward_seconds)
        n = len(step.decodes)
        teach_plain(
            one_gate,
            one_overhead,
            n,
            step.forward_seconds,
            step.batch_tokens,
            step.prefill_tokens,
            step.step_seconds,
        )
    for n, seconds in outside:
        one_gate.record_outside(n, False, seconds)

    gate, overhead, live, rows = estimators()
    held = HeldLessons(plain=list(steps), outside=list(outside))
    assert not held.replay(gate, overhead, live, rows) and not held

    # (repr: the same floats, NaN for the never-drafting step time included)
    assert repr(gate.times()) == repr(one_gate.times()) and len(gate.times()) == 2  # 2 and 4 requests
    for key, bucket in gate._buckets.items():
        assert bucket.plain_seconds.count == one_gate._buckets[key].plain_seconds.count > 0
        assert bucket.outside_plain.count == one_gate._buckets[key].outside_plain.count > 0
    assert all(overhead.post_seconds(n) == one_overhead.post_seconds(n) > 0 for n in (2, 4))
    assert live.curve() == one_live.curve()
    assert [list(w) for w in live._windows] == [list(w) for w in one_live._windows]
    assert sum(len(w) for w in live._windows) > 20
    assert len(rows) < len(one_rows)  # a run of decode-only steps is one entry
    for r in reqs:
        assert rows.pending(r) == one_rows.pending(r) > 0
    got, want = rows.take(alloc), one_rows.take(alloc)
    assert got is not None and want is not None
    # the same rows for the same positions at the same slots (grouped by request, in step order)
    assert torch.equal(got.features, want.features)
    assert torch.equal(got.positions, want.positions) and torch.equal(got.slots, want.slots)


def test_a_plain_step_sharing_its_forward_with_a_prompt_teaches_what_its_decodes_alone_cost() -> None:
    """A plain step of 12 decoding requests whose forward also carried a 600-token prompt chunk
    is filed as what a forward of the 12 tokens alone costs, by the SPS curve (here bound by
    reading the weights at small batches): split by token count, the decodes would get ~2% of a
    forward that costs them ~16% (served on the K=8 twin, the gate then took plain steps of
    8-15 requests for 4-8 ms against ~22 and never drafted there). Without a curve, the split
    is by tokens."""

    def curve(batch_tokens: int) -> float:
        return 0.020 + 0.0002 * batch_tokens

    filed: list[tuple[int, float]] = []
    for gate in (DraftGate(forward_seconds=curve), DraftGate()):
        gate.record_plain = lambda n, s: filed.append((n, s))  # type: ignore[method-assign]
        forward = curve(612)
        teach_plain(gate, None, 12, forward, 612, 600, forward + 0.001)
    (n_curve, by_curve), (n_tokens, by_tokens) = filed
    assert n_curve == n_tokens == 12
    assert by_curve == pytest.approx(curve(12) + 0.001)
    assert by_tokens == pytest.approx(curve(612) * 12 / 612 + 0.001)
