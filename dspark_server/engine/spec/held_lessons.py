"""What dspark mode's steps teach, filed in batches while the draft gate holds its choice.

A step in dspark mode teaches the gate (its step time, the loop's time after it, and for a
drafting step each request's tokens), the step overhead estimate and, for a plain step, the live
SPS table (its forward at B decoding tokens). Filed one step at a time, those few updates cost
more than their arithmetic: after a forward the objects they touch are out of the caches. At one
request on the demo pair (HumanEval, temperature 1) a plain step's cost a few per cent of it, as
much as the rest of dspark mode's plain-step bookkeeping; at temperature 0 a drafting step's
lesson cost ~30 us and the gate's full choice before the next step ~24 us, ~2.5% of a drafting
step. While the gate holds a choice (plain, or drafting while it clearly wins) it reads none of
them, so the steps' lessons wait here and are replayed in one go (warm) before the next choice
the gate makes in full, before a drafting step (a plain step's), and every ``BATCH`` steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dspark_server.engine.spec.draft_gate import DraftGate
from dspark_server.engine.spec.step_lessons import DraftingLesson, teach, teach_plain
from dspark_server.engine.spec.step_overhead import StepOverhead
from dspark_server.planner.live import LiveSpsTable

BATCH = 16  # steps' lessons filed at once at most


@dataclass
class HeldLessons:
    # per plain step with decoding requests: (requests, forward s, batch tokens, prefill tokens,
    # step s); one without prefill tokens also times a decode-only forward for the live SPS table
    steps: list[tuple[int, float, int, int, float]] = field(default_factory=list)
    outside: list[tuple[int, float]] = field(default_factory=list)  # (requests, loop s after a plain step)
    drafts: list[DraftingLesson] = field(default_factory=list)  # held drafting steps', in order

    def full(self) -> bool:
        return len(self.steps) >= BATCH or len(self.outside) >= BATCH or len(self.drafts) >= BATCH

    def has_plain(self) -> bool:
        return bool(self.steps or self.outside)

    def __bool__(self) -> bool:
        return bool(self.steps or self.outside or self.drafts)

    def replay(
        self, gate: DraftGate | None, overhead: StepOverhead | None, live_sps: LiveSpsTable | None
    ) -> None:
        """File every waiting lesson, in the order the steps ran, and forget them (a plain step and
        a held drafting step never wait together: every change of choice is a full one, and the
        lessons are filed before it)."""
        for n, forward_s, batch_tokens, prefill_tokens, step_seconds in self.steps:
            if live_sps is not None and not prefill_tokens:
                live_sps.record(batch_tokens, forward_s)
            teach_plain(gate, overhead, n, forward_s, batch_tokens, prefill_tokens, step_seconds)
        if gate is not None:
            for n, seconds in self.outside:
                gate.record_outside(n, False, seconds)
        for lesson in self.drafts:
            teach(gate, overhead, lesson)
        self.steps.clear()
        self.outside.clear()
        self.drafts.clear()
