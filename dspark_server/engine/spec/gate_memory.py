"""What the draft gate has measured, per load bucket (powers of two of the number of decoding
requests: ``LoadBucket``, step and loop times, tokens, the switch into drafting) and per request
(``RequestForecasts``): filled by finished steps' lessons (``record_*``), read as rates and
forecasts. ``DraftGate`` (draft_gate.py) makes the choice on them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from dspark_server.engine.spec.gate_estimates import (
    LoadBucket,
    MovingMean,
    StepTime,
    clip_outlier,
    seed_scales,
)
from dspark_server.engine.spec.request_forecasts import RequestForecasts

# Choices between two plain steps of a load after which a step far off its plain time restarts it
# (``GateMemory._plain_bucket``): consecutive plain steps are averaged as they are; while drafting
# wins, the plain time is refreshed one step every tens to hundreds of steps (``refresh_overhead``).
STALE_PLAIN_STEPS = 16
# A stale plain time a new plain step undercuts moves this much of the way down to it at once.
STALE_UNDERCUT_WEIGHT = 0.5


class GateMemory:
    def __init__(
        self,
        smoothing: float,
        request_smoothing: float,
        prior_smoothing: float,
        min_samples: int,
        forecast_half_life: float,
        ratio_prior_steps: float,
        forward_seconds: Callable[[int], float] | None,
    ) -> None:
        if not all(0.0 < x <= 1.0 for x in (smoothing, request_smoothing, prior_smoothing)):
            raise ValueError("smoothing, request_smoothing and prior_smoothing must be in (0, 1]")
        if not ratio_prior_steps >= 0.0:
            raise ValueError("ratio_prior_steps must be >= 0")
        self.smoothing = smoothing
        self.min_samples = max(1, min_samples)
        # the target forward's time at B batch tokens: scales a measured bucket to a new load
        self.forward_seconds = forward_seconds
        self._steps = 0  # choices made so far: the clock forecasts age by
        self._buckets: dict[int, LoadBucket] = {}
        self.forecasts = RequestForecasts(
            request_smoothing, prior_smoothing, forecast_half_life, self.min_samples, ratio_prior_steps
        )

    @staticmethod
    def bucket_of(num_requests: int) -> int:
        return max(1, num_requests).bit_length()

    def _bucket(self, num_requests: int) -> LoadBucket:
        key = self.bucket_of(num_requests)
        if key not in self._buckets:
            self._buckets[key] = self._seeded_bucket(key)
        return self._buckets[key]

    def _seeded_bucket(self, key: int) -> LoadBucket:
        """A load bucket seen for the first time starts from the nearest measured one, its step
        times scaled to the load (``seed_scales``), as if warmed up: ramping through seven
        buckets would otherwise spend 2 x 7 drafting steps where drafting may cost several plain
        steps. Its own steps replace the seed within a few samples."""
        b = LoadBucket()
        self._fill_from_neighbour(key, b)
        return b

    def _fill_from_neighbour(self, key: int, b: LoadBucket) -> None:
        """What ``b`` (bucket ``key``) has not measured at all, from the nearest measured bucket,
        scaled. Also for a bucket that exists already but measured only one kind: a load ramping
        up fills every bucket with plain samples while prompts take the budget, and ramping down
        from a measured top bucket must not warm each of them up by drafting (at 64 -> 1
        requests on the K=8 twin: 8 drafting steps, 3.2 s of a 49 s run)."""
        warm = [k for k, w in self._buckets.items() if k != key and w.measured(self.min_samples)]
        if not warm:
            return
        near = min(warm, key=lambda k: abs(k - key))
        src = self._buckets[near]
        plain_scale, draft_scale = seed_scales(self.forward_seconds, near, key, src.tokens_per_request.value)
        if b.draft_seconds.count == 0:
            b.draft_seconds = StepTime.seeded(src.draft_seconds.value * draft_scale, self.min_samples)
        if b.plain_seconds.count == 0:
            b.plain_seconds = StepTime.seeded(src.plain_seconds.value * plain_scale, self.min_samples)
        if b.tokens_per_request.count == 0:
            b.tokens_per_request = MovingMean(src.tokens_per_request.value, self.min_samples)

    def plain_iteration(self, num_requests: int) -> float:
        """A whole loop iteration with a plain step at this load (``LoadBucket.iteration``), its
        step time at most a larger load's measured one: a plain step of fewer requests reads the
        same weights for fewer tokens. A load a wave only passes through (its ramp, its drain) is
        measured on few plain steps, and while drafting is chosen there files no more: served on
        the K=8 twin, 9-15 requests kept a plain time of 34 ms learnt early in the run while
        plain steps of 16 took 25-28, and drafting was chosen at a loss against it."""
        key = self.bucket_of(num_requests)
        b = self._bucket(num_requests)
        step = b.plain_seconds.value
        for k, w in self._buckets.items():
            t = w.plain_seconds
            if k > key and not t.seed and t.count >= self.min_samples and t.value < step:
                step = t.value
        return step + b.outside(False)

    def forecast_tokens(self, request_ids: Sequence[str], regimes: Sequence[float] | None = None) -> float:
        """Tokens a drafting step is expected to emit for these requests (``regimes``: each one's
        sampling temperature, which picks a newcomer's prior)."""
        n = len(request_ids)
        mean = self._bucket(n).tokens_per_request.value
        return self.forecasts.tokens(request_ids, regimes, self.bucket_of(n), mean, self._steps)

    def realised_ratio(self, regime: float, num_requests: int | None = None) -> float:
        """Tokens kept / tokens expected by the plans, over recent drafting steps of requests of
        this sampling regime at this load (at any load until this one has ``min_samples``
        steps; 1 until measured; within [1/2, 2])."""
        return self.forecasts.realised_ratio(regime, self.bucket_of(num_requests) if num_requests else None)

    def _learn_drafting(
        self,
        request_ids: Sequence[str],
        tokens: Sequence[float],
        seconds: float,
        switch_seconds: float,
        prompt_seconds: float,
        load: int,
        regimes: Sequence[float] | None,
        kept: Sequence[float] | None,
        after_plain: bool,
    ) -> None:
        """A finished drafting step (``DraftGate.record`` has the arguments' meaning): ``load``:
        the step's decoding requests; ``after_plain``: the choice before it was a plain step."""
        key = self.bucket_of(load)
        b = self._bucket(load)
        switch = switch_seconds if switch_seconds > 0 and math.isfinite(switch_seconds) else 0.0
        prompts = min(switch, max(0.0, prompt_seconds))
        if load > len(request_ids):  # a few drafted: what that cost against a plain step's tokens
            if b.plain_seconds.count:
                same_tokens = b.plain_seconds.value * (sum(tokens) + load - len(request_ids)) / load
                b.partial_lost.update(seconds + switch - same_tokens, self.smoothing)
        elif after_plain and b.draft_seconds.count >= self.min_samples:
            # the first drafting step after plain ones: its excess over a warm one and the
            # catch-up are the price of switching, not of drafting
            excess = max(0.0, seconds - b.draft_seconds.value)
            b.record_switch(switch + excess, prompts, self.smoothing)
        else:
            b.draft_seconds.update(seconds, self.smoothing)
            # a switch while the bucket warms up; after a drafting step the catch-up is a few
            # plain decodes' rows at most, not the price of switching (averaged in, the warm
            # steps of exploration runs held the estimate at ~1.5 ms where a switch at four
            # requests cost 5-10: explorations came twice as often as their budget allows)
            if switch > 0 and after_plain:
                b.record_switch(switch, prompts, self.smoothing)
        b.tokens_per_request.update(sum(tokens) / len(tokens), self.forecasts.prior_smoothing)
        mean = b.tokens_per_request.value
        self.forecasts.learn(request_ids, tokens, regimes, kept, key, mean, self._steps)

    def record_plain(self, num_requests: int, seconds: float) -> None:
        """A finished plain step of ``num_requests`` decoding requests (its decoding share of time)."""
        if seconds > 0 and math.isfinite(seconds) and num_requests > 0:
            b, stale = self._plain_bucket(num_requests, seconds)
            b.plain_seconds.update(seconds, self.smoothing)
            b.since_plain = 0
            if stale:
                self._pull_stale(b, seconds)

    def record_plain_many(self, num_requests: int, seconds: Sequence[float]) -> None:
        """``record_plain`` for plain steps of the same load, in the order they ran."""
        usable = [x for x in seconds if x > 0 and math.isfinite(x)]
        if num_requests <= 0 or not usable:
            return
        b, stale = self._plain_bucket(num_requests, usable[0])
        times, smoothing = b.plain_seconds, self.smoothing
        for x in usable:
            times.update(x, smoothing)
        b.since_plain = 0
        if stale:
            self._pull_stale(b, usable[0])

    def _pull_stale(self, b: LoadBucket, seconds: float) -> None:
        """After a plain step that refreshed a stale plain time (``STALE_PLAIN_STEPS`` or more
        choices since the last, ``_plain_bucket``) was filed: where it came in below, the time
        moves ``STALE_UNDERCUT_WEIGHT`` of the way down to it. An estimate too high keeps the
        gate drafting, and drafting measures no plain step to correct it but the rare refreshes
        (``refresh_overhead``), each of which moved it by a twentieth; one too low takes plain
        steps, which correct it at once. Served on the K=8 twin at four requests, temperature 1
        (after the temperature-0 points), a plain step was learnt at 19-22 ms while the client
        started (plain steps there take 11-14 ms) and the gate drafted, ~0.6x plain steps' rate,
        for the rest of the point: dspark ran at 0.74x off."""
        b.plain_seconds.pull_down(seconds, STALE_UNDERCUT_WEIGHT)

    def _plain_bucket(self, num_requests: int, seconds: float) -> tuple[LoadBucket, bool]:
        """The bucket a plain step of this load (``seconds``) is filed in, and whether the step
        refreshes a stale plain time (measured before, not seeded, and last ``STALE_PLAIN_STEPS``
        or more choices ago). Where a stale time and this step differ by more than a factor of
        two, the time starts over from this step (and the gate's warm-up takes another plain
        step to confirm it): the step times changed, and a
        moving average moves by a twentieth a sample, which a refresh every few hundred steps
        turns into thousands. Served on the demo pair, one request's plain time was learnt at
        3.2-3.7 ms while the machine was busy and stayed so through the higher loads that
        followed; on the next one-request prompts (0.8 ms plain steps) the gate drafted for 500
        steps, 31% slower than plain decoding, and its one refresh moved the estimate by 0.1 ms."""
        b = self._bucket(num_requests)
        times = b.plain_seconds
        stale = times.count > 0 and not times.seed and self._steps - b.plain_at >= STALE_PLAIN_STEPS
        if stale and not 0.5 * times.value <= seconds <= 2.0 * times.value:
            b.plain_seconds = StepTime()
        b.plain_at = self._steps
        return b, stale

    def record_outside_plain(self, lessons: Sequence[tuple[int, float]]) -> None:
        """``record_outside`` for plain steps: (decoding requests, loop seconds), in order."""
        last_n, mean = 0, MovingMean()
        for n, seconds in lessons:
            if not (seconds >= 0 and math.isfinite(seconds) and n > 0):
                continue
            if n != last_n:  # (a held plain choice is one load)
                last_n, mean = n, self._bucket(n).outside_plain
            self._update_loop_time(mean, seconds)

    def record_outside(self, num_requests: int, drafted: bool, seconds: float) -> None:
        """The loop's time between a finished step of ``num_requests`` decoding requests (of the
        kind ``drafted`` says) and the next step: streaming its outputs, metrics, scheduling."""
        if seconds >= 0 and math.isfinite(seconds) and num_requests > 0:
            b = self._bucket(num_requests)
            self._update_loop_time(b.outside_draft if drafted else b.outside_plain, seconds)

    def _update_loop_time(self, mean: MovingMean, seconds: float) -> None:
        """One sample of the loop's time between steps, a stall clipped to a multiple of the
        estimate (once it stands on three samples)."""
        mean.update(clip_outlier(seconds, mean.value if mean.count >= 3 else None), self.smoothing)

    def times(self) -> dict[int, dict[tuple[str, str], float]]:
        """bucket -> {(choice, part): seconds}: each step kind's ("draft", "plain") own time
        ("step") and the loop's time after it ("loop"), as the gate prices them."""
        out: dict[int, dict[tuple[str, str], float]] = {}
        for k, b in list(self._buckets.items()):
            out[k] = {
                ("draft", "step"): b.draft_seconds.value,
                ("draft", "loop"): b.outside(True),
                ("plain", "step"): b.plain_seconds.value,
                ("plain", "loop"): b.outside(False),
            }
        return out

    def rates(self) -> dict[int, tuple[float, float]]:
        """bucket -> (drafting tokens/s for a request at the prior, plain tokens/s per request),
        over whole loop iterations, for metrics and tests."""
        return {  # (a copy first: metrics read this from another thread)
            k: (b.tokens_per_request.value / b.iteration(True), 1.0 / b.iteration(False))
            for k, b in list(self._buckets.items())
        }
