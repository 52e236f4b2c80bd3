"""Whether drafting pays off at the current load, decided from measured step rates.

The DSpark planner prices verification with the SPS table but treats drafting as free. On a CPU
with a small target a draft step can cost as much as a verification step, so at high concurrency,
where the planner admits almost no drafts, drafting would only slow every step down. The gate keeps,
per concurrency bucket (powers of two), an exponential moving average of tokens emitted per second
by steps that drafted and by plain steps, drafts when that is the faster choice, and spends every
``explore_every``-th step of a bucket on the other choice so both estimates stay current.

The decision depends on past timings only — never on the tokens about to be drafted — so skipping a
draft changes speed, not the output distribution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class _Bucket:
    draft_rate: float = math.nan
    plain_rate: float = math.nan
    steps: int = 0


class DraftGate:
    def __init__(self, explore_every: int = 16, smoothing: float = 0.2) -> None:
        if explore_every < 2 or not 0.0 < smoothing <= 1.0:
            raise ValueError("explore_every must be >= 2 and smoothing in (0, 1]")
        self.explore_every = explore_every
        self.smoothing = smoothing
        self._buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket_of(num_requests: int) -> int:
        return max(1, num_requests).bit_length()

    def choose(self, num_requests: int) -> bool:
        """True: draft this step."""
        b = self._buckets.setdefault(self.bucket_of(num_requests), _Bucket())
        b.steps += 1
        if math.isnan(b.draft_rate):
            return True
        if math.isnan(b.plain_rate):
            return False
        best = b.draft_rate >= b.plain_rate
        return (not best) if b.steps % self.explore_every == 0 else best

    def record(self, num_requests: int, drafted: bool, tokens: int, seconds: float) -> None:
        if seconds <= 0 or not math.isfinite(seconds):
            return
        b = self._buckets.setdefault(self.bucket_of(num_requests), _Bucket())
        rate = tokens / seconds
        old = b.draft_rate if drafted else b.plain_rate
        new = rate if math.isnan(old) else (1 - self.smoothing) * old + self.smoothing * rate
        if drafted:
            b.draft_rate = new
        else:
            b.plain_rate = new

    def rates(self) -> dict[int, tuple[float, float]]:
        """bucket -> (drafting tokens/s, plain tokens/s), for metrics and tests."""
        return {k: (b.draft_rate, b.plain_rate) for k, b in self._buckets.items()}
