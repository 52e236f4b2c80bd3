"""Whether drafting pays off at the current load, decided from measured step rates.

The DSpark planner prices verification with the SPS table but treats drafting as free. On a CPU
with a small target a draft step can cost several verification steps, so at high concurrency, where
the planner admits almost no drafts, drafting would only slow every step down. The gate keeps, per
concurrency bucket (powers of two), exponential moving averages of the tokens a step emits and of
its time, for steps that drafted and for plain steps, and takes the choice with more tokens per
second.

Each bucket first measures both choices alike (``min_samples`` steps each, plain means), then
keeps both estimates current by now and then spending a step on the slower choice, at most
``max_explore_overhead`` of the bucket's time: when a draft step costs five plain steps the gate
explores it far more rarely than when the two are close (never more often than every
``explore_every`` steps).

The decision depends on past timings only — never on the tokens about to be drafted — so skipping a
draft changes speed, not the output distribution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class _Estimate:
    """Moving averages of a step's emitted tokens and of its seconds; their ratio is the rate
    (a ratio of means: one lucky 8-token step must not outweigh many 1-token ones)."""

    tokens: float = math.nan
    seconds: float = math.nan
    count: int = 0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds

    def update(self, tokens: float, seconds: float, smoothing: float) -> None:
        self.count += 1
        # a plain mean until there are 1/smoothing samples, then the moving average: one slow
        # first step (cold caches) must not stand for the choice for long
        w = max(smoothing, 1.0 / self.count)
        if math.isnan(self.seconds):
            self.tokens, self.seconds = tokens, seconds
        else:
            self.tokens = (1 - w) * self.tokens + w * tokens
            self.seconds = (1 - w) * self.seconds + w * seconds


@dataclass
class _Bucket:
    draft: _Estimate
    plain: _Estimate
    since_explore: int = 0


class DraftGate:
    def __init__(
        self,
        explore_every: int = 16,
        smoothing: float = 0.05,
        max_explore_overhead: float = 0.02,
        min_samples: int = 8,
    ) -> None:
        if explore_every < 2 or not 0.0 < smoothing <= 1.0 or not 0.0 < max_explore_overhead < 1.0:
            raise ValueError(
                "explore_every must be >= 2, smoothing in (0, 1], max_explore_overhead in (0, 1)"
            )
        self.explore_every = explore_every
        self.smoothing = smoothing
        self.max_explore_overhead = max_explore_overhead
        self.min_samples = max(1, min_samples)
        self._buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket_of(num_requests: int) -> int:
        return max(1, num_requests).bit_length()

    def _bucket(self, num_requests: int) -> _Bucket:
        key = self.bucket_of(num_requests)
        if key not in self._buckets:
            self._buckets[key] = _Bucket(_Estimate(), _Estimate())
        return self._buckets[key]

    def explore_interval(self, best: _Estimate, other: _Estimate) -> int:
        """Steps between explorations of ``other`` so that the time they lose (an exploring step's
        time minus what the best choice needs for the same tokens) stays within the budget."""
        lost = other.seconds * max(0.0, 1.0 - other.rate / best.rate)
        steps = lost / (self.max_explore_overhead * best.seconds)
        return max(self.explore_every, math.ceil(steps))

    def choose(self, num_requests: int) -> bool:
        """True: draft this step."""
        b = self._bucket(num_requests)
        if min(b.draft.count, b.plain.count) < self.min_samples:
            return b.draft.count <= b.plain.count  # warm-up: measure both alike before choosing
        draft_best = b.draft.rate >= b.plain.rate
        best, other = (b.draft, b.plain) if draft_best else (b.plain, b.draft)
        b.since_explore += 1
        if b.since_explore >= self.explore_interval(best, other):
            b.since_explore = 0
            return not draft_best
        return draft_best

    def record(self, num_requests: int, drafted: bool, tokens: int, seconds: float) -> None:
        if seconds <= 0 or not math.isfinite(seconds):
            return
        b = self._bucket(num_requests)
        (b.draft if drafted else b.plain).update(tokens, seconds, self.smoothing)

    def rates(self) -> dict[int, tuple[float, float]]:
        """bucket -> (drafting tokens/s, plain tokens/s), for metrics and tests."""
        return {k: (b.draft.rate, b.plain.rate) for k, b in self._buckets.items()}
