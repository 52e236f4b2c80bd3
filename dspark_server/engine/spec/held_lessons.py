"""What dspark mode's steps leave behind, filed in batches while the draft gate holds its choice.

A step in dspark mode teaches the gate (its step time, the loop's time after it, and for a
drafting step each request's tokens), the step overhead estimate and, for a plain step, the live
SPS table (its forward at B decoding tokens); a plain step also puts off its drafter-context rows
(``DeferredContext``). Done one step at a time, those few updates cost more than their
arithmetic: after a forward the objects they touch are out of the caches. At one request on the
demo pair (HumanEval, temperature 1) the lessons cost a few per cent of a plain step; at
temperature 0 a drafting step's lesson cost ~30 us and the gate's full choice before the next
step ~24 us, ~2.5% of a drafting step. While the gate holds a choice (plain, or drafting while it
clearly wins) it reads none of them, so the steps' lessons wait here and are replayed in one go
(warm) before the next choice the gate makes in full, before a drafting step (a plain step's),
and every ``BATCH`` steps.

A plain step is kept as one ``PlainStep`` record, its put-off rows and its lesson together: the
step appends one tuple to one list, and the replay files both, a run of decode-only steps of one
batch size (a held plain choice) as one put-off entry and one update call per estimator. At one
request, temperature 1 (HumanEval, in-process, one thread, each call timed in a scratch run), a
plain step's own share went from ~12 us (putting off its rows ~10, its lesson ~2.4) to ~3.5, and
filing from ~6 us a step (at a full choice every 9 steps) to ~5.4 (every 17 steps:
``DraftGate.max_hold`` 16).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from dspark_server.engine.request import Request
from dspark_server.engine.scheduler import ScheduledChunk
from dspark_server.engine.spec.deferred_context import DeferredContext, Run
from dspark_server.engine.spec.draft_gate import DraftGate
from dspark_server.engine.spec.step_lessons import DraftingLesson, teach, teach_plain, teach_plain_run
from dspark_server.engine.spec.step_overhead import StepOverhead
from dspark_server.planner.live import LiveSpsTable

BATCH = 32  # steps filed at once at most (a held choice lasts up to 16 steps: its full choice files them)


class PlainStep(NamedTuple):
    """One plain step as it ran: its decoding requests (one token each, at ``positions``) and
    prefill chunks, the features its forward captured for them ([rows, F], in that order), and
    its times (``step_seconds`` None: no decoding request, nothing to teach)."""

    decodes: list[Request]
    positions: list[int]
    prefills: list[ScheduledChunk]
    features: torch.Tensor | None  # None: nothing to put off (the step captured nothing)
    forward_seconds: float
    batch_tokens: int
    prefill_tokens: int
    step_seconds: float | None


@dataclass
class HeldLessons:
    plain: list[PlainStep] = field(default_factory=list)  # plain steps not yet filed, in order
    outside: list[tuple[int, float]] = field(default_factory=list)  # (requests, loop s after a plain step)
    drafts: list[DraftingLesson] = field(default_factory=list)  # held drafting steps', in order

    def full(self) -> bool:
        return len(self.plain) >= BATCH or len(self.outside) >= BATCH or len(self.drafts) >= BATCH

    def has_plain(self) -> bool:
        return bool(self.plain or self.outside)

    def __bool__(self) -> bool:
        return bool(self.plain or self.outside or self.drafts)

    def replay(
        self,
        gate: DraftGate | None,
        overhead: StepOverhead | None,
        live_sps: LiveSpsTable | None,
        deferred: DeferredContext,
    ) -> bool:
        """File every waiting lesson and put off every waiting plain step's rows, in the order the
        steps ran, and forget them (a plain step and a held drafting step never wait together:
        every change of choice is a full one, and the lessons are filed before it). True: the
        put-off rows reached ``deferred``'s bound (take them now)."""
        full = False
        for group in _runs_of_decode_only_steps(self.plain):
            first = group[0]
            if len(group) > 1:  # one deferred entry and one update per estimator for the run
                decodes = [r for step in group for r in step.decodes]
                positions = [p for step in group for p in step.positions]
                if first.features is not None:  # (a run keeps features in all its steps or none)
                    features = [step.features for step in group if step.features is not None]
                    full = deferred.defer((), features, decodes, positions) or full  # joined if read
                forward_s = [step.forward_seconds for step in group]
                if live_sps is not None:
                    live_sps.record_many(first.batch_tokens, forward_s)
                step_s = [step.step_seconds or 0.0 for step in group]
                teach_plain_run(gate, overhead, len(first.decodes), forward_s, step_s)
                continue
            decodes, prefills = first.decodes, first.prefills
            chunks = [Run(c.request, c.start, c.num_tokens) for c in prefills] if prefills else []
            if (decodes or chunks) and first.features is not None:
                full = deferred.defer(chunks, first.features, decodes, first.positions) or full
            if first.step_seconds is None or not decodes:
                continue
            if live_sps is not None and not first.prefill_tokens:
                live_sps.record(first.batch_tokens, first.forward_seconds)
            teach_plain(
                gate,
                overhead,
                len(decodes),
                first.forward_seconds,
                first.batch_tokens,
                first.prefill_tokens,
                first.step_seconds,
            )
        if gate is not None and self.outside:
            gate.record_outside_plain(self.outside)
        for lesson in self.drafts:
            teach(gate, overhead, lesson)
        self.plain.clear()
        self.outside.clear()
        self.drafts.clear()
        return full


def _runs_of_decode_only_steps(steps: list[PlainStep]) -> list[list[PlainStep]]:
    """The steps in order, consecutive decode-only ones of the same batch size together (a held
    plain choice is one run), every other step alone."""
    groups: list[list[PlainStep]] = []
    for step in steps:
        if groups and _same_run(groups[-1][-1], step):
            groups[-1].append(step)
        else:
            groups.append([step])
    return groups


def _decode_only(step: PlainStep) -> bool:
    return not step.prefills and step.step_seconds is not None and bool(step.decodes)


def _same_run(last: PlainStep, step: PlainStep) -> bool:
    """Whether ``step`` continues ``last``'s run: both decode-only, of the same batch size."""
    same_size = last.batch_tokens == step.batch_tokens and len(last.decodes) == len(step.decodes)
    same_kind = (last.features is None) == (step.features is None)
    return same_size and same_kind and _decode_only(last) and _decode_only(step)
