"""Whether drafting pays off this step, forecast from measured step times and each request's own
acceptance.

The DSpark planner prices verification with the SPS table but treats drafting as free: the draft
pass is spent before the planner sees a confidence. On a CPU a draft step can cost several plain
steps, so the gate decides first, comparing two forecasts of tokens per second:

- a drafting step emits Σ_r f_r tokens in S_d seconds, where f_r is request r's own moving average
  of the tokens its drafting steps were expected to emit (1 + the calibrated survival of the
  positions the planner verified; a newcomer starts from the prior: the long-run mean of
  requests of its sampling temperature at this load bucket, else the bucket's mean scaled by how
  that temperature's requests compare with all over every load);
- a plain step emits one token per request in S_p seconds.

S_d and S_p are moving averages of measured step times per load bucket (powers of two of the
number of decoding requests): time depends on load, acceptance on the request. Keeping acceptance
per request is what lets the gate follow the traffic: one hard request that accepts nothing must
not switch drafting off for the easy ones after it, nor one easy request hide a hard mix.

Each bucket first measures both step kinds alike (``min_samples`` each), unless a neighbouring
bucket is measured already: then it starts from that one's estimates. After that the slower
choice is explored now and then so its forecast stays current: at most ``max_explore_overhead`` of
the time when the two are far apart, never less often than every ``max_explore_interval`` steps
(a forecast must not freeze on the requests of long ago) and never more often than every
``explore_every`` steps. While plain steps are the faster choice, what needs exploring is mostly
the requests' acceptance, and that is learnt more cheaply by drafting for a few of them
(``explore_fraction`` of the step's requests, those whose forecasts are oldest) while the others
take their plain token in the same forward: such a step costs a fraction of a drafting step and
is budgeted by ``partial_explore_overhead``. A whole drafting step is explored only when the
forecast comes within ``near_ratio`` of plain steps' rate (or every ``max_explore_interval``
steps, to keep the cost of drafting measured). Both budgets are spent in proportion to the odds
of drafting winning, (forecast rate / (``near_ratio`` x plain rate)) ** ``odds_power`` (4) at
most 1 (``exploration_odds``): at high load on a CPU drafting loses by a factor of five or more,
and a flat budget spent a few per cent of the time re-learning that. At one request at
temperature 1 on the demo pair, where drafting's forecast sits at ~0.58x plain steps' rate, the
fourth power rather than the square took dspark mode from 0.922 to 0.932x plain decoding's
throughput on HumanEval and from 0.924 to 0.932x on MT-Bench (medians of five interleaved rounds:
``python -m tools.churn_ab --concurrency 1 --temperature 1 --requests 24 --rounds 5 --variants
off dspark odds-square --threads 1 --prompts ../shared/prompts/humaneval.jsonl``); near
break-even the odds are 1 either way. ``max_explore_overhead`` is 6%:
whole drafting steps are explored on that budget at one request (and near break-even), where a
request held on plain steps is otherwise not looked at again within a 128-token response, and
acceptance changes along a response. Through bench_serving at one request, temperature 0, chat
(three rounds, servers side by side, the old value set through a scratch override): 6% against
2% +6 to +12% tokens/s (0.98-1.02x plain decoding instead of 0.91-0.97x); at temperature 1 on
code, where drafting loses, -1% on average.

While drafting wins, a plain step is still taken now and then to keep the load's plain step
time current (it emits one token whatever the request, so that is all it teaches), within a
budget of its own, ``refresh_overhead`` (0.5% of the time): under the explorations' (2% then), one
request drafting well on the demo pair (HumanEval, temperature 0, in-process, one thread) took a
plain step after every four or five drafting steps, and each also made the next drafting step a
cold one.

From plain steps, drafting is entered only when its forecast beats plain steps' rate by
``enter_margin`` (1.15); once drafting, it stays while its forecast is at least ``stay_ratio``
(0.95) of plain steps' rate. Near break-even the estimates' noise flips the choice back and
forth, and every flip into drafting pays the switch (the put-off context writes and a cold
step). At 64 greedy requests in-process, where the forecast put drafting about 10% ahead, the
entry margin took dspark mode from 0.92x to 1.01x plain decoding's throughput (medians of three
interleaved rounds: ``python -m tools.churn_ab --concurrency 64 --requests 128 --variants off
dspark no-margin --prompts ../shared/prompts/humaneval.jsonl --threads 1``). At one request,
temperature 0, through the external client, drafting won by only ~3-15% (fixed mode against
plain decoding), one poor drafting step dropped a forecast below plain steps' rate, and only an
exploration brought drafting back: staying down to 0.95 instead of 1.0 took dspark / off from
1.13 to 1.16 on code and from 0.97 to 1.02 on chat (medians of three interleaved rounds each,
``MODES="off dspark fixed" CONCS=1 TEMPS=0 tools/serve_bench_interleaved.sh``, the two builds
one after the other).

A clear choice is held for the next steps of the same requests (at most ``max_hold``), so those
steps skip the full choice: plain while drafting loses by ``hold_margin`` (up to the step before
an exploration could fall due), and drafting, after a drafting step, while it wins by
``hold_margin`` (up to the step before the plain-time refresh falls due). The held steps'
lessons wait and are filed in one go before the next full choice
(``engine/spec/held_lessons.py``). At one request on the demo pair a drafting step's full choice
and lesson cost ~24 and ~30 us (of ~2.2 ms; HumanEval, temperature 0, in-process); holding
drafting took dspark mode from 0.950 / 0.943x fixed mode's throughput to 0.965 / 0.957x (two
runs of each build, alternated: ``python -m tools.churn_ab --concurrency 1 --temperature 0
--requests 24 --rounds 3 --variants off fixed dspark --threads 1 --prompts
../shared/prompts/humaneval.jsonl``).

A request's own average starts from the prior weighed as one drafting step (its first steps
outweigh it: 1/2, 1/3, 1/4 ...), then moves by ``request_smoothing`` (0.2) of each drafting
step's tokens:
one step's tokens range from 1 to γ + 1, and at 0.5 a single poor step put the forecast below
break-even for about ten plain steps (one request at a time on HumanEval, in-process:
1017 tok/s at 0.5, 1132 at 0.2, 1158 at 0.1; on MT-Bench, where plain steps win, 956 / 947 / 960).

A request's own forecast is drawn back to its prior by half every ``forecast_half_life`` steps
since it last drafted: high forecasts are refreshed at every drafting step, low ones only when
explored, so forecasts left alone would be biased low.

The priors (a load bucket's mean, a regime's, and the regime's kept / expected ratio) move by
``prior_smoothing`` (0.005), ten times slower than the step times: they stand for the traffic,
and at one request the drafting steps just before a drop to plain steps are that request's own
hard stretch. Moving at the step times' 0.05 they followed it (~2.6 tokens where the traffic
kept ~4.9), the dropped request's forecast was drawn back to its own low value, and only an
exploration brought drafting back: 27% of the steps were plain against 10%, and dspark mode
measured 1.283x plain decoding against 1.331x (fixed mode 1.343x; HumanEval, temperature 0,
medians of five interleaved rounds: ``python -m tools.churn_ab --concurrency 1 --temperature 0
--requests 24 --rounds 5 --variants off fixed dspark fast-prior --threads 1 --prompts
../shared/prompts/humaneval.jsonl``; MT-Bench 1.037x against 1.036x, and at one request,
temperature 1 and at 16 requests, temperature 0 within 0.5%).

A drafting step's time leaves out its catch-up of the context writes earlier plain steps put
off: that is the price of switching, and counting it as the price of drafting would keep the gate
on plain steps, whose growing backlog would make the next catch-up dearer still. The first
drafting step after plain ones is also slower than the next ones (the drafter's weights and code
went cold: served at one request on the demo pair, 6.2-7.8 ms against 4.2-4.5 ms in a run of
drafting steps). So ``draft_seconds`` learns from drafting steps that follow a drafting step
only; a switching step's excess over it joins the catch-up in ``switch_seconds``. The gate
compares steady states (drafting step after drafting step against plain after plain); starting
to draft pays the switch once, priced as ``switch_seconds / explore_run`` on top of a drafting
step's time (the run it is expected to last at least), and an exploration of whole drafting
steps lasts ``explore_run`` steps of the same requests (a newcomer ends it), so that it measures
a warm step and not only a cold one.

Both step kinds are priced as whole iterations of the engine loop: the loop's time between a
step and the next (streaming the step's outputs to the server, metrics, scheduling) is paid
once per step whatever the step emitted, so comparing the steps alone favours the short plain
steps. Served at one request on the demo pair it is of the order of a plain step's own time.

The decision depends on past steps only, never on the tokens about to be drafted, so skipping a
draft changes speed, not the output distribution.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

# A sample of the loop's time between steps above this multiple of its estimate counts as this
# multiple: one stall (a page fault storm, the process descheduled, a garbage collection) would
# otherwise raise a per-step cost for dozens of steps; a lasting change still moves the estimate
# (by up to this factor per sample's weight).
OUTLIER_RATIO = 4.0


def clip_outlier(x: float, estimate: float | None) -> float:
    """``x`` capped at ``OUTLIER_RATIO`` times the current ``estimate`` (None / nan: as is)."""
    if estimate is None or not math.isfinite(estimate) or estimate <= 0:
        return x
    return min(x, OUTLIER_RATIO * estimate)


def drawn_back(own: float | None, prior: float, age: int, half_life: float) -> float:
    """A request's own forecast ``own`` drawn back to ``prior`` by half every ``half_life`` steps
    of ``age`` (None: no forecast of its own, the prior; a NaN prior: its own as it is)."""
    if own is None:
        return prior
    if math.isnan(prior) or not age:
        return own
    return prior + (own - prior) * 0.5 ** (age / half_life)


def _regime_key(temperature: float) -> float:
    """Sampling temperatures that accept alike share a prior (0: greedy)."""
    return round(float(temperature), 1)


@dataclass
class _Mean:
    """A moving average; a plain mean until there are 1/smoothing samples, so that one slow first
    step (cold caches) does not stand for the choice for long."""

    value: float = math.nan
    count: int = 0

    def update(self, x: float, smoothing: float) -> None:
        self.count += 1
        w = max(smoothing, 1.0 / self.count)
        self.value = x if math.isnan(self.value) else (1 - w) * self.value + w * x


@dataclass
class _StepTime(_Mean):
    """A step time's moving average, robust while it starts: the median of the first 1/smoothing
    samples (their minimum below three), then the moving average. The first steps of a fresh
    server are several times slower (cold caches, first allocations); averaged in, they made
    drafting look dear for hundreds of steps, and exploring it rare for as long."""

    first: list[float] = field(default_factory=list)
    seed: bool = False  # the value is a neighbouring bucket's, scaled: not a measurement

    @classmethod
    def seeded(cls, value: float, count: int) -> _StepTime:
        return cls(value, count, [value] * count, seed=True)

    def update(self, x: float, smoothing: float) -> None:
        if self.seed:  # the first measurement replaces the estimate outright: as seed samples
            # it outvoted real ones in the median (a drafting step at 64 requests seeded from
            # 20 at 34 ms, measured at 46-48 ms, stayed 34 ms and kept drafting look cheap)
            self.seed = False
            self.first = [x] * len(self.first)
            self.value = x
        self.count += 1
        if self.count > round(1.0 / smoothing):
            self.first.clear()
            self.value = (1 - smoothing) * self.value + smoothing * x
            return
        self.first.append(x)
        self.value = min(self.first) if len(self.first) < 3 else statistics.median(self.first)


@dataclass
class _Bucket:
    draft_seconds: _StepTime = field(default_factory=_StepTime)
    plain_seconds: _StepTime = field(default_factory=_StepTime)
    tokens_per_request: _Mean = field(default_factory=_Mean)  # in drafting steps: the prior
    switch_seconds: _Mean = field(default_factory=_Mean)  # catch-up of a drafting step after plain ones
    partial_lost: _Mean = field(default_factory=_Mean)  # what drafting for a few costs, vs plain
    # the engine loop's time between a step of each kind and the next one (streaming the
    # outputs, metrics, scheduling): paid once per step, whatever the step emitted
    outside_draft: _Mean = field(default_factory=_Mean)
    outside_plain: _Mean = field(default_factory=_Mean)
    since_explore: int = 0
    since_partial: int = 0
    since_plain: int = 0  # steps since a plain step's time was measured

    def outside(self, drafted: bool) -> float:
        """Seconds the loop spends outside a step of this kind (the other kind's until measured)."""
        kinds = (self.outside_draft, self.outside_plain)
        for m in kinds if drafted else kinds[::-1]:
            if m.count and math.isfinite(m.value):
                return m.value
        return 0.0

    def iteration(self, drafted: bool) -> float:
        """A whole loop iteration with a step of this kind: the step's time and the loop's."""
        return (self.draft_seconds if drafted else self.plain_seconds).value + self.outside(drafted)

    def measured(self, min_samples: int) -> bool:
        """Both step kinds measured ``min_samples`` times (or seeded as if they were)."""
        return min(self.draft_seconds.count, self.plain_seconds.count) >= min_samples


class DraftGate:
    def __init__(
        self,
        explore_every: int = 4,
        max_explore_interval: int = 1024,
        smoothing: float = 0.05,
        request_smoothing: float = 0.2,
        max_explore_overhead: float = 0.06,
        min_samples: int = 2,
        explore_fraction: float = 0.125,
        partial_explore_overhead: float = 0.01,
        near_ratio: float = 0.9,
        prior_samples: int = 20,
        forecast_half_life: float = 16.0,
        explore_run: int = 3,
        enter_margin: float = 1.15,
        stay_ratio: float = 0.95,
        max_hold: int = 16,
        hold_margin: float = 1.1,
        refresh_overhead: float = 0.005,
        odds_power: float = 4.0,
        forced_explore_overhead: float = 0.005,
        prior_smoothing: float = 0.005,
    ) -> None:
        if explore_every < 2 or max_explore_interval < explore_every:
            raise ValueError("explore_every must be >= 2 and <= max_explore_interval")
        if not all(0.0 < x <= 1.0 for x in (smoothing, request_smoothing, prior_smoothing)):
            raise ValueError("smoothing, request_smoothing and prior_smoothing must be in (0, 1]")
        if not (0.0 < max_explore_overhead < 1.0 and 0.0 < partial_explore_overhead < 1.0):
            raise ValueError("max_explore_overhead and partial_explore_overhead must be in (0, 1)")
        if not (0.0 < explore_fraction <= 1.0 and 0.0 < near_ratio <= 1.0):
            raise ValueError("explore_fraction and near_ratio must be in (0, 1]")
        if explore_run < 1:
            raise ValueError("explore_run must be >= 1")
        if not enter_margin >= 1.0:
            raise ValueError("enter_margin must be >= 1")
        if not 0.0 < stay_ratio <= 1.0:
            raise ValueError("stay_ratio must be in (0, 1]")
        if max_hold < 0 or not hold_margin >= 1.0:
            raise ValueError("max_hold must be >= 0 and hold_margin >= 1")
        if not 0.0 < refresh_overhead < 1.0:
            raise ValueError("refresh_overhead must be in (0, 1)")
        if not odds_power > 0.0:
            raise ValueError("odds_power must be > 0")
        if not 0.0 < forced_explore_overhead < 1.0:
            raise ValueError("forced_explore_overhead must be in (0, 1)")
        self.explore_every = explore_every
        self.max_explore_interval = max_explore_interval
        self.smoothing = smoothing
        self.prior_smoothing = prior_smoothing
        self.request_smoothing = request_smoothing
        self.max_explore_overhead = max_explore_overhead
        self.min_samples = max(1, min_samples)
        self.explore_fraction = explore_fraction
        self.partial_explore_overhead = partial_explore_overhead
        self.near_ratio = near_ratio
        self.prior_samples = prior_samples
        self.forecast_half_life = forecast_half_life
        self.explore_run = explore_run
        self.enter_margin = enter_margin
        self.stay_ratio = stay_ratio
        self.max_hold = max_hold
        self.hold_margin = hold_margin
        self.refresh_overhead = refresh_overhead
        self.odds_power = odds_power
        self.forced_explore_overhead = forced_explore_overhead
        self._steps = 0
        # a choice held for the next steps of the same requests: (steps left, their ids, the load
        # bucket whose counters those steps advance, whether the choice drafts)
        self._hold: tuple[int, tuple[str, ...], _Bucket, bool] | None = None
        # whether the last two choices drafted for every request (None: not asked): a drafting
        # step is warm when the choice before it drafted too
        self._last_drafted: bool | None = None
        self._before_drafted: bool | None = None
        self._run_left = 0  # drafting steps left in the current exploration run
        self._run_ids: tuple[str, ...] = ()  # the requests it explores
        self._drafted_at: dict[str, int] = {}  # request id -> the last step it drafted in
        self._buckets: dict[int, _Bucket] = {}
        self._forecast: dict[str, float] = {}  # request id -> tokens per drafting step
        self._drafts: dict[str, int] = {}  # request id -> its drafting steps so far
        self._prior = _Mean()  # all loads: for a bucket that has not drafted yet
        self._regimes: dict[tuple[int, float], _Mean] = {}  # (bucket or 0 = any, regime) -> prior
        # per (load bucket or 0 = any, regime): tokens drafting steps kept, beside ``_regimes``
        # (the tokens their plans expected): calibration off the traffic's distribution shows
        # here first, and differently at each load (plans verify other positions); forecasts
        # are scaled by the ratio
        self._kept: dict[tuple[int, float], _Mean] = {}

    @staticmethod
    def bucket_of(num_requests: int) -> int:
        return max(1, num_requests).bit_length()

    def _bucket(self, num_requests: int) -> _Bucket:
        key = self.bucket_of(num_requests)
        if key not in self._buckets:
            self._buckets[key] = self._seeded_bucket(key)
        return self._buckets[key]

    def _seeded_bucket(self, key: int) -> _Bucket:
        """A load bucket seen for the first time starts from the nearest measured one, its step
        times scaled by the load ratio (2 per bucket), as if warmed up: ramping through seven
        buckets would otherwise spend 2 x 7 drafting steps where drafting may cost several plain
        steps. Its own steps replace the seed within a few samples."""
        b = _Bucket()
        self._fill_from_neighbour(key, b)
        return b

    def _fill_from_neighbour(self, key: int, b: _Bucket) -> None:
        """What ``b`` (bucket ``key``) has not measured at all, from the nearest measured bucket,
        scaled. Also for a bucket that exists already but measured only one kind: a load ramping
        up fills every bucket with plain samples while prompts take the budget, and ramping down
        from a measured top bucket must not warm each of them up by drafting (at 64 -> 1
        requests on the K=8 twin: 8 drafting steps, 3.2 s of a 49 s run)."""
        warm = [k for k, w in self._buckets.items() if k != key and w.measured(self.min_samples)]
        if not warm:
            return
        near = min(warm, key=lambda k: abs(k - key))
        src, scale = self._buckets[near], 2.0 ** (key - near)
        if b.draft_seconds.count == 0:
            b.draft_seconds = _StepTime.seeded(src.draft_seconds.value * scale, self.min_samples)
        if b.plain_seconds.count == 0:
            b.plain_seconds = _StepTime.seeded(src.plain_seconds.value * scale, self.min_samples)
        if b.tokens_per_request.count == 0:
            b.tokens_per_request = _Mean(src.tokens_per_request.value, self.min_samples)

    def forecast_tokens(self, request_ids: Sequence[str], regimes: Sequence[float] | None = None) -> float:
        """Tokens a drafting step is expected to emit for these requests (``regimes``: each one's
        sampling temperature, which picks a newcomer's prior)."""
        key = self.bucket_of(len(request_ids))
        prior = self._bucket(len(request_ids)).tokens_per_request.value
        if math.isnan(prior):
            prior = self._prior.value
        if regimes is None:
            return sum(self._aged(rid, prior) for rid in request_ids)
        # per distinct regime (a step has few): its prior and its realised ratio, then one
        # aged forecast per request (this runs every step, at every load: keep it tight)
        per_regime: dict[float, tuple[float, float]] = {}
        forecast, drafted_at, now, half_life = (
            self._forecast,
            self._drafted_at,
            self._steps,
            self.forecast_half_life,
        )
        total = 0.0
        for rid, regime in zip(request_ids, regimes, strict=True):
            known = per_regime.get(regime)
            if known is None:
                known = per_regime[regime] = (
                    self._regime_prior(key, regime, prior),
                    self.realised_ratio(regime, len(request_ids)),
                )
            p, ratio = known
            total += drawn_back(forecast.get(rid), p, now - drafted_at.get(rid, now), half_life) * ratio
        return total

    def _aged(self, request_id: str, prior: float) -> float:
        """A request's forecast, drawn back to ``prior`` by half every ``forecast_half_life``
        steps since it last drafted: acceptance drifts along a generation, and a forecast left
        low by a hard stretch would otherwise stand until the next exploration, while one left
        high is refreshed at every step it drafts. Without that pull, stale forecasts are
        biased low and the gate keeps plain steps where drafting would pay."""
        age = self._steps - self._drafted_at.get(request_id, self._steps)
        return drawn_back(self._forecast.get(request_id), prior, age, self.forecast_half_life)

    def realised_ratio(self, regime: float, num_requests: int | None = None) -> float:
        """Tokens kept / tokens expected by the plans, over recent drafting steps of requests of
        this sampling regime at this load (at any load until this one has ``min_samples``
        steps; 1 until measured; within [1/2, 2])."""
        key = _regime_key(regime)
        for bucket in ((self.bucket_of(num_requests),) if num_requests else ()) + (0,):
            kept, expected = self._kept.get((bucket, key)), self._regimes.get((bucket, key))
            if kept is None or expected is None or not expected.value > 0:
                continue
            if bucket and kept.count < self.min_samples:
                continue
            return min(2.0, max(0.5, kept.value / expected.value))
        return 1.0

    def _regime_prior(self, bucket: int, regime: float, fallback: float) -> float:
        """A newcomer's prior: the mean of requests of its sampling regime at this load; else the
        load bucket's mean (``fallback``) scaled by how the regime compares with all requests
        over every load (greedy and sampled requests accept very differently, and the plan's
        lengths, hence the tokens, shrink with load: an any-load mean alone would overstate
        them at high load)."""
        key = _regime_key(regime)
        own = self._regimes.get((bucket, key))
        if own is not None and not math.isnan(own.value):
            return own.value
        anywhere = self._regimes.get((0, key))
        if anywhere is not None and not math.isnan(anywhere.value) and self._prior.value > 0:
            return fallback * anywhere.value / self._prior.value
        return fallback

    def explore_interval(
        self, lost: float, best_seconds: float, budget: float | None = None, cap: int | None = None
    ) -> int:
        """Steps between explorations so that the time they lose (an exploring step's time minus
        what the best choice needs for the same tokens) stays within the budget (a fraction of
        the time; ``max_explore_overhead`` unless given), at most ``cap`` steps apart
        (``max_explore_interval`` unless given; an exploration's is its ``forced_interval``)."""
        steps = lost / ((self.max_explore_overhead if budget is None else budget) * best_seconds)
        most = self.max_explore_interval if cap is None else cap
        return min(most, max(self.explore_every, math.ceil(steps)))

    def forced_interval(self, lost: float, best_seconds: float) -> int:
        """The most steps between two explorations, whatever the odds: ``max_explore_interval``,
        or more where explorations that often would lose more than ``forced_explore_overhead``
        of the time. At 16 requests on the demo pair a whole drafting step after plain ones
        (the put-off context writes of every request's prompt) cost about ten plain steps' time
        (a scratch trace of step kinds), and an exploration run of them every 1024 steps took a
        few per cent of the time."""
        if not (lost > 0 and best_seconds > 0):
            return self.max_explore_interval
        floor = math.ceil(lost / (self.forced_explore_overhead * best_seconds))
        return max(self.max_explore_interval, floor)

    def exploration_odds(self, draft_rate: float, plain_rate: float) -> float:
        """The share of the exploration budgets spent while plain steps lead: exploring is worth
        the odds of drafting winning, so the further behind its forecast (below ``near_ratio``
        of the plain rate), the rarer the re-checks: (ratio / near_ratio) ** ``odds_power``,
        within [1e-3, 1]. At high load on a CPU drafting loses by a factor of five or more, and a
        flat budget spent a few per cent of the time re-learning that."""
        if not plain_rate > 0:
            return 1.0
        return min(1.0, max(1e-3, (draft_rate / (self.near_ratio * plain_rate)) ** self.odds_power))

    def explore_size(self, num_requests: int) -> int:
        """Requests that draft in a partial exploration (all of them: no partial exploration)."""
        return min(num_requests, max(1, math.ceil(self.explore_fraction * num_requests)))

    def choose(
        self, request_ids: Sequence[str], regimes: Sequence[float] | None = None, room: int | None = None
    ) -> list[int]:
        """Which of the step's decoding requests draft (indices into ``request_ids``): all of
        them, none (a plain step), or a few, exploring while plain steps are the faster choice.
        ``regimes``: their sampling temperatures. ``room``: how many of them the step's token
        budget lets draft (None: all); a warm-up sample or an exploration of whole drafting
        steps waits for a step where all of them can (the rest would take plain tokens in the
        same forward: a partial step, which measures neither kind)."""
        chosen = self._held(request_ids)
        if chosen is None:
            chosen = self._choose(request_ids, regimes, room is None or room >= len(request_ids))
        self._before_drafted = self._last_drafted
        self._last_drafted = bool(request_ids) and len(chosen) == len(request_ids)
        if not self._last_drafted:
            self._run_left = 0
        return chosen

    def holds(self, request_ids: Sequence[str]) -> bool:
        """Whether the next ``choose`` for these requests is a held choice (one that reads no
        estimate: plain, or drafting while it clearly wins)."""
        hold = self._hold
        return hold is not None and hold[0] > 0 and hold[1] == tuple(request_ids)

    def _held(self, request_ids: Sequence[str]) -> list[int] | None:
        """A choice still held for these very requests: the step only advances the counters a
        full choice would (None: choose in full). Where one choice wins clearly, the full choice
        (forecasts aged per request, rates, exploration intervals) cost ~20-30 us a step, which
        at one request is several per cent of a ~0.5 ms plain step, and ~1% of a drafting one,
        whose lessons also wait while it is held (``SpeculativeDecoder.lessons``)."""
        hold = self._hold
        if hold is None:
            return None
        left, ids, b, drafting = hold
        if left <= 0 or ids != tuple(request_ids):
            self._hold = None
            return None
        self._hold = (left - 1, ids, b, drafting)
        self._steps += 1
        b.since_explore += 1
        b.since_plain += 1
        if drafting:  # (since_partial stays 0, as the full choice to draft that started it set)
            return list(range(len(ids)))
        b.since_partial += 1
        return []

    def _hold_plain(self, request_ids: Sequence[str], b: _Bucket, steps: int) -> list[int]:
        """Choose plain now and for up to ``steps`` more steps of the same requests (capped by
        ``max_hold``), re-deciding as soon as the requests change."""
        steps = min(self.max_hold, steps)
        self._hold = (steps, tuple(request_ids), b, False) if steps > 0 else None
        return []

    def _hold_drafting(self, request_ids: Sequence[str], b: _Bucket, steps: int) -> list[int]:
        """Draft for every request now and for up to ``steps`` more steps of the same requests
        (capped by ``max_hold``)."""
        steps = min(self.max_hold, steps)
        self._hold = (steps, tuple(request_ids), b, True) if steps > 0 else None
        return list(range(len(request_ids)))

    def _explore_drafting(self, request_ids: Sequence[str]) -> list[int]:
        """Start an exploration run of whole drafting steps (``explore_run`` of them) for these
        requests: it ends when they change (a newcomer would pay its whole prompt's catch-up,
        on the demo pair's waves of four requests ~10-20 ms a step against ~6 for a warm one)."""
        self._run_left = self.explore_run - 1
        self._run_ids = tuple(request_ids)
        return list(range(len(request_ids)))

    def _choose(self, request_ids: Sequence[str], regimes: Sequence[float] | None, whole: bool) -> list[int]:
        n = len(request_ids)
        everyone, nobody = list(range(n)), list[int]()
        self._steps += 1
        if len(self._forecast) > n or len(self._drafted_at) > n or self._steps % 64 == 0:
            live = set(request_ids)  # requests that left take their forecasts along
            self._forecast = {rid: f for rid, f in self._forecast.items() if rid in live}
            self._drafts = {rid: c for rid, c in self._drafts.items() if rid in live}
            self._drafted_at = {rid: t for rid, t in self._drafted_at.items() if rid in live}
        b = self._bucket(n)
        if not b.measured(self.min_samples):
            self._fill_from_neighbour(self.bucket_of(n), b)
        if not b.measured(self.min_samples):  # warm-up: drafting steps in a run (warm), then plain
            # (while prompts fill the budget, as a load ramps up, the drafting samples wait: at
            # 7 -> 58 requests on the K=8 twin, 17 such steps drafted for the few requests the
            # budget left, ~650 ms each against ~110 ms plain, and measured nothing)
            return everyone if b.draft_seconds.count < self.min_samples and whole else nobody
        b.since_explore += 1
        b.since_plain += 1
        if self._run_left > 0 and self._last_drafted:
            if self._run_ids == tuple(request_ids):
                self._run_left -= 1
                return everyone
            self._run_left = 0
        switch = b.switch_seconds.value if b.switch_seconds.count else 0.0
        tokens = self.forecast_tokens(request_ids, regimes)
        # rates over whole loop iterations: the loop's time outside a step is paid per step, so
        # leaving it out would favour the short plain steps
        draft_s, plain_s = b.iteration(True), b.iteration(False)
        draft_rate = tokens / draft_s
        plain_rate = n / plain_s
        # from plain steps, drafting also pays the switch once, over the run it starts
        entry_rate = draft_rate if self._last_drafted else tokens / (draft_s + switch / self.explore_run)
        # from plain steps, drafting must win by enter_margin: near break-even, the choice flips
        # on noise and each flip pays the switch
        bar = plain_rate * (self.stay_ratio if self._last_drafted else self.enter_margin)
        if entry_rate >= bar:  # exploring a plain step also pays the switch back
            # it only refreshes the load's plain step time (a plain step emits one token for
            # any request): due when no plain step measured it for the interval
            lost = plain_s * max(0.0, 1.0 - plain_rate / draft_rate) + switch
            refresh_due = self.explore_interval(lost, draft_s, self.refresh_overhead)
            if b.since_plain >= refresh_due:
                b.since_explore = b.since_plain = 0
                return nobody
            b.since_partial = 0  # every forecast is being refreshed
            # drafting after drafting and winning clearly: for the next few steps of these
            # requests too, up to the step before the plain-time refresh falls due
            if self._last_drafted and entry_rate >= bar * self.hold_margin:
                return self._hold_drafting(request_ids, b, refresh_due - b.since_plain - 1)
            return everyone
        # plain is faster; exploring a run of drafting steps also pays the switch into it
        loss_rate = max(0.0, 1.0 - draft_rate / plain_rate)
        lost = self.explore_run * draft_s * loss_rate + switch
        few = self.explore_size(n)
        b.since_partial += 1
        if (
            whole
            and few == n
            and b.since_explore >= self.explore_every
            and self._unsure_newcomer(request_ids, regimes)
        ):
            b.since_explore = b.since_partial = 0  # a newcomer on a prior of few samples: learn it, once
            return self._explore_drafting(request_ids)
        near = draft_rate >= self.near_ratio * plain_rate
        odds = self.exploration_odds(draft_rate, plain_rate)
        forced = self.forced_interval(lost, plain_s)
        interval = self.explore_interval(lost, plain_s, self.max_explore_overhead * odds, forced)
        due = interval if near or few == n else forced
        if b.since_explore >= due and whole:
            b.since_explore = b.since_partial = 0
            return self._explore_drafting(request_ids)
        # plain for now; while drafting clearly loses, for the next few steps of these requests
        # too, up to the step before an exploration could fall due
        hold = due - b.since_explore - 1 if entry_rate * self.hold_margin < bar else 0
        if few == n:
            if b.since_explore < self.explore_every and self._unsure_newcomer(request_ids, regimes):
                hold = min(hold, self.explore_every - b.since_explore - 1)
            return self._hold_plain(request_ids, b, hold)
        partial = max(0.0, b.partial_lost.value if b.partial_lost.count else lost * few / n)
        budget = self.partial_explore_overhead * odds
        partial_due = self.explore_interval(partial, plain_s, budget, self.forced_interval(partial, plain_s))
        if b.since_partial < partial_due:
            return self._hold_plain(request_ids, b, min(hold, partial_due - b.since_partial - 1))
        b.since_partial = 0
        # the requests known least: never drafted first (they stand on a prior), then the oldest
        order = sorted(everyone, key=lambda i: self._drafted_at.get(request_ids[i], -1))
        return sorted(order[:few])

    def _unsure_newcomer(self, request_ids: Sequence[str], regimes: Sequence[float] | None) -> bool:
        """Whether a request that never drafted has a forecast standing on a prior of fewer than
        ``prior_samples`` drafting steps (its regime's at this load): one weak early sample (a
        short warm-up prompt) would otherwise keep every later request on plain steps, and the
        prior would never learn otherwise."""
        key = self.bucket_of(len(request_ids))
        for i, rid in enumerate(request_ids):
            if rid in self._drafted_at:
                continue
            if regimes is None:
                prior = self._buckets[key].tokens_per_request
            else:
                prior = self._regimes.get((key, _regime_key(regimes[i]))) or _Mean()
            if prior.count < self.prior_samples:
                return True
        return False

    def record(
        self,
        request_ids: Sequence[str],
        drafted: bool,
        tokens: Sequence[float],
        seconds: float,
        switch_seconds: float = 0.0,
        regimes: Sequence[float] | None = None,
        num_requests: int | None = None,
        kept: Sequence[float] | None = None,
    ) -> None:
        """A finished step: its requests (the drafting ones, for a drafting step), whether it
        drafted, the tokens each request emitted (or, better, the plan's calibrated expectation
        of them: far less noisy than one draw), its time (the decoding share of it, without the
        catch-up) and, for a drafting step, the catch-up of the context writes earlier plain
        steps put off. ``num_requests``: the step's decoding requests, when only some drafted
        (a partial exploration; the others emitted one token each). ``kept``: the tokens each
        request did emit, when ``tokens`` are expectations (with ``regimes``: it corrects the
        expectations' bias per regime; without it, ``tokens`` are what was emitted)."""
        if seconds <= 0 or not math.isfinite(seconds) or not request_ids:
            return
        load = len(request_ids) if num_requests is None else max(num_requests, len(request_ids))
        if not drafted:
            self.record_plain(load, seconds)
            return
        self._hold = None  # forecasts move: the next choice is made in full
        key = self.bucket_of(load)
        b = self._bucket(load)
        switch = switch_seconds if switch_seconds > 0 and math.isfinite(switch_seconds) else 0.0
        if load > len(request_ids):  # a few drafted: what that cost against a plain step's tokens
            if b.plain_seconds.count:
                same_tokens = b.plain_seconds.value * (sum(tokens) + load - len(request_ids)) / load
                b.partial_lost.update(seconds + switch - same_tokens, self.smoothing)
        elif self._before_drafted is False and b.draft_seconds.count >= self.min_samples:
            # the first drafting step after plain ones: its excess over a warm one and the
            # catch-up are the price of switching, not of drafting
            excess = max(0.0, seconds - b.draft_seconds.value)
            b.switch_seconds.update(switch + excess, self.smoothing)
        else:
            b.draft_seconds.update(seconds, self.smoothing)
            # a switch while the bucket warms up; after a drafting step the catch-up is a few
            # plain decodes' rows at most, not the price of switching (averaged in, the warm
            # steps of exploration runs held the estimate at ~1.5 ms where a switch at four
            # requests cost 5-10: explorations came twice as often as their budget allows)
            if switch > 0 and self._before_drafted is False:
                b.switch_seconds.update(switch, self.smoothing)
        b.tokens_per_request.update(sum(tokens) / len(tokens), self.prior_smoothing)
        self._prior.update(sum(tokens) / len(tokens), self.prior_smoothing)
        if regimes is not None:  # per regime: [tokens expected, tokens kept, requests]
            by_regime: dict[float, list[float]] = {}
            for regime, n, k in zip(regimes, tokens, tokens if kept is None else kept, strict=True):
                sums = by_regime.setdefault(_regime_key(regime), [0.0, 0.0, 0])
                sums[0], sums[1], sums[2] = sums[0] + n, sums[1] + k, sums[2] + 1
            for regime, (expected, emitted, rows) in by_regime.items():
                for where in ((key, regime), (0, regime)):  # 0: any load
                    self._regimes.setdefault(where, _Mean()).update(expected / rows, self.prior_smoothing)
                    self._kept.setdefault(where, _Mean()).update(emitted / rows, self.prior_smoothing)
        bucket_mean = b.tokens_per_request.value
        for i, (rid, n) in enumerate(zip(request_ids, tokens, strict=True)):
            if rid in self._forecast:  # its own, aged as the forecast the choice was made on
                base = bucket_mean if regimes is None else self._regime_prior(key, regimes[i], bucket_mean)
                prior = self._aged(rid, base)
            else:
                prior = bucket_mean
            # the prior weighs as one step: a request's own first steps outweigh it quickly
            count = self._drafts[rid] = self._drafts.get(rid, 0) + 1
            w = max(self.request_smoothing, 1.0 / (count + 1))
            self._forecast[rid] = (1 - w) * prior + w * n
            self._drafted_at[rid] = self._steps

    def record_plain(self, num_requests: int, seconds: float) -> None:
        """A finished plain step of ``num_requests`` decoding requests (its decoding share of time)."""
        if seconds > 0 and math.isfinite(seconds) and num_requests > 0:
            b = self._bucket(num_requests)
            b.plain_seconds.update(seconds, self.smoothing)
            b.since_plain = 0

    def record_plain_many(self, num_requests: int, seconds: Sequence[float]) -> None:
        """``record_plain`` for plain steps of the same load, in the order they ran."""
        if num_requests <= 0:
            return
        b = self._bucket(num_requests)
        times, smoothing = b.plain_seconds, self.smoothing
        for x in seconds:
            if x > 0 and math.isfinite(x):
                times.update(x, smoothing)
                b.since_plain = 0

    def record_outside_plain(self, lessons: Sequence[tuple[int, float]]) -> None:
        """``record_outside`` for plain steps: (decoding requests, loop seconds), in order."""
        last_n, mean = 0, _Mean()
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

    def _update_loop_time(self, mean: _Mean, seconds: float) -> None:
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
