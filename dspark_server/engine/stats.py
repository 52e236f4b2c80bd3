"""Engine statistics: counters and gauges the server exports, plus observation hooks.

The engine fills plain numbers here; ``server/metrics.py`` turns them into Prometheus families.
Observation hooks let the metrics layer see each event (a histogram needs every sample) without
the engine importing anything from the server.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dspark_server.engine.request import Request

Observer = Callable[[str, float], None]


@dataclass
class EngineStats:
    kv_total_pages: int = 0
    kv_free_pages: int = 0
    num_running: int = 0
    num_waiting: int = 0
    steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished_requests: int = 0
    preemptions: int = 0
    spec_rounds: int = 0
    spec_draft_tokens: int = 0
    spec_verified_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_emitted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    verified_per_position: list[int] = field(default_factory=list)
    last_step_seconds: float = 0.0
    started_at: float = field(default_factory=time.monotonic)
    observers: list[Observer] = field(default_factory=list)

    def observe(self, name: str, value: float) -> None:
        for obs in self.observers:
            obs(name, value)

    def record_step(self, seconds: float) -> None:
        self.steps += 1
        self.last_step_seconds = seconds
        self.observe("step_seconds", seconds)

    def record_batch(self, batch_tokens: int, forward_seconds: float) -> None:
        self.observe("batch_tokens", batch_tokens)
        self.observe("forward_seconds", forward_seconds)

    def record_first_token(self, req: Request) -> None:
        if req.first_token_time is not None:
            self.observe("ttft_seconds", req.first_token_time - req.arrival_time)
        if req.first_scheduled_time is not None:
            self.observe("queue_seconds", req.first_scheduled_time - req.arrival_time)

    def record_finish(self, req: Request) -> None:
        self.finished_requests += 1
        self.observe("e2e_seconds", time.monotonic() - req.arrival_time)
        n = len(req.output_ids)
        if n > 1 and req.first_token_time is not None:
            self.observe("tpot_seconds", (time.monotonic() - req.first_token_time) / (n - 1))

    def record_spec_round(self, drafted: int, verified: int, accepted: int, emitted: int) -> None:
        self.spec_rounds += 1
        self.spec_draft_tokens += drafted
        self.spec_verified_tokens += verified
        self.spec_accepted_tokens += accepted
        self.spec_emitted_tokens += emitted
        if verified > len(self.verified_per_position):
            grow = verified - len(self.verified_per_position)
            self.verified_per_position.extend([0] * grow)
            self.accepted_per_position.extend([0] * grow)
        for k in range(verified):
            self.verified_per_position[k] += 1
        for k in range(accepted):
            self.accepted_per_position[k] += 1
        self.observe("acceptance_length", emitted)
