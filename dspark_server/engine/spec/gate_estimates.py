"""The draft gate's estimates: moving averages of step times and tokens, kept per load bucket
(``LoadBucket``), and the two small rules they are read with (a stall clipped, a stale forecast
drawn back to its prior)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
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


def regime_key(temperature: float) -> float:
    """Sampling temperatures that accept alike share a prior (0: greedy)."""
    return round(float(temperature), 1)


@dataclass
class MovingMean:
    """A moving average; a plain mean until there are 1/smoothing samples, so that one slow first
    step (cold caches) does not stand for the choice for long."""

    value: float = math.nan
    count: int = 0

    def update(self, x: float, smoothing: float) -> None:
        self.count += 1
        w = max(smoothing, 1.0 / self.count)
        self.value = x if math.isnan(self.value) else (1 - w) * self.value + w * x


@dataclass
class StepTime(MovingMean):
    """A step time's moving average, robust while it starts: the median of the first 1/smoothing
    samples (their minimum below three), then the moving average. The first steps of a fresh
    server are several times slower (cold caches, first allocations); averaged in, they made
    drafting look dear for hundreds of steps, and exploring it rare for as long."""

    first: list[float] = field(default_factory=list)
    seed: bool = False  # the value is a neighbouring bucket's, scaled: not a measurement

    @classmethod
    def seeded(cls, value: float, count: int) -> StepTime:
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

    def pull_down(self, x: float, weight: float) -> None:
        """Move the estimate ``weight`` of the way down to ``x`` (a measurement below it), past
        the moving average's pace and the median's inertia (the starting samples above the new
        value are lowered to it)."""
        if not x < self.value:
            return
        self.value += weight * (x - self.value)
        self.first = [min(f, self.value) for f in self.first]


@dataclass
class LoadBucket:
    draft_seconds: StepTime = field(default_factory=StepTime)
    plain_seconds: StepTime = field(default_factory=StepTime)
    tokens_per_request: MovingMean = field(default_factory=MovingMean)  # in drafting steps: the prior
    # a drafting step after plain ones: its catch-up and its excess over a warm drafting step
    switch_seconds: MovingMean = field(default_factory=MovingMean)
    # of it, writing the context of prompts prefilled in plain steps: every request that drafts
    # pays that once, whenever it first does (a drafting step writes its prefill chunks' too)
    switch_prompt_seconds: MovingMean = field(default_factory=MovingMean)
    stay_steps: MovingMean = field(default_factory=MovingMean)  # drafting steps in a row, per switch
    partial_lost: MovingMean = field(default_factory=MovingMean)  # what drafting for a few costs, vs plain
    # the engine loop's time between a step of each kind and the next one (streaming the
    # outputs, metrics, scheduling): paid once per step, whatever the step emitted
    outside_draft: MovingMean = field(default_factory=MovingMean)
    outside_plain: MovingMean = field(default_factory=MovingMean)
    since_explore: int = 0
    since_partial: int = 0
    since_plain: int = 0  # steps since a plain step's time was measured
    plain_at: int = 0  # the gate's step count when a plain step's time was last recorded
    # drafting's forecast rate over plain steps' at this load, averaged over the full choices:
    # whether a request joining this load is likely to draft (DraftGate.expects_drafting)
    draft_ratio: MovingMean = field(default_factory=MovingMean)
    # per sampling regime (``regime_key``): the share of the full choices its requests took part
    # in that drafted for every request (DraftGate.drafts_at)
    drafted_share: dict[float, MovingMean] = field(default_factory=dict)
    since_choice: int = 0  # plain steps since a full choice, where no request could draft

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

    def record_switch(self, seconds: float, prompt_seconds: float, smoothing: float) -> None:
        """A switch into drafting: its whole price, and of it the prompts' context rows."""
        self.switch_seconds.update(seconds, smoothing)
        self.switch_prompt_seconds.update(prompt_seconds, smoothing)

    def entry_switch(self) -> float:
        """The price of re-entering drafting: the switch less the prompts' rows (0 until measured)."""
        if not self.switch_seconds.count:
            return 0.0
        prompts = self.switch_prompt_seconds.value if self.switch_prompt_seconds.count else 0.0
        return max(0.0, self.switch_seconds.value - prompts)

    def measured(self, min_samples: int) -> bool:
        """Both step kinds measured ``min_samples`` times (or seeded as if they were)."""
        return min(self.draft_seconds.count, self.plain_seconds.count) >= min_samples


def seed_scales(
    forward_seconds: Callable[[int], float] | None, near: int, key: int, tokens_per_request: float
) -> tuple[float, float]:
    """(plain, drafting) step time at load bucket ``key`` over bucket ``near``'s: the ratio of
    forward times (``forward_seconds``: the SPS table's curve) at their smallest loads (bucket k
    holds 2^(k-1) to 2^k - 1 requests), a drafting step's at about 1 + ``tokens_per_request``
    tokens a request (its verified tokens); 2 per bucket without a curve. Doubling per bucket
    is far off where a step is bound by reading the weights: on the K=8 twin a drafting step
    seeded from one request to four said 178 ms, and the gate held plain steps on it for ~460
    steps (15 s) before a drafting step measured ~100 ms, against ~35 ms for a plain step of
    four tokens."""
    fallback = 2.0 ** (key - near)
    if forward_seconds is None:
        return fallback, fallback
    n_near, n_key = 1 << (near - 1), 1 << (key - 1)
    per = 1.0 + max(1.0, tokens_per_request) if math.isfinite(tokens_per_request) else 2.0
    try:
        plain = forward_seconds(n_key) / forward_seconds(n_near)
        draft = forward_seconds(round(n_key * per)) / forward_seconds(round(n_near * per))
    except ZeroDivisionError:
        return fallback, fallback
    ok = all(math.isfinite(x) and x > 0 for x in (plain, draft))
    return (plain, draft) if ok else (fallback, fallback)


def learning_saves(means: Sequence[float], ratio: float, tokens: int, seconds: tuple[float, float]) -> float:
    """Seconds that learning a request's own acceptance saves on average over its next ``tokens``
    when it is one of the requests whose mean tokens per drafting step were ``means`` (scaled by
    the realised ``ratio``): each that drafts faster than plain steps (``seconds``: a drafting
    and a plain step's time, one request) would have drafted them."""
    draft_s, plain_s = seconds
    saved = sum(max(0.0, plain_s - draft_s / (x * ratio)) for x in means if x * ratio > 0)
    return tokens * saved / max(1, len(means))


def newcomer_ratio(b: LoadBucket) -> float:
    """A request's drafting rate on the load's prior (its mean tokens per request in drafting
    steps) over its plain rate, both over whole loop iterations (NaN until both are measured)."""
    drafting = b.iteration(True)
    if not drafting > 0:
        return math.nan
    return b.tokens_per_request.value * b.iteration(False) / drafting
