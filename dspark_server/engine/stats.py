"""Engine statistics: counters and gauges the server exports, plus observation hooks.

The engine fills plain numbers here; ``server/metrics.py`` turns them into Prometheus families.
Observation hooks let the metrics layer see each event (a histogram needs every sample) without
the engine importing anything from the server. Hooks run on the engine thread; readers on other
threads only read ints, floats and copies of lists, so no lock is needed.

Observation names (the ``name`` passed to observers) and their units:
  step_seconds, forward_seconds, batch_tokens            one per engine step / target forward
  ttft_seconds, queue_seconds                            one per request, at its first token
  itl_seconds                                            one per token delivery after the first
  e2e_seconds, tpot_seconds, request_prompt_tokens,
  request_generation_tokens, request_mean_verify_len     one per finished request
  acceptance_length                                      one per speculative round per request
  verify_tokens_per_step                                 one per step with speculative decodes
  plan_predicted_step_seconds, plan_step_time_ratio      one per priced speculative step (the
                                                         cost model's price; measured / price)
"""

from __future__ import annotations

import functools
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
    prompt_tokens: int = 0  # prompt tokens computed (prefix-cache hits are not)
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found (their prefill skipped)
    generation_tokens: int = 0
    finished_requests: int = 0
    finished_by_reason: dict[str, int] = field(default_factory=dict)
    preemptions: int = 0
    spec_rounds: int = 0
    spec_draft_tokens: int = 0
    spec_verified_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_emitted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    verified_per_position: list[int] = field(default_factory=list)
    # Verification budget: draft tokens admitted for verification in the latest step that had
    # speculative decodes (sum of ℓ over its requests; 0 when the planner verified none), and that
    # step's mean ℓ per request.
    last_verify_tokens: int = 0
    last_mean_verify_len: float = 0.0
    last_step_seconds: float = 0.0
    started_at: float = field(default_factory=time.monotonic)
    # Speculative steps by load (decoding requests, power-of-two bucket label) and choice: "plain"
    # (nothing drafted at this load), "none" (drafted, the planner verified no draft), "drafts".
    spec_steps_by_choice: dict[tuple[str, str], int] = field(default_factory=dict)
    last_predicted_step_seconds: float = 0.0
    last_measured_step_seconds: float = 0.0
    observers: list[Observer] = field(default_factory=list)
    _step_verify_tokens: int = 0
    _step_spec_requests: int = 0

    def observe(self, name: str, value: float) -> None:
        for obs in self.observers:
            obs(name, value)

    def record_step(self, seconds: float) -> None:
        self.steps += 1
        self.last_step_seconds = seconds
        self.observe("step_seconds", seconds)
        if self._step_spec_requests:
            self.last_verify_tokens = self._step_verify_tokens
            self.last_mean_verify_len = self._step_verify_tokens / self._step_spec_requests
            self.observe("verify_tokens_per_step", self._step_verify_tokens)
            self._step_verify_tokens = 0
            self._step_spec_requests = 0

    def record_spec_step(
        self, num_requests: int, choice: str, predicted_s: float | None, measured_s: float
    ) -> None:
        """One speculative step with decoding requests: what was chosen at this load and, when the
        cost model priced it, its predicted and measured wall time."""
        key = (load_bucket(num_requests), choice)
        self.spec_steps_by_choice[key] = self.spec_steps_by_choice.get(key, 0) + 1
        self.last_measured_step_seconds = measured_s
        if predicted_s is not None and predicted_s > 0:
            self.last_predicted_step_seconds = predicted_s
            self.observe("plan_predicted_step_seconds", predicted_s)
            self.observe("plan_step_time_ratio", measured_s / predicted_s)

    def record_batch(self, batch_tokens: int, forward_seconds: float) -> None:
        self.observe("batch_tokens", batch_tokens)
        self.observe("forward_seconds", forward_seconds)

    def record_preemptions(self, count: int) -> None:
        """Requests preempted (cache dropped, requeued for recompute) in one step."""
        self.preemptions += count

    def record_first_token(self, req: Request) -> None:
        if req.first_token_time is not None:
            self.observe("ttft_seconds", req.first_token_time - req.arrival_time)
        if req.first_scheduled_time is not None:
            self.observe("queue_seconds", req.first_scheduled_time - req.arrival_time)

    def record_inter_token(self, seconds: float) -> None:
        """Time between two successive token deliveries of one request (a speculative round
        that emits several tokens at once is one delivery)."""
        self.observe("itl_seconds", seconds)

    def record_finish(
        self,
        req: Request,
        reason: str | None = None,
        arrival_time: float | None = None,
        first_token_time: float | None = None,
    ) -> None:
        """A finished request; a backend that times requests itself passes its own clock readings."""
        self.finished_requests += 1
        reason = reason or req.finish_reason or "unknown"
        self.finished_by_reason[reason] = self.finished_by_reason.get(reason, 0) + 1
        now = time.monotonic()
        arrival = req.arrival_time if arrival_time is None else arrival_time
        first_token = req.first_token_time if first_token_time is None else first_token_time
        self.observe("e2e_seconds", now - arrival)
        n = len(req.output_ids)
        if n > 1 and first_token is not None:
            self.observe("tpot_seconds", (now - first_token) / (n - 1))
        self.observe("request_prompt_tokens", len(req.prompt_ids))
        self.observe("request_generation_tokens", n)
        if req.spec.rounds:
            self.observe("request_mean_verify_len", req.spec.verified_tokens / req.spec.rounds)

    def record_spec_round(self, drafted: int, verified: int, accepted: int, emitted: int) -> None:
        self.spec_rounds += 1
        self.spec_draft_tokens += drafted
        self.spec_verified_tokens += verified
        self.spec_accepted_tokens += accepted
        self.spec_emitted_tokens += emitted
        self._step_verify_tokens += verified
        self._step_spec_requests += 1
        if verified > len(self.verified_per_position):
            grow = verified - len(self.verified_per_position)
            self.verified_per_position.extend([0] * grow)
            self.accepted_per_position.extend([0] * grow)
        for k in range(verified):
            self.verified_per_position[k] += 1
        for k in range(accepted):
            self.accepted_per_position[k] += 1
        self.observe("acceptance_length", emitted)


@functools.cache  # (every step asks: the label is built once per load)
def load_bucket(num_requests: int) -> str:
    """Power-of-two bucket label of a load: "1", "2-3", "4-7", ..."""
    lo = 1 << (max(1, num_requests).bit_length() - 1)
    return str(lo) if lo == 1 else f"{lo}-{2 * lo - 1}"
