"""THE speculative step: draft -> plan -> verify (one ragged target forward) -> keep accepted.

``SpeculativeDecoder.step`` returns a ``SpecStepResult`` — the tokens each decoding request
emits, its round's (drafted, verified, accepted), the forward — and the engine commits it; the
decoder never sees the engine. After the commit the engine hands back what the commit kept and
how long the step took (``record``), which the draft gate and the step-overhead estimate learn
from.

Invariants between rounds, for every decoding request with ``n = num_tokens``:
  * the target's KV cache holds positions 0..n-2; the anchor x0 = all_ids[-1] sits at n-1;
  * the drafter's context K/V (same slots) hold the projected target features of 0..n-2.
A round verifies [x0, x1..xℓ] at positions n-1..n-1+ℓ, keeps the target K/V and drafter context
of x0..x_acc, and truncates the rest, which restores both invariants for the new anchor.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from dspark_server.engine.kv_cache import PageAllocator
from dspark_server.engine.model_runner import ForwardResult, ModelRunner, inference_mode
from dspark_server.engine.request import Request
from dspark_server.engine.sampling import SamplingCache, SamplingTensors
from dspark_server.engine.scheduler import ScheduledChunk
from dspark_server.engine.spec.context_writes import ContextWrites
from dspark_server.engine.spec.deferred_context import Run
from dspark_server.engine.spec.draft_gate import DraftGate
from dspark_server.engine.spec.drafting import Drafts, merge_drafts, sample_drafts
from dspark_server.engine.spec.held_lessons import BATCH, HeldLessons, PlainStep
from dspark_server.engine.spec.lookup import PromptLookup
from dspark_server.engine.spec.rounds import RoundRecord
from dspark_server.engine.spec.sps_refresh import PlanningTable
from dspark_server.engine.spec.step_lessons import DraftingLesson, teach
from dspark_server.engine.spec.step_overhead import StepOverhead
from dspark_server.engine.spec.verify import VerifyOutcome
from dspark_server.engine.spec.verify_forward import verify_forward
from dspark_server.models.attention import KVPool
from dspark_server.models.drafter import DraftBlock, DraftContext, DSparkDrafter
from dspark_server.planner import (
    CalibrationDriftTracker,
    CalibrationSet,
    LiveSpsTable,
    OnlineCalibration,
    OnlineCalibrationConfig,
    StsCalibration,
    VerifyPlanner,
    cap_lengths,
    conditionals,
)

# of the plain steps that keep no features (nobody in them can draft), one in this many is
# filed as a lesson: the rest would only add samples of the same plain step time, and filing
# every one cost ~1% of a plain step at one request (demo pair, temperature 1, in-process)
QUIET_SAMPLE = 4


@dataclass(frozen=True)
class RequestTokens:
    """What one decoding request emits this step: accepted drafts + the corrected/bonus token."""

    request: Request
    tokens: list[int]
    spec_round: tuple[int, int, int]  # (drafted, verified, accepted)


@dataclass(frozen=True)
class SpecStepResult:
    decodes: list[RequestTokens]
    forward: ForwardResult
    prefill_rows: list[int]  # logits row of each completing prefill chunk's last token, in order
    draft_seconds: float
    prefill_tokens: int
    predicted_seconds: float | None = None  # the cost model's price of this step (dspark mode)
    # per request, 1 + the calibrated survival summed over its verified positions: the tokens
    # the plan expects it to emit (dspark mode; a far less noisy forecast than the tokens kept)
    expected_tokens: list[float] | None = None
    # writing the drafter context earlier plain steps put off (part of draft_seconds): the
    # switch from plain steps to drafting, not what a drafting step costs in a run of them
    catch_up_seconds: float = 0.0
    # of it, the prompts' rows: what drafting costs a request once, when it first drafts (a
    # drafting step writes its prefill chunks' rows too)
    prompt_writes_seconds: float = 0.0
    # the requests that took a plain token in this step (the gate explored drafting for a few)
    # and each one's logits row, for the engine's sampler
    plain: list[Request] = field(default_factory=list)
    plain_rows: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class _Plan:
    lens: list[int]
    survival: np.ndarray | None  # [R, γ] float64: the calibrated prefix survival the plan used
    predicted_seconds: float | None = None  # τ / Θ of the chosen plan, when priced by a table
    file_survival: np.ndarray | None = None  # [R, γ] the calibration file's, before online correction

    def confidences(self) -> torch.Tensor | None:
        """[R, γ] the calibrated per-position confidences (a_k / a_{k-1}), for the records."""
        return None if self.survival is None else conditionals(torch.from_numpy(self.survival).float())

    def expected_tokens(self) -> list[float] | None:
        """Per request, 1 + the survival summed over its verified positions."""
        if self.survival is None:
            return None
        admitted = np.arange(self.survival.shape[1])[None, :] < np.asarray(self.lens)[:, None]
        return (1.0 + (self.survival * admitted).sum(axis=1)).tolist()


@dataclass(frozen=True)
class _Sources:
    """Who drafts for each request this step: the prompt lookup (its rows) or the drafter."""

    proposals: list[list[int]]  # every request's lookup proposal ([]: none)
    lookup_rows: list[int]
    drafter_rows: list[int]


class SpeculativeDecoder:
    def __init__(
        self,
        drafter: DSparkDrafter,
        pool: KVPool,
        planner: VerifyPlanner,
        calibration: StsCalibration | CalibrationSet,
        live_sps: LiveSpsTable | None,
        drift: CalibrationDriftTracker,
        gamma: int,
        gate: DraftGate | None = None,
        overhead: StepOverhead | None = None,
        greedy_calibration: StsCalibration | CalibrationSet | None = None,
        lookup: PromptLookup | None = None,
        online_calibration: OnlineCalibrationConfig | None = None,
    ) -> None:
        if not 1 <= gamma <= drafter.gamma:
            raise ValueError(f"gamma must be in 1..{drafter.gamma} (the drafter's block size), got {gamma}")
        self.drafter = drafter
        self.pool = pool
        self.planner = planner
        # Acceptance depends on the sampling regime (argmax agreement at temperature 0): each row
        # is calibrated by the regime of its temperature (planner/calibration.py); a greedy file
        # overrides the greedy regime. The STS views below are for records only.
        greedy = None if greedy_calibration is None else CalibrationSet.coerce(greedy_calibration, 0.0)
        self.calibrations = CalibrationSet.coerce(calibration, 1.0).with_greedy(greedy).truncated(gamma)
        self.calibration = self.calibrations.nearest(1.0).sts()
        self.greedy_calibration = self.calibrations.nearest(0.0).sts()
        # the file corrected by the rounds this decoder verifies (None: the file as it is)
        self.online = (
            None
            if online_calibration is None
            else OnlineCalibration(gamma, self.calibrations.sampling_temperatures, online_calibration)
        )
        self.live_sps = live_sps
        self.drift = drift
        self.gamma = gamma
        self.gate = gate  # None: always draft (the fixed / threshold baselines)
        self.context = ContextWrites(drafter, pool)
        self.deferred = self.context.deferred  # drafter-context writes put off by plain steps
        self.overhead = overhead  # None: price steps by SPS(B) alone, as the method doc does
        self.lookup = lookup  # None: the drafter drafts for every request
        self.planning_table = PlanningTable(planner, live_sps, roofline=overhead is not None)
        self.last_verify_lens: list[int] = []  # the last drafting step's, per decoding request
        self.lessons = HeldLessons()  # held steps' lessons (and plain steps' rows) waiting to be filed
        self._catch_up_due = False  # filed rows reached the backlog's bound: catch up at the next step
        self._file_at = 1  # plain steps waiting that make a batch (set at each filing)
        self._sampling = SamplingCache()
        self._quiet_steps = 0  # plain steps that kept no features (``after_plain``)
        # Called once per step with every decoding request's round (calibration, evaluation).
        self.round_observers: list[Callable[[RoundRecord], None]] = []

    def drafting(self, decodes: list[Request], room: int | None = None) -> list[Request]:
        """The decoding requests that draft this step (the draft gate's choice; all of them,
        without a gate). Asked once per step: none sends the step down the engine's plain path,
        then ``after_plain``; the others go to ``step`` as its plain decodes. ``room``: the draft
        tokens the step's budget leaves (at most that many requests can draft)."""
        gate = self.gate
        if not decodes or gate is None:
            return [r for r in decodes if not r.context_gap]
        able = [i for i, r in enumerate(decodes) if not r.context_gap]
        if not able:  # nobody can draft: the gate is not asked
            gate.skip(len(decodes))
            return []
        ids = tuple([r.request_id for r in decodes])
        if gate.holds(ids):  # a held choice reads no estimate: no lessons, no regimes
            chosen = gate.choose(ids)
        else:
            if self.lessons:
                self.file_lessons()  # the choice reads them
            regimes = [r.params.temperature for r in decodes]
            remaining = [r.params.max_tokens - len(r.output_ids) for r in decodes]
            catch_up = self.context.pending_seconds(decodes)
            chosen = gate.choose(
                ids, regimes, room, remaining, able if len(able) < len(decodes) else None, catch_up
            )
        # a request whose cached prefix lacks the drafter's K/V cannot draft
        return [decodes[i] for i in chosen if not decodes[i].context_gap] if chosen else []

    def prefix_needs_context(self, load: int, request: Request) -> bool:
        """Whether ``request``, joining ``load`` decoding requests, should reuse only cached pages
        that hold the drafter's K/V: yes where every step drafts (no gate) or the gate has found
        drafting worth it at that load for requests of its sampling regime
        (``DraftGate.drafts_at``); where it has not, a prefill saved is worth more than drafting
        later. Served on the demo pair (MT-Bench, temperature 0, 16 requests after a point at 4),
        the gate's latest choice, which was the rule before, had drafted at 4 requests: each new
        point's first wave prefilled again the prompts the cache held, and time to the first
        token was 32-45 ms against off mode's 17-20."""
        return self.gate is None or self.gate.drafts_at(load, request.params.temperature)

    def keeps_features(self, load: int) -> bool:
        """Whether plain steps at ``load`` keep the drafter's features for requests that can
        draft (``DraftGate.keeps_context``); where they do not, the prompts prefilled there are
        marked ``context_gap`` (running requests keep what they were admitted with). Always,
        without a gate."""
        return self.gate is None or self.gate.keeps_context(load)

    def file_lessons(self, alloc: PageAllocator | None = None) -> None:
        """File the held steps' waiting lessons and put-off rows (``HeldLessons``); where those
        rows fill the drafter-context backlog, it is caught up now (with ``alloc``), else at the
        next plain step."""
        if self.lessons.replay(self.gate, self.overhead, self.live_sps, self.deferred):
            self._catch_up_due = True
        if self._catch_up_due and alloc is not None:
            self._catch_up_due = False
            self.context.catch_up(alloc)
        # plain steps wait to be filed in batches, never past the backlog's bound of steps
        deferred = self.deferred
        self._file_at = max(1, min(BATCH, deferred.max_steps - len(deferred)))

    def after_plain(
        self,
        alloc: PageAllocator,
        decodes: list[Request],
        positions: list[int],
        prefills: list[ScheduledChunk],
        forward: ForwardResult,
        step_seconds: float,
    ) -> None:
        """After a plain step (its forward captured the features): its drafter-context writes,
        the decodes' and the prefill chunks', are put off (``deferred``), so that a plain step in
        dspark mode costs what a plain step costs, and what it teaches waits with them; both are
        filed in one go (``HeldLessons``) before anything reads them."""
        hidden = forward.output.hidden  # None: the step kept no features (its requests never draft)
        if hidden is None and not prefills:
            # nothing to put off, and no request here can draft: the lesson is one more sample of
            # a plain step's time, and one in QUIET_SAMPLE such steps is filed
            self._quiet_steps += 1
            if self._quiet_steps % QUIET_SAMPLE:
                return
        lessons = self.lessons
        lessons.plain.append(
            PlainStep(
                decodes,
                positions,
                prefills,
                hidden,
                forward.seconds,
                forward.batch.num_tokens,
                sum(c.num_tokens for c in prefills) if prefills else 0,
                step_seconds if decodes else None,
            )
        )
        if len(lessons.plain) >= self._file_at or self._catch_up_due:
            self.file_lessons(alloc)

    @inference_mode
    def step(
        self,
        runner: ModelRunner,
        decodes: list[Request],
        prefills: list[ScheduledChunk],
        max_draft_tokens: int | None = None,
        plain: Sequence[Request] = (),
    ) -> SpecStepResult:
        """One drafting step for the decoding requests ``decodes`` (with the step's ``plain``
        decodes, which take one plain token each, and its prefill chunks, in the same forward);
        the engine asked ``drafting`` first, a step where nobody drafts is its plain step.
        ``max_draft_tokens`` caps Σℓ: the tokens of the step's budget prefill left."""
        if not decodes:
            raise ValueError("a speculative step needs decoding requests (else it is a plain step)")
        t_start = time.perf_counter()
        if self.lessons.has_plain() or self._catch_up_due:  # a held drafting step's lessons may wait on
            self.file_lessons(runner.allocator)
        plain = list(plain)
        sampling = self._sampling.get([r.params for r in decodes])
        prefill_tokens = sum(c.num_tokens for c in prefills)
        anchor_pos = [r.num_computed for r in decodes]
        plain_runs = [Run(r, r.num_computed) for r in plain]
        t_writes = time.perf_counter()
        prompt_share = self.context.catch_up(runner.allocator, only=decodes if plain else None)
        t_caught_up = time.perf_counter()
        catch_up_s = t_caught_up - t_start
        prompt_writes_s = (t_caught_up - t_writes) * prompt_share
        sources = self._sources(decodes)
        drafts = self._draft(runner.allocator, decodes, anchor_pos, sampling, sources)
        draft_s = time.perf_counter() - t_start
        plan = self._plan(
            decodes,
            drafts,
            sampling,
            draft_s,
            max_draft_tokens,
            prefill_tokens + len(plain),
            sources.lookup_rows,
        )
        self.last_verify_lens = plan.lens + [0] * len(plain)
        capture = self.drafter.capture_layers
        verified = verify_forward(runner, decodes, plain, prefills, drafts, plan.lens, sampling, capture)
        forward, outcome = verified.forward, verified.outcome
        if self.live_sps is not None and not prefills and not plain:  # they would skew the curve
            self.live_sps.record(forward.batch.num_tokens, forward.seconds)
        self._observe(decodes, drafts, plan, outcome, sources.drafter_rows)
        if self.lookup is not None:
            chosen = set(sources.lookup_rows)
            for i, req in enumerate(decodes):
                emitted = drafts.tokens[i, : outcome.accepted[i]].tolist() + [outcome.next_tokens[i]]
                self.lookup.record(req, i in chosen, sources.proposals[i], emitted, plan.lens[i])
        self.context.keep_accepted(
            runner.allocator, decodes, anchor_pos, outcome.accepted, plain_runs, prefills, forward
        )
        emitted = [
            RequestTokens(
                req,
                drafts.tokens[i, :acc].tolist() + [nxt] if acc else [nxt],
                (self.gamma, plan.lens[i], acc),
            )
            for i, (req, acc, nxt) in enumerate(
                zip(decodes, outcome.accepted, outcome.next_tokens, strict=True)
            )
        ]
        expected = plan.expected_tokens()
        return SpecStepResult(
            emitted,
            forward,
            verified.prefill_rows,
            draft_s,
            prefill_tokens,
            plan.predicted_seconds,
            expected,
            catch_up_s,
            prompt_writes_s,
            plain,
            verified.plain_rows,
        )

    def record(self, result: SpecStepResult, kept: Sequence[int], step_seconds: float) -> None:
        """After the engine committed ``result`` (``kept``: the tokens each request kept): teach
        the gate and the overhead estimate, or, while the gate holds drafting for these
        requests, file the lesson with the next full choice (``HeldLessons``)."""
        if self.gate is None and self.overhead is None:  # fixed / threshold: nobody learns
            return
        forecast = kept if result.expected_tokens is None else result.expected_tokens
        # the catch-up is the price of switching from plain steps: priced as the steady cost of
        # drafting, it would keep the gate on plain steps, whose put-off writes grow the next one
        catch_up = result.catch_up_seconds
        requests = [d.request for d in result.decodes]
        ids = [r.request_id for r in requests]
        lesson = DraftingLesson(
            ids,
            [r.params.temperature for r in requests],
            forecast,
            result.forward.seconds,
            result.forward.batch.num_tokens,
            result.prefill_tokens,
            result.draft_seconds - catch_up,
            step_seconds - catch_up,
            catch_up,
            len(result.decodes) + len(result.plain),
            kept if result.expected_tokens is not None else None,
            result.prompt_writes_seconds,
        )
        if self.gate is not None and self.gate.holds(ids):
            self.lessons.drafts.append(lesson)
            if self.lessons.full():
                self.file_lessons()
            return
        if self.lessons:
            self.file_lessons()
        teach(self.gate, self.overhead, lesson)

    def record_outside(self, num_decodes: int, drafted: bool, seconds: float) -> None:
        """The engine loop's time between a step with ``num_decodes`` decoding requests (a
        drafting one or not) and the next step: a cost every step pays once."""
        if self.gate is not None and not drafted:
            self.lessons.outside.append((num_decodes, seconds))  # filed with the plain steps'
        elif self.gate is not None:
            self.gate.record_outside(num_decodes, drafted, seconds)
        if self.overhead is not None and drafted:
            self.overhead.record_outside(num_decodes, seconds)

    # ---- phases ----------------------------------------------------------------------------

    def _sources(self, decodes: list[Request]) -> _Sources:
        """Every request's prompt-lookup proposal, and which rows the lookup drafts for."""
        lookup = self.lookup
        if lookup is None:
            return _Sources([[] for _ in decodes], [], list(range(len(decodes))))
        proposals = [lookup.propose(r) for r in decodes]
        chosen = [bool(p) and lookup.prefers(r) for r, p in zip(decodes, proposals, strict=True)]
        rows = range(len(decodes))
        return _Sources(proposals, [i for i in rows if chosen[i]], [i for i in rows if not chosen[i]])

    def _draft(
        self,
        alloc: PageAllocator,
        decodes: list[Request],
        anchor_pos: list[int],
        sampling: SamplingTensors,
        sources: _Sources,
    ) -> Drafts:
        """The drafter's block for the requests the prompt lookup does not draft for, merged
        with the lookup's proposals for the others."""
        if not sources.lookup_rows:
            return self._draft_block(alloc, decodes, anchor_pos, sampling)
        rows, lookup_rows = sources.drafter_rows, sources.lookup_rows
        drafted = None
        if rows:
            sub = SamplingTensors.from_params([decodes[i].params for i in rows])
            drafted = self._draft_block(alloc, [decodes[i] for i in rows], [anchor_pos[i] for i in rows], sub)
        return merge_drafts(
            len(decodes),
            rows,
            drafted,
            lookup_rows,
            [sources.proposals[i] for i in lookup_rows],
            self.gamma,
            self.drafter.config.vocab_size,
            not sampling.all_greedy,
            self.drafter.confidence_head is not None,
        )

    def _draft_block(
        self, alloc: PageAllocator, decodes: list[Request], anchor_pos: list[int], sampling: SamplingTensors
    ) -> Drafts:
        """One backbone pass for these decoding requests, then the sequential head."""
        anchors = torch.tensor([r.last_token_id for r in decodes])
        lens = np.asarray(anchor_pos, dtype=np.int64)
        ctx = DraftContext(
            torch.from_numpy(alloc.slot_matrix([r.table for r in decodes], lens)), torch.from_numpy(lens)
        )
        block = self.drafter.backbone(anchors, torch.tensor(anchor_pos), ctx, self.pool)
        return self.sample_drafts(decodes, block, anchors, sampling, [r.generator for r in decodes])

    def sample_drafts(
        self,
        decodes: list[Request],
        block: DraftBlock,
        anchors: torch.Tensor,
        sampling: SamplingTensors,
        generators: Sequence[torch.Generator],
    ) -> Drafts:
        keys = [r.noise_key for r in decodes]
        return sample_drafts(self.drafter, self.gamma, block, anchors, sampling, generators, keys)

    def _plan(
        self,
        decodes: list[Request],
        drafts: Drafts,
        sampling: SamplingTensors,
        draft_s: float,
        max_draft_tokens: int | None,
        prefill_tokens: int,
        lookup_rows: Sequence[int] = (),
    ) -> _Plan:
        """ℓ_r from calibrated confidences (never from the drafted tokens' values), capped by
        the tokens a request may still emit and the step's budget (lengths only)."""
        survival = file_survival = None
        predicted: float | None = None
        if drafts.confidence_logits is not None:
            file_survival = self.calibrated_survival(drafts.confidence_logits, sampling.temperature)
            survival = file_survival
            if self.online is not None:
                survival = self.online.correct(file_survival, sampling.temperature.numpy())
            if lookup_rows:  # priced by the lookup's own acceptance, not the drafter's head
                assert self.lookup is not None
                lookup = self.lookup.confidences([self.gamma] * len(lookup_rows)).to(torch.float64)
                survival[list(lookup_rows)] = np.cumprod(lookup.numpy(), axis=1)
            self.planning_table.refresh()
            if self.overhead is not None:
                self.planner.set_step_overhead(self.overhead.overhead(len(decodes), draft_s))
            planned = self.planner.plan_survival(
                survival, max_draft_tokens=max_draft_tokens, extra_batch_tokens=prefill_tokens
            )
            lens = planned.verify_lens.tolist()
            theta = planned.expected_throughput
            if math.isfinite(theta) and theta > 0:
                predicted = planned.expected_tokens / theta
        else:
            lens = [self.gamma] * len(decodes)
        lens = [
            max(0, min(ell, r.params.max_tokens - len(r.output_ids) - 1))
            for ell, r in zip(lens, decodes, strict=True)
        ]
        if survival is None and max_draft_tokens is not None:
            lens = cap_lengths(np.asarray(lens), max_draft_tokens).tolist()
        return _Plan(lens, survival, predicted, file_survival)

    def _observe(
        self, decodes: list[Request], drafts: Drafts, plan: _Plan, outcome: VerifyOutcome, rows: list[int]
    ) -> None:
        """The drafter's rounds (``rows``; not the prompt lookup's) to the calibration drift
        tracker and the round observers."""
        if not rows:
            return
        accepted, lens = [outcome.accepted[i] for i in rows], [plan.lens[i] for i in rows]
        if plan.survival is not None:
            self.drift.record_arrays(plan.survival[rows], np.asarray(accepted), np.asarray(lens))
        if self.online is not None and plan.file_survival is not None:
            temps = np.array([decodes[i].params.temperature for i in rows], dtype=np.float64)
            self.online.record(plan.file_survival[rows], temps, np.asarray(accepted), np.asarray(lens))
        if self.round_observers:
            at = torch.tensor(rows, dtype=torch.long)
            logits = drafts.confidence_logits[at] if drafts.confidence_logits is not None else None
            all_confidences = plan.confidences()
            confidences = all_confidences[at] if all_confidences is not None else None
            record = RoundRecord([decodes[i] for i in rows], logits, confidences, lens, accepted)
            for observe in self.round_observers:
                observe(record)

    # ---- calibration and cost table ----------------------------------------------------------

    def calibrated_survival(self, confidence_logits: torch.Tensor, temperatures: torch.Tensor) -> np.ndarray:
        """Raw confidence logits [R, γ], sampling temperatures [R] -> the calibrated prefix
        survival [R, γ] (float64) the planner plans on."""
        return self.calibrations.survival_array(
            confidence_logits.detach().to(torch.float64).numpy(), temperatures.to(torch.float64).numpy()
        )

    def calibrate(self, confidence_logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
        """Raw confidence logits [R, γ], sampling temperatures [R] -> calibrated confidences."""
        return conditionals(
            torch.from_numpy(self.calibrated_survival(confidence_logits, temperatures)).float()
        )
