"""What dspark mode's plain steps teach, filed in batches while the draft gate holds plain.

A plain step in dspark mode teaches the gate (its step time, the loop's time after it), the step
overhead estimate and the live SPS table (its forward at B decoding tokens). Filed one step at a
time, those few updates cost more than their arithmetic: after a forward the objects they touch
are out of the caches, and at one request on the demo pair (HumanEval, temperature 1) they cost
a few per cent of a plain step, as much as the rest of dspark mode's plain-step bookkeeping. While
the gate holds a plain choice it reads none of them, so the steps' lessons wait here and are
replayed in one go (warm) before the next choice the gate makes in full, before a drafting step,
and every ``BATCH`` steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dspark_server.engine.spec.draft_gate import DraftGate
from dspark_server.engine.spec.step_lessons import teach_plain
from dspark_server.engine.spec.step_overhead import StepOverhead
from dspark_server.planner.live import LiveSpsTable

BATCH = 16  # plain steps' lessons filed at once at most


@dataclass
class PlainLessons:
    # per plain step with decoding requests: (requests, forward s, batch tokens, prefill tokens,
    # step s); one without prefill tokens also times a decode-only forward for the live SPS table
    steps: list[tuple[int, float, int, int, float]] = field(default_factory=list)
    outside: list[tuple[int, float]] = field(default_factory=list)  # (requests, loop s after a plain step)

    def full(self) -> bool:
        return len(self.steps) >= BATCH or len(self.outside) >= BATCH

    def __bool__(self) -> bool:
        return bool(self.steps or self.outside)

    def replay(
        self, gate: DraftGate | None, overhead: StepOverhead | None, live_sps: LiveSpsTable | None
    ) -> None:
        """File every waiting lesson, in the order the steps ran, and forget them."""
        for n, forward_s, batch_tokens, prefill_tokens, step_seconds in self.steps:
            if live_sps is not None and not prefill_tokens:
                live_sps.record(batch_tokens, forward_s)
            teach_plain(gate, overhead, n, forward_s, batch_tokens, prefill_tokens, step_seconds)
        if gate is not None:
            for n, seconds in self.outside:
                gate.record_outside(n, False, seconds)
        self.steps.clear()
        self.outside.clear()
