"""What each request's drafting steps are expected to emit, for the draft gate.

A request's own forecast is a moving average of the tokens its drafting steps emitted (better: the
plans' calibrated expectation of them, far less noisy than one draw). It starts from a prior that
weighs as one step, then moves by ``request_smoothing`` of each step's tokens; while the request
does not draft, its forecast is drawn back to the prior by half every ``half_life`` steps (high
forecasts are refreshed at every drafting step, low ones only when explored: forecasts left alone
would be biased low).

A newcomer's prior is the mean of requests of its sampling regime (temperature, to one decimal) at
its load bucket; else the bucket's mean scaled by how the regime compares with all requests over
every load. Forecasts are scaled by the regime's realised ratio: the tokens drafting steps kept
over the tokens their plans expected (calibration off the traffic's distribution shows there
first, and differently at each load). The priors and ratios move by ``prior_smoothing``: they
stand for the traffic, not for the request now running. A ratio stands on as many steps' weight of
1 (the calibration's word) beside its samples, ``ratio_prior_steps``: one step's kept / expected
spreads by ~0.6 of itself, and the first few steps alone set it anywhere (docs/draft-gate.md).

Requests that leave after drafting leave their mean expected tokens per drafting step behind,
per regime (``request_means``): how far apart requests of the traffic accept, which tells what
learning a newcomer's own forecast may be worth.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from dspark_server.engine.spec.gate_estimates import MovingMean, drawn_back, regime_key

REQUEST_MEANS = 64  # departed requests' means kept per regime
MIN_REQUEST_STEPS = 2  # a departed request's drafting steps for its mean to count


class RequestForecasts:
    def __init__(
        self,
        request_smoothing: float,
        prior_smoothing: float,
        half_life: float,
        min_samples: int,
        ratio_prior_steps: float = 0.0,
    ) -> None:
        self.request_smoothing = request_smoothing
        self.ratio_prior_steps = ratio_prior_steps
        self.prior_smoothing = prior_smoothing
        self.half_life = half_life
        self.min_samples = min_samples
        self.own: dict[str, float] = {}  # request id -> tokens per drafting step
        self.drafted_at: dict[str, int] = {}  # request id -> the last step it drafted in
        self.drafts: dict[str, int] = {}  # request id -> its drafting steps so far
        self.prior = MovingMean()  # all loads: for a bucket that has not drafted yet
        self.expected: dict[tuple[int, float], MovingMean] = {}  # (bucket or 0 = any, regime)
        self.kept: dict[tuple[int, float], MovingMean] = {}  # beside ``expected``: tokens kept
        # request id -> [expected tokens summed over its drafting steps, those steps, its regime]
        self._totals: dict[str, tuple[float, int, float]] = {}
        self._request_means: dict[float, deque[float]] = {}  # regime -> departed requests' means

    def keep_only(self, live: set[str]) -> None:
        """Forget the requests that left, keeping each one's mean tokens per drafting step."""
        for rid in [rid for rid in self._totals if rid not in live]:
            total, steps, regime = self._totals.pop(rid)
            if steps >= MIN_REQUEST_STEPS:
                means = self._request_means.setdefault(regime, deque(maxlen=REQUEST_MEANS))
                means.append(total / steps)
        self.own = {rid: f for rid, f in self.own.items() if rid in live}
        self.drafts = {rid: c for rid, c in self.drafts.items() if rid in live}
        self.drafted_at = {rid: t for rid, t in self.drafted_at.items() if rid in live}

    def tokens(
        self,
        request_ids: Sequence[str],
        regimes: Sequence[float] | None,
        bucket: int,
        bucket_mean: float,
        now: int,
    ) -> float:
        """Tokens a drafting step at step ``now`` is expected to emit for these requests (at load
        bucket ``bucket``, whose mean tokens per request is ``bucket_mean``)."""
        prior = self.prior.value if math.isnan(bucket_mean) else bucket_mean
        if regimes is None:
            return sum(self._aged(rid, prior, now) for rid in request_ids)
        own, drafted_at, half_life = self.own, self.drafted_at, self.half_life
        # per distinct regime (a step has few): its prior and its realised ratio, then one
        # aged forecast per request (this runs every step, at every load: keep it tight)
        per_regime: dict[float, tuple[float, float]] = {}
        total = 0.0
        for rid, regime in zip(request_ids, regimes, strict=True):
            known = per_regime.get(regime)
            if known is None:
                known = per_regime[regime] = (
                    self.regime_prior(bucket, regime, prior),
                    self.realised_ratio(regime, bucket),
                )
            p, ratio = known
            total += drawn_back(own.get(rid), p, now - drafted_at.get(rid, now), half_life) * ratio
        return total

    def _aged(self, request_id: str, prior: float, now: int) -> float:
        """A request's forecast at step ``now``, drawn back to ``prior`` since it last drafted
        (``tokens`` inlines this for every request of a step)."""
        age = now - self.drafted_at.get(request_id, now)
        return drawn_back(self.own.get(request_id), prior, age, self.half_life)

    def realised_ratio(self, regime: float, bucket: int | None = None) -> float:
        """Tokens kept / tokens expected by the plans, over recent drafting steps of requests of
        this sampling regime at this load bucket (at any load until this one has
        ``min_samples`` steps), beside ``ratio_prior_steps`` steps' weight of 1; 1 until
        measured; within [1/2, 2]."""
        key = regime_key(regime)
        for where in ((bucket,) if bucket else ()) + (0,):
            kept, expected = self.kept.get((where, key)), self.expected.get((where, key))
            if kept is None or expected is None or not expected.value > 0:
                continue
            if where and kept.count < self.min_samples:
                continue
            # the samples' weight: their count until the moving mean forgets (1 / smoothing)
            weight = min(float(kept.count), 1.0 / self.prior_smoothing)
            ratio = (weight * kept.value / expected.value + self.ratio_prior_steps) / (
                weight + self.ratio_prior_steps
            )
            return min(2.0, max(0.5, ratio))
        return 1.0

    def regime_prior(self, bucket: int, regime: float, fallback: float) -> float:
        """A newcomer's prior: the mean of requests of its sampling regime at this load; else the
        load bucket's mean (``fallback``) scaled by how the regime compares with all requests
        over every load (greedy and sampled requests accept very differently, and the plan's
        lengths, hence the tokens, shrink with load: an any-load mean alone would overstate
        them at high load)."""
        key = regime_key(regime)
        own = self.expected.get((bucket, key))
        if own is not None and not math.isnan(own.value):
            return own.value
        anywhere = self.expected.get((0, key))
        if anywhere is not None and not math.isnan(anywhere.value) and self.prior.value > 0:
            return fallback * anywhere.value / self.prior.value
        return fallback

    def request_means(self, regime: float) -> Sequence[float]:
        """Expected tokens per drafting step of recent requests of this regime that left (each
        one's mean over its drafting steps), most recent last."""
        return self._request_means.get(regime_key(regime), ())

    def prior_samples(self, bucket: int, regime: float) -> int:
        """Drafting steps the prior of this regime at this load bucket rests on."""
        mean = self.expected.get((bucket, regime_key(regime)))
        return 0 if mean is None else mean.count

    def learn(
        self,
        request_ids: Sequence[str],
        tokens: Sequence[float],
        regimes: Sequence[float] | None,
        kept: Sequence[float] | None,
        bucket: int,
        bucket_mean: float,
        now: int,
    ) -> None:
        """A drafting step at step ``now`` (load bucket ``bucket``, whose mean is now
        ``bucket_mean``): each request's tokens (expected, or kept), and with ``regimes`` the
        tokens each did keep (``kept``; None: ``tokens`` were kept)."""
        self.prior.update(sum(tokens) / len(tokens), self.prior_smoothing)
        if regimes is not None:  # per regime: [tokens expected, tokens kept, requests]
            by_regime: dict[float, list[float]] = {}
            for regime, n, k in zip(regimes, tokens, tokens if kept is None else kept, strict=True):
                sums = by_regime.setdefault(regime_key(regime), [0.0, 0.0, 0])
                sums[0], sums[1], sums[2] = sums[0] + n, sums[1] + k, sums[2] + 1
            smoothing = self.prior_smoothing
            for regime, (expected, emitted, rows) in by_regime.items():
                for where in ((bucket, regime), (0, regime)):  # 0: any load
                    self.expected.setdefault(where, MovingMean()).update(expected / rows, smoothing)
                    self.kept.setdefault(where, MovingMean()).update(emitted / rows, smoothing)
        for i, (rid, n) in enumerate(zip(request_ids, tokens, strict=True)):
            if regimes is not None:
                total, steps, _ = self._totals.get(rid, (0.0, 0, 0.0))
                self._totals[rid] = (total + n, steps + 1, regime_key(regimes[i]))
            if rid in self.own:  # its own, aged as the forecast the choice was made on
                base = bucket_mean if regimes is None else self.regime_prior(bucket, regimes[i], bucket_mean)
                prior = self._aged(rid, base, now)
            else:
                prior = bucket_mean
            # the prior weighs as one step: a request's own first steps outweigh it quickly
            count = self.drafts[rid] = self.drafts.get(rid, 0) + 1
            w = max(self.request_smoothing, 1.0 / (count + 1))
            self.own[rid] = (1 - w) * prior + w * n
            self.drafted_at[rid] = now
