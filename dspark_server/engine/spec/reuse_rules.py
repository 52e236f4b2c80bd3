"""What the draft gate says of a load a new request joins: whether that request keeps the
drafter's context (its plain steps keep features; else it never drafts), and whether a cached
prompt whose drafter K/V were never written is prefilled again for it (the design and the
measurements behind each rule: docs/draft-gate.md). ``DraftGate`` (draft_gate.py) makes the
step's choice; these rules read what its choices left in the load buckets.
"""

from __future__ import annotations

from collections.abc import Sequence

from dspark_server.engine.spec.gate_estimates import LoadBucket, MovingMean, newcomer_ratio, regime_key
from dspark_server.engine.spec.gate_memory import GateMemory

# full choices at a load before its averaged ratio may say drafting is not expected there: served
# cold on the demo pair at one request (HumanEval, temperature 0), the warm-up's two cold drafting
# steps put the ratio at 0.75 and the first choices at 0.67, and every request admitted after
# them (never able to draft) kept it there for most of the first 12 requests (a scratch trace)
MIN_RATIO_CHOICES = 16
# how fast a regime's share of drafting choices at a load follows them (``drafts_at``), and the
# full choices, and the share of them, before a cached prompt is prefilled again for drafting
SHARE_SMOOTHING = 0.1
MIN_SHARE_CHOICES = 8
PREFILL_SHARE = 0.5
# full choices at a load after which its averaged ratio must reach ``near_ratio`` rather than
# ``reuse_ratio`` for requests joining it to expect drafting (``ReuseRules._drafting_pays``)
SETTLED_CHOICES = 64


class ReuseRules(GateMemory):
    # set by ``DraftGate``: below this forecast ratio of drafting's rate to plain steps', a
    # request joining the load does not expect to draft; after this many steps at a load where no
    # request could draft, requests joining it keep the drafter's context again
    reuse_ratio: float
    relearn_steps: int
    near_ratio: float

    def record_share(self, num_requests: int, regimes: Sequence[float], drafted: bool) -> None:
        """A full choice at a load of ``num_requests`` (its requests' sampling ``regimes``):
        whether it drafted for every request, in each regime's share (``drafts_at``)."""
        b = self._buckets.get(self.bucket_of(num_requests))
        if b is None:
            return
        x = 1.0 if drafted else 0.0
        for key in {regime_key(r) for r in set(regimes)}:
            b.drafted_share.setdefault(key, MovingMean()).update(x, SHARE_SMOOTHING)

    def expects_drafting(self, num_requests: int) -> bool:
        """Whether a request that joins a load of ``num_requests`` decoding requests may well
        draft: drafting's forecast rate there, averaged over the full choices (it moves by
        ``draft_gate.RATIO_SMOOTHING`` a choice), or a newcomer's forecast on the load's prior now
        (``newcomer_ratio``, once the prior holds a drafting step of the load's own), is at
        least ``reuse_ratio`` of plain steps'. At a load not yet chosen ``MIN_RATIO_CHOICES``
        times, what the nearest load that has been says (the larger of two as near), and True
        where none has.

        An average, not the latest choice: served on the demo pair at four requests (HumanEval,
        temperature 0), the choices flipped while the gate learned (drafting at 0.73-1.5x plain
        steps' rate), and a request admitted at a plain one reused a prompt without the
        drafter's K/V and never drafted, in every drafting step after. The newcomer's forecast
        beside it: served cold on the demo pair at one request (HumanEval, temperature 0), the
        first three requests (explored over their weakest, first steps) held the average under
        the bar, and when the fourth drafted for 25 steps (4.6 tokens a step, 1.5x plain steps'
        rate) the average, which moves only at full choices, still stood under it: the next
        three requests were admitted unable to draft (a scratch per-step trace). A requirement
        of ``prior_samples`` drafting steps instead held the loads at 8-31 requests, whose
        priors a neighbour seeded and that never draft, on keeping features: in-process at 16
        requests (MT-Bench, temperature 1) 0.80x off against 1.00x.

        The nearest chosen load's word at a load seldom chosen at, rather than True: such a load
        is most often one a wave of requests passes through. Served on the demo pair at 16 and
        64 requests (HumanEval, temperature 0; bench_serving sends a round's first requests at
        once, and the engine admits them over a few steps), 44 of 49 and 110 of 129 requests a
        round kept the drafter's features, admitted at loads of 1-63 before the wave was in,
        though drafting was not expected at the load they then decoded at; with the nearest
        load's word, 5 of 49 and 13 of 129 (scratch traces of admissions)."""
        b = self._chosen_bucket(num_requests)
        return b is None or self._drafting_pays(b)

    def _chosen_bucket(self, num_requests: int) -> LoadBucket | None:
        """The load bucket of ``num_requests`` once chosen at ``MIN_RATIO_CHOICES`` times, else
        the nearest that has been (None: none has)."""
        key = self.bucket_of(max(1, num_requests))
        b = self._buckets.get(key)
        if b is not None and b.draft_ratio.count >= MIN_RATIO_CHOICES:
            return b
        chosen = [k for k, w in self._buckets.items() if w.draft_ratio.count >= MIN_RATIO_CHOICES]
        if not chosen:
            return None
        return self._buckets[min(chosen, key=lambda k: (abs(k - key), -k))]

    def drafts_at(self, num_requests: int, regime: float) -> bool:
        """Whether the gate drafts at a load of ``num_requests`` decoding requests for requests of
        this sampling ``regime`` (temperature): ``MIN_RATIO_CHOICES`` full choices there,
        drafting expected (``expects_drafting``), and of the last full choices the regime's
        requests took part in (at least ``MIN_SHARE_CHOICES``), ``PREFILL_SHARE`` or more drafted
        for every request. What a cached prompt whose drafter K/V were never written is
        prefilled again for (``SpeculativeDecoder.prefix_needs_context``).

        A load the gate has seldom chosen at is most often one a wave of requests passes
        through. Served on the demo pair at 16 requests (HumanEval, temperature 0; bench_serving
        sends each round's first 16 at once and the engine admits them over a few steps), the
        wave's first requests joined loads of 1-7, where drafting was expected for want of
        choices, and prefilled again ~960 prompt tokens a round that off mode took from the
        cache (1362-1378 against 402), with the engine's summed step time 12-16% above off's.

        The regime's share of drafting choices, not the load's forecast alone: a request that
        prefills again and never drafts leaves its pages without the drafter's K/V as before
        (plain steps put the writes off, and they are dropped when it leaves), and the next
        round prefills them again. In session 39's first sweep on the demo pair (four modes
        interleaved, the temperature-1 points after the temperature-0 ones), dspark mode
        prefilled 2.6-11.6x off mode's prompt tokens in 9 of the 16 rounds from four requests
        up, where the gate drafted at no more than 0.03 verified drafts per request-step
        (HumanEval at 128 requests: 18162 and 17058 prompt tokens a round against 6898 and
        1474; `/metrics` before and after each round)."""
        b = self._buckets.get(self.bucket_of(max(1, num_requests)))
        if b is None or b.draft_ratio.count < MIN_RATIO_CHOICES or not self._drafting_pays(b):
            return False
        share = b.drafted_share.get(regime_key(regime))
        return share is not None and share.count >= MIN_SHARE_CHOICES and share.value >= PREFILL_SHARE

    def _drafting_pays(self, b: LoadBucket) -> bool:
        """The load's averaged ratio, or a newcomer's forecast on its prior, at ``reuse_ratio`` or
        more (``expects_drafting`` once the load has its choices); the average, once settled
        over ``SETTLED_CHOICES`` choices, at ``near_ratio`` or more. While the gate learns a
        load, its average moves with cold first steps, and the lower bar keeps newcomers able to
        draft (the one-request trace in ``expects_drafting``); settled between the two bars, it
        kept the drafter's features for requests the gate, which enters drafting at
        ``enter_margin``, never drafted for (capturing a plain step's features cost ~9% of its
        time at 64-128 requests on the demo pair: a scratch per-step profile). Served on the
        demo pair side by side with the rule before (HumanEval, temperature 0, the points at 1,
        4, 16, 64 and 128 requests in turn, three rounds each, off mode beside; session 40):
        dspark / off 0.93, 1.04, 1.03 at 128 requests against 0.84, 0.91, 0.82; 0.76, 1.11,
        0.85 at 64 against 0.74, 0.83, 0.76; 1.11-1.16 at four against 1.01-1.14; one request
        1.15-1.27 against 1.05-1.29. The bar at ``near_ratio`` for every load, learnt or not,
        cost one request 8-17% (1.09 and 1.16 of off against 1.32 and 1.26, beside the code of
        the time, a54ff0b): the first requests were admitted unable to draft while the gate
        learned."""
        bar = self.near_ratio if b.draft_ratio.count >= SETTLED_CHOICES else self.reuse_ratio
        if b.draft_ratio.value >= bar:
            return True
        # (a prior seeded from a neighbouring load, whose count a seed sets, is no evidence)
        return b.tokens_per_request.count > self.min_samples and newcomer_ratio(b) >= bar

    def keeps_context(self, num_requests: int) -> bool:
        """Whether requests at a load of ``num_requests`` keep the drafter's context (their
        plain steps keep features; else they never draft): where drafting is expected, and,
        where it is not, once no request could draft there for ``relearn_steps`` steps
        (``skip``). No choice moves the load's ratio while nobody can draft, so without it a
        ratio that fell below the bar while the gate learned would hold for good. A request
        admitted then keeps its context only if its prompt was not cached without it (a cached
        prompt is reused, not prefilled again: at 16 requests on the demo pair, in-process,
        prefilling them again cost ~4.5% of the time); the first choice it takes part in
        explores it (``able``)."""
        if self.expects_drafting(num_requests):
            return True
        b = self._buckets.get(self.bucket_of(max(1, num_requests)))
        return b is not None and b.since_choice >= self.relearn_steps
