"""What a speculative step costs besides its verification forward, for the planner's cost model.

A step = draft pass + plan + verification forward + rejection sampling and commit. The SPS table
prices only the forward; the draft pass is measured in the step itself (it is over before the plan
is made), and the rest — sampling, commit, bookkeeping, which grow with the number of requests — is
a moving average per load bucket (the draft gate's powers of two) of earlier steps, as is the
engine loop's time between a drafting step and the next (streaming outputs, metrics, scheduling),
which a step pays whatever it verified.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from dspark_server.engine.spec.draft_gate import DraftGate
from dspark_server.engine.spec.gate_estimates import clip_outlier


class StepOverhead:
    def __init__(self, smoothing: float = 0.1) -> None:
        if not 0.0 < smoothing <= 1.0:
            raise ValueError("smoothing must be in (0, 1]")
        self.smoothing = smoothing
        self._post: dict[int, float] = {}
        self._outside: dict[int, float] = {}

    def record(self, num_requests: int, step_s: float, forward_s: float, draft_s: float) -> None:
        """One finished decode-only step: its wall time and the parts priced elsewhere."""
        post = step_s - forward_s - draft_s
        if not math.isfinite(post) or post < 0:
            return
        self._update(self._post, DraftGate.bucket_of(num_requests), post)

    def record_many(self, num_requests: int, step_s: Sequence[float], forward_s: Sequence[float]) -> None:
        """``record`` for decode-only plain steps (no draft pass), in the order they ran."""
        key = DraftGate.bucket_of(num_requests)
        for step, forward in zip(step_s, forward_s, strict=True):
            post = step - forward
            if math.isfinite(post) and post >= 0:
                self._update(self._post, key, post)

    def record_outside(self, num_requests: int, seconds: float) -> None:
        """The engine loop's time between a drafting step of ``num_requests`` and the next step."""
        if math.isfinite(seconds) and seconds >= 0:
            key = DraftGate.bucket_of(num_requests)
            self._update(self._outside, key, clip_outlier(seconds, self._outside.get(key)))

    def _update(self, means: dict[int, float], key: int, x: float) -> None:
        old = means.get(key)
        means[key] = x if old is None else (1 - self.smoothing) * old + self.smoothing * x

    def post_seconds(self, num_requests: int) -> float:
        """Expected seconds after the forward, the loop's included (0 until measured at this load)."""
        key = DraftGate.bucket_of(num_requests)
        return self._post.get(key, 0.0) + self._outside.get(key, 0.0)

    def overhead(self, num_requests: int, draft_s: float) -> float:
        return draft_s + self.post_seconds(num_requests)
