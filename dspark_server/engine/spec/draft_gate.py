"""Whether drafting pays off this step, forecast from measured step times and each request's own
acceptance (the design and the measurements behind every setting: docs/draft-gate.md).

Two forecasts of tokens per second over whole engine-loop iterations are compared per load
bucket (powers of two of the number of decoding requests):

- a drafting step emits Σ_r f_r tokens in S_d seconds (f_r: request r's forecast,
  ``RequestForecasts``);
- a plain step emits one token per request in S_p seconds.

S_d and S_p are moving averages of measured step times and the loop's time after each step
(``LoadBucket``). From plain steps drafting is entered when it wins by ``enter_margin`` after
paying the switch (the put-off context writes and a cold step) over ``explore_run`` steps; once
drafting, it stays while it reaches ``stay_ratio`` of plain steps' rate. The slower choice is
explored within time budgets weighed by the odds of it winning: whole drafting steps, or drafting
for a few requests while the others take their plain token in the same forward; while drafting
wins, a plain step now and then keeps plain steps' time current. A clear choice is held for the
next steps of the same requests (``max_hold``), whose lessons wait and are filed in one go
(``engine/spec/held_lessons.py``).

The decision depends on past steps only, never on the tokens about to be drafted, so skipping a
draft changes speed, not the output distribution.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from dspark_server.engine.spec.gate_estimates import LoadBucket, learning_saves
from dspark_server.engine.spec.reuse_rules import ReuseRules

MIN_REQUEST_MEANS = 3  # departed requests of a regime before a newcomer is priced on them
# how fast a load's averaged forecast ratio (``expects_drafting``) follows the full choices: a few
# choices, so that a load first priced on a neighbour's seeded times is soon priced on its own
RATIO_SMOOTHING = 0.2


class DraftGate(ReuseRules):
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
        ratio_prior_steps: float = 16.0,
        newcomer_upside: float = 2.5,
        reuse_ratio: float = 0.75,
        relearn_steps: int = 256,
        forward_seconds: Callable[[int], float] | None = None,
    ) -> None:
        """``forward_seconds``: the target forward's time at B batch tokens (the SPS table's
        curve), which scales a measured bucket's step times to a load seen for the first time;
        None: 2 per bucket."""
        if explore_every < 2 or max_explore_interval < explore_every:
            raise ValueError("explore_every must be >= 2 and <= max_explore_interval")
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
        if not newcomer_upside >= 0.0:
            raise ValueError("newcomer_upside must be >= 0")
        if not reuse_ratio >= 0.0:
            raise ValueError("reuse_ratio must be >= 0")
        if relearn_steps < 1:
            raise ValueError("relearn_steps must be >= 1")
        super().__init__(
            smoothing,
            request_smoothing,
            prior_smoothing,
            min_samples,
            forecast_half_life,
            ratio_prior_steps,
            forward_seconds,
        )
        self.explore_every = explore_every
        self.max_explore_interval = max_explore_interval
        self.max_explore_overhead = max_explore_overhead
        self.explore_fraction = explore_fraction
        self.partial_explore_overhead = partial_explore_overhead
        self.near_ratio = near_ratio
        self.prior_samples = prior_samples
        self.explore_run = explore_run
        self.enter_margin = enter_margin
        self.stay_ratio = stay_ratio
        self.max_hold = max_hold
        self.hold_margin = hold_margin
        self.refresh_overhead = refresh_overhead
        self.odds_power = odds_power
        self.forced_explore_overhead = forced_explore_overhead
        self.newcomer_upside = newcomer_upside
        # below this forecast ratio of drafting's rate to plain steps', a request joining the
        # load reuses cached pages without the drafter's K/V (and so never drafts): the prefill
        # saved is worth more than the drafting it might do if the load's forecast recovered
        self.reuse_ratio = reuse_ratio
        # after this many steps at a load where no request could draft (so no choice moved the
        # load's forecast ratio), a request joining it keeps the drafter's context again: the
        # ratio would otherwise stand forever on the forecasts it last had
        self.relearn_steps = relearn_steps
        # a choice held for the next steps of the same requests: (steps left, their ids, the load
        # bucket whose counters those steps advance, whether the choice drafts)
        self._hold: tuple[int, tuple[str, ...], LoadBucket, bool] | None = None
        # whether the last two choices drafted for every request (None: not asked): a drafting
        # step is warm when the choice before it drafted too
        self._last_drafted: bool | None = None
        self._before_drafted: bool | None = None
        self._stay = 0  # drafting choices in a row so far (whole steps), at load bucket _stay_key
        self._stay_key = 0
        self._run_left = 0  # drafting steps left in the current exploration run
        self._run_ids: tuple[str, ...] = ()  # the requests it explores

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
        self,
        request_ids: Sequence[str],
        regimes: Sequence[float] | None = None,
        room: int | None = None,
        remaining: Sequence[int] | None = None,
        able: Sequence[int] | None = None,
        catch_up_seconds: float = 0.0,
    ) -> list[int]:
        """Which of the step's decoding requests draft (indices into ``request_ids``): all of
        them, none (a plain step), or a few, exploring while plain steps are the faster choice.
        ``regimes``: their sampling temperatures. ``room``: how many of them the step's token
        budget lets draft (None: all); a warm-up sample or an exploration of whole drafting
        steps waits for a step where all of them can (the rest would take plain tokens in the
        same forward: a partial step, which measures neither kind). ``remaining``: the tokens
        each may still emit (what learning a newcomer's acceptance can pay back over).
        ``able``: those that can draft, when not all of them can (the others were admitted
        without the drafter's context): explorations pick among them. ``catch_up_seconds``: what
        writing their put-off context rows would cost now (the least a switch into drafting
        costs)."""
        chosen = self._held(request_ids)
        if chosen is None:
            whole = room is None or room >= len(request_ids)
            chosen = self._choose(request_ids, regimes, whole, remaining, able, catch_up_seconds)
        self._before_drafted = self._last_drafted
        self._last_drafted = bool(request_ids) and len(chosen) == len(request_ids)
        if regimes and request_ids:  # a full choice: each regime's share of drafting ones
            self.record_share(len(request_ids), regimes, self._last_drafted)
        if self._last_drafted:
            self._stay += 1
            self._stay_key = self.bucket_of(len(request_ids))
        else:
            self._run_left = 0
            self._end_stay()
        return chosen

    def _end_stay(self) -> None:
        """A stay of drafting steps ended (if one ran): record what one switch into drafting bought."""
        if self._stay:
            stayed = self._buckets.get(self._stay_key)
            if stayed is not None:
                stayed.stay_steps.update(float(self._stay), self.smoothing)
            self._stay = 0

    def skip(self, num_requests: int) -> None:
        """A plain step of ``num_requests`` decoding requests none of which can draft (their
        cached prefix lacked the drafter's K/V, or they joined a load where drafting was not
        expected): the gate is not asked; the step counts towards ``relearn_steps``
        (``keeps_context``). Asked anyway, the gate chose to explore requests that could not
        draft: traced in-process on the demo pair at one request (MT-Bench, temperature 1),
        ~2300 explorations in 3072 steps, a full choice at nearly every step."""
        self._hold = None
        self._run_left = 0
        self._before_drafted = self._last_drafted
        self._last_drafted = False
        self._end_stay()
        # (made if new: a load never chosen at follows a neighbour's word, until it relearns)
        self._bucket(max(1, num_requests)).since_choice += 1

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

    def _hold_plain(self, request_ids: Sequence[str], b: LoadBucket, steps: int) -> list[int]:
        """Choose plain now and for up to ``steps`` more steps of the same requests (capped by
        ``max_hold``), re-deciding as soon as the requests change."""
        steps = min(self.max_hold, steps)
        self._hold = (steps, tuple(request_ids), b, False) if steps > 0 else None
        return []

    def _hold_drafting(self, request_ids: Sequence[str], b: LoadBucket, steps: int) -> list[int]:
        """Draft for every request now and for up to ``steps`` more steps of the same requests
        (capped by ``max_hold``)."""
        steps = min(self.max_hold, steps)
        self._hold = (steps, tuple(request_ids), b, True) if steps > 0 else None
        return list(range(len(request_ids)))

    def _explore_drafting(self, request_ids: Sequence[str], run: int | None = None) -> list[int]:
        """Start an exploration run of whole drafting steps (``run``; ``explore_run`` unless given)
        for these requests: it ends when they change (a newcomer would pay its whole prompt's
        catch-up, on the demo pair's waves of four requests ~10-20 ms a step against ~6 for a
        warm one)."""
        self._run_left = (self.explore_run if run is None else run) - 1
        self._run_ids = tuple(request_ids)
        return list(range(len(request_ids)))

    def _choose(
        self,
        request_ids: Sequence[str],
        regimes: Sequence[float] | None,
        whole: bool,
        remaining: Sequence[int] | None,
        able: Sequence[int] | None = None,
        catch_up_seconds: float = 0.0,
    ) -> list[int]:
        n = len(request_ids)
        everyone, nobody = list(range(n)), list[int]()
        self._steps += 1
        forecasts = self.forecasts
        if len(forecasts.own) > n or len(forecasts.drafted_at) > n or self._steps % 64 == 0:
            forecasts.keep_only(set(request_ids))  # requests that left take their forecasts along
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
        if b.plain_seconds.seed:  # a neighbour's plain time, scaled: one plain step measures it
            # (the cheapest lesson there is; served on the K=8 twin at four requests the seed
            # said 78 ms, four times a plain step's 31-34, and drafting was held on that belief)
            b.since_plain = 0
            return nobody
        switch = b.switch_seconds.value if b.switch_seconds.count else 0.0
        tokens = self.forecast_tokens(request_ids, regimes)
        # rates over whole loop iterations: the loop's time outside a step is paid per step, so
        # leaving it out would favour the short plain steps
        draft_s, plain_s = b.iteration(True), self.plain_iteration(n)
        draft_rate = tokens / draft_s
        plain_rate = n / plain_s
        # from plain steps, drafting also pays the switch once, over the stay it starts: as long
        # as stays at this load last, an exploration run's at least. Entering leaves out the
        # prompts' rows: a request that drafts pays them once, now or had it drafted before (an
        # exploration that ends pays them in vain: ``lost`` below keeps them)
        stay = max(float(self.explore_run), b.stay_steps.value if b.stay_steps.count else 0.0)
        entry_rate = draft_rate if self._last_drafted else tokens / (draft_s + b.entry_switch() / stay)
        # from plain steps, drafting must win by enter_margin: near break-even, the choice flips
        # on noise and each flip pays the switch
        bar = plain_rate * (self.stay_ratio if self._last_drafted else self.enter_margin)
        b.draft_ratio.update(draft_rate / plain_rate, RATIO_SMOOTHING)
        relearn, b.since_choice = b.since_choice >= self.relearn_steps, 0
        if relearn and able:  # the first choice since requests could draft here again: explore them
            b.since_explore = b.since_partial = 0
            return sorted(able)
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
        # plain is faster; exploring a run of drafting steps also pays the switch into it: at
        # least the catch-up of these requests' put-off rows (a bucket whose explorations were
        # partial ones, some requests unable to draft, never learnt a switch: at 16 requests on
        # the K=8 twin it priced one at 0 and explored every ~20 steps at ~0.4 s a time)
        loss_rate = max(0.0, 1.0 - draft_rate / plain_rate)
        lost = self.explore_run * draft_s * loss_rate + max(switch, catch_up_seconds)
        few = self.explore_size(n)
        b.since_partial += 1
        # a newcomer on a prior of few samples that might be far too low: learn it
        times, ratio = (draft_s, plain_s), draft_rate / plain_rate
        learn_run = 0 if few < n else self._newcomer_run(request_ids, regimes, remaining, times, ratio, lost)
        learn = learn_run > 0
        if whole and learn and b.since_explore >= self.explore_every:
            b.since_explore = b.since_partial = 0
            return self._explore_drafting(request_ids, learn_run)
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
            if learn and b.since_explore < self.explore_every:
                hold = min(hold, self.explore_every - b.since_explore - 1)
            return self._hold_plain(request_ids, b, hold)
        partial = max(0.0, b.partial_lost.value if b.partial_lost.count else lost * few / n)
        budget = self.partial_explore_overhead * odds
        partial_due = self.explore_interval(partial, plain_s, budget, self.forced_interval(partial, plain_s))
        if b.since_partial < partial_due:
            return self._hold_plain(request_ids, b, min(hold, partial_due - b.since_partial - 1))
        b.since_partial = 0
        # the requests known least: never drafted first (they stand on a prior), then the oldest
        drafted_at = self.forecasts.drafted_at
        order = sorted(everyone if able is None else able, key=lambda i: drafted_at.get(request_ids[i], -1))
        return sorted(order[:few])

    def _newcomer_run(
        self,
        request_ids: Sequence[str],
        regimes: Sequence[float] | None,
        remaining: Sequence[int] | None,
        seconds: tuple[float, float],
        rate_ratio: float,
        lost: float,
    ) -> int:
        """How many drafting steps to explore a request that never drafted for, while plain steps
        lead on its prior (0: none; ``rate_ratio``: the forecast drafting rate over plain steps'
        rate; ``seconds``: a drafting and a plain step's time; ``lost``: what an exploration run
        loses).

        Alone in its step, with fewer than ``MIN_REQUEST_MEANS`` requests of its regime gone
        before: until it leaves (at most its ``remaining`` tokens' steps), whatever its prior
        says. A prior of one or two requests stands for none: served cold on the demo pair (one
        request, HumanEval, temperature 0), the warm-up and the first request were the same
        prompt, the weakest of the 13 (1.9 tokens kept a drafting step where their mean was 3.9);
        on it drafting looked 2.5x slower than plain steps, explorations came once in ~1500
        steps, and dspark mode ran at 0.7x fixed mode's throughput. Whole lives, not a run of
        ``explore_run`` steps (session 38), because the first steps of a response are not its
        mean: on the same point the first prompt's requests kept 1-2 tokens a drafting step over
        their first 16 steps, where fixed mode ran 1.55x plain decoding's rate over the whole
        request (in-process), and runs of three steps, cold after plain ones, measured drafting
        steps at 3.3-4.1 ms against 2.3-2.6 warm. On three such runs no later newcomer was worth
        learning, and the gate drafted at 22% of the first 12 requests' steps (a scratch per-step
        trace).

        Alone with ``MIN_REQUEST_MEANS`` requests of its regime gone before: ``explore_run`` steps
        where the time those requests' acceptance would save, on average, over the tokens it may
        still emit, exceeds what exploring loses. Served cold on the K=8 twin at one request
        (code, temperature 0), the first requests kept 1-2 tokens a drafting step, and their
        prior held later ones on plain steps for 27% of the request-steps, though some kept 6.

        Else, for a caller that does not give the regimes and the tokens left (the engine always
        does, and a newcomer is explored whole only alone in its step, so since session 35 the
        engine never reaches this rule), with a prior of fewer than ``prior_samples`` drafting
        steps: ``explore_run`` steps where that prior, read generously, puts drafting near plain
        steps' rate: a prior of m steps may understate the traffic's tokens by a factor of up to
        1 + ``newcomer_upside`` / m. Served cold on the demo pair (one request, HumanEval,
        temperature 0), a drafting step took 6-7 plain steps' time for 2-4 tokens: exploring
        every newcomer until its prior stood on 20 steps cost ~9% of the first 12 requests."""
        forecasts, key = self.forecasts, self.bucket_of(len(request_ids))
        newcomers = [i for i, rid in enumerate(request_ids) if rid not in forecasts.drafted_at]
        if not newcomers:
            return 0
        if len(request_ids) == 1 and regimes is not None and remaining is not None:
            means = forecasts.request_means(regimes[0])
            if len(means) < MIN_REQUEST_MEANS:  # (a newcomer: its whole life)
                return max(self.explore_run, remaining[0])
            ratio = forecasts.realised_ratio(regimes[0], key)
            return self.explore_run if learning_saves(means, ratio, remaining[0], seconds) > lost else 0
        fewest: int | None = None
        for i in newcomers:
            if regimes is None:
                samples = self._buckets[key].tokens_per_request.count
            else:
                samples = forecasts.prior_samples(key, regimes[i])
            if samples < self.prior_samples:
                fewest = samples if fewest is None else min(fewest, samples)
        if fewest is None:
            return 0
        generous = rate_ratio * (1.0 + self.newcomer_upside / max(1, fewest))
        return self.explore_run if generous >= self.near_ratio else 0

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
        prompt_seconds: float = 0.0,
    ) -> None:
        """A finished step: its requests (the drafting ones, for a drafting step), whether it
        drafted, the tokens each request emitted (or, better, the plan's calibrated expectation
        of them: far less noisy than one draw), its time (the decoding share of it, without the
        catch-up) and, for a drafting step, the catch-up of the context writes earlier plain
        steps put off. ``num_requests``: the step's decoding requests, when only some drafted
        (a partial exploration; the others emitted one token each). ``kept``: the tokens each
        request did emit, when ``tokens`` are expectations (with ``regimes``: it corrects the
        expectations' bias per regime; without it, ``tokens`` are what was emitted).
        ``prompt_seconds``: of the catch-up, writing prompts' context rows."""
        if seconds <= 0 or not math.isfinite(seconds) or not request_ids:
            return
        load = len(request_ids) if num_requests is None else max(num_requests, len(request_ids))
        if not drafted:
            self.record_plain(load, seconds)
            return
        self._hold = None  # forecasts move: the next choice is made in full
        after_plain = self._before_drafted is False
        self._learn_drafting(
            request_ids, tokens, seconds, switch_seconds, prompt_seconds, load, regimes, kept, after_plain
        )
