"""THE speculative step: draft -> plan -> verify (one ragged target forward) -> commit.

Invariants between rounds, for every decoding request with ``n = num_tokens``:
  * the target's KV cache holds positions 0..n-2; the anchor x0 = all_ids[-1] sits at n-1;
  * the drafter's context K/V (same slots) hold the projected target features of 0..n-2.
A round verifies [x0, x1..xℓ] at positions n-1..n-1+ℓ, keeps the target K/V and drafter context
of x0..x_acc, and truncates the rest, which restores both invariants for the new anchor.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dspark_server.engine.batch import SeqChunk
from dspark_server.engine.draft_gate import DraftGate
from dspark_server.engine.kv_cache import PageAllocator, PageTable
from dspark_server.engine.request import Request
from dspark_server.engine.sampling import SamplingTensors, sample, sample_from_logits, shape_probs
from dspark_server.engine.scheduler import ScheduledChunk
from dspark_server.engine.step_overhead import StepOverhead
from dspark_server.engine.verify import verify, verify_greedy
from dspark_server.models.attention import KVPool
from dspark_server.models.drafter import DraftBlock, DraftContext, DSparkDrafter
from dspark_server.planner import (
    CalibrationDriftTracker,
    LiveSpsTable,
    SpsCostTable,
    StsCalibration,
    VerifyPlanner,
    fit_roofline,
    monotone_envelope,
)

if TYPE_CHECKING:
    from dspark_server.engine.engine import LLMEngine


@dataclass(frozen=True)
class Drafts:
    tokens: torch.Tensor  # [R, γ]
    probs: torch.Tensor | None  # [R, γ, V] q each draft was sampled from (None: all greedy)
    confidence_logits: torch.Tensor | None  # [R, γ] raw, before STS


@dataclass(frozen=True)
class RoundRecord:
    """One step's speculative rounds, as calibration and evaluation need them."""

    requests: list[Request]
    confidence_logits: torch.Tensor | None  # [R, γ] raw, before STS
    confidences: torch.Tensor | None  # [R, γ] calibrated, as the planner saw them
    verify_lens: list[int]
    accepted: list[int]


class SpeculativeDecoder:
    def __init__(
        self,
        drafter: DSparkDrafter,
        pool: KVPool,
        planner: VerifyPlanner,
        calibration: StsCalibration,
        live_sps: LiveSpsTable | None,
        drift: CalibrationDriftTracker,
        gamma: int,
        gate: DraftGate | None = None,
        overhead: StepOverhead | None = None,
        greedy_calibration: StsCalibration | None = None,
    ) -> None:
        if not 1 <= gamma <= drafter.gamma:
            raise ValueError(f"gamma must be in 1..{drafter.gamma} (the drafter's block size), got {gamma}")
        for cal in (calibration, greedy_calibration or calibration):
            if cal.gamma < gamma:
                raise ValueError(f"calibration covers {cal.gamma} positions, gamma is {gamma}")
        self.drafter = drafter
        self.pool = pool
        self.planner = planner
        self.calibration = StsCalibration(temperatures=calibration.temperatures[:gamma])
        # Temperature-0 requests accept a draft when it equals the argmax, far more often than
        # rejection sampling at temperature 1 does: they get their own temperatures when fitted.
        self.greedy_calibration = (
            self.calibration
            if greedy_calibration is None
            else StsCalibration(temperatures=greedy_calibration.temperatures[:gamma])
        )
        self.live_sps = live_sps
        self.drift = drift
        self.gamma = gamma
        self.gate = gate  # None: always draft (the fixed / threshold baselines)
        self.overhead = overhead  # None: price steps by SPS(B) alone, as the method doc does
        self._steps_since_refresh = 0
        self._planned_from = planner.sps_table  # the table the planner's current one was made from
        if planner.sps_table is not None:
            planner.set_sps_table(self._planning_table(planner.sps_table))
        self.last_verify_lens: list[int] = []
        # Called once per step with every decoding request's round (calibration, evaluation).
        self.round_observers: list[Callable[[RoundRecord], None]] = []

    @torch.inference_mode()
    def step(self, engine: LLMEngine, decodes: list[Request], prefills: list[ScheduledChunk]) -> None:
        runner, gamma = engine.runner, self.gamma
        alloc = runner.allocator
        t_start = time.perf_counter()
        sampling = SamplingTensors.from_params([r.params for r in decodes])
        generators = [r.generator for r in decodes]
        anchor_pos = [r.num_computed for r in decodes]
        drafts = Drafts(torch.zeros(0, gamma, dtype=torch.long), None, None)
        lens: list[int] = []
        survival = None
        confidences = None
        draft_s = 0.0
        drafting = bool(decodes) and (self.gate is None or self.gate.choose(len(decodes)))
        if decodes and not drafting:  # at this load plain steps are faster: ℓ = 0, nothing drafted
            lens = [0] * len(decodes)
            drafts = Drafts(torch.zeros(len(decodes), gamma, dtype=torch.long), None, None)
        if drafting:
            # 1. Draft: one backbone pass for all decoding requests, then the sequential head.
            anchors = torch.tensor([r.all_ids[-1] for r in decodes])
            ctx = DraftContext.from_slot_lists(
                [alloc.slots(r.table, 0, p) for r, p in zip(decodes, anchor_pos, strict=True)]
            )
            block = self.drafter.backbone(anchors, torch.tensor(anchor_pos), ctx, self.pool)
            drafts = self.sample_drafts(decodes, block, anchors, sampling, generators)
            draft_s = time.perf_counter() - t_start

            # 2. Plan ℓ_r from calibrated confidences (never from the drafted tokens' values).
            if drafts.confidence_logits is not None:
                confidences = self.calibrate(drafts.confidence_logits, sampling.temperature == 0)
                survival = torch.cumprod(confidences, dim=1)
                self._refresh_sps_table()
                if self.overhead is not None:
                    self.planner.set_step_overhead(self.overhead.overhead(len(decodes), draft_s))
                lens = self.planner.plan(confidences).tolist()
            else:
                lens = [gamma] * len(decodes)
            # Never verify past max_tokens: a cap that depends on lengths only, not token values.
            lens = [
                max(0, min(ell, r.params.max_tokens - len(r.output_ids) - 1))
                for ell, r in zip(lens, decodes, strict=True)
            ]
        self.last_verify_lens = lens

        # 3. Verify: [x0, x1..xℓ] per decoding request + prefill chunks, one target forward.
        chunks = [
            SeqChunk(r.table, r.num_computed, [r.all_ids[-1]] + drafts.tokens[i, :ell].tolist())
            for i, (r, ell) in enumerate(zip(decodes, lens, strict=True))
        ]
        chunks += [SeqChunk(c.request.table, c.start, c.token_ids) for c in prefills]
        tail = [ell + 1 for ell in lens] + [1 if c.completes else 0 for c in prefills]
        result = runner.forward(chunks, tail, capture_layers=self.drafter.capture_layers)
        engine.stats.record_batch(result.batch.num_tokens, result.seconds)
        if self.live_sps is not None and not prefills:  # prefill chunks would skew the curve
            self.live_sps.record(result.batch.num_tokens, result.seconds)
        logits, hidden = result.output.logits, result.output.hidden
        assert hidden is not None
        rows = torch.tensor(tail).cumsum(0).tolist()
        logit_starts = [0] + rows[:-1]
        starts = logit_starts[: len(decodes)]

        # 4. Rejection sampling per request against the target's distributions.
        if sampling.all_greedy:  # accept while the draft equals the target argmax
            argmax = logits.argmax(dim=-1).tolist()
            outcome = verify_greedy(
                drafts.tokens.tolist(), [argmax[s : s + ell + 1] for s, ell in zip(starts, lens, strict=True)]
            )
        else:
            target_probs = [
                shape_probs(logits[s : s + ell + 1], _rows(sampling, i, ell + 1))
                for i, (s, ell) in enumerate(zip(starts, lens, strict=True))
            ]
            outcome = verify(drafts.tokens, drafts.probs, target_probs, lens, generators)
        if survival is not None:
            self.drift.record(survival, torch.tensor(outcome.accepted), torch.tensor(lens))
        if self.round_observers and decodes:
            record = RoundRecord(list(decodes), drafts.confidence_logits, confidences, lens, outcome.accepted)
            for observe in self.round_observers:
                observe(record)

        # 5. Commit: keep x0..x_acc in both caches (one drafter-context write for the whole step,
        #    prefill chunks included), then emit accepted drafts + the corrected/bonus token.
        context_rows = []
        for i, req in enumerate(decodes):
            alloc.truncate(req.table, anchor_pos[i] + outcome.accepted[i] + 1)
            context_rows.append((req.table, result.batch.offsets[i], anchor_pos[i], outcome.accepted[i] + 1))
        context_rows += [
            (c.request.table, off, c.start, c.num_tokens)
            for c, off in zip(prefills, result.batch.offsets[len(decodes) :], strict=True)
        ]
        self._write_context(alloc, hidden, context_rows)
        emitted = 0
        for i, req in enumerate(decodes):
            acc = outcome.accepted[i]
            new_tokens = drafts.tokens[i, :acc].tolist() + [outcome.next_tokens[i]]
            emitted += engine.commit(req, new_tokens, spec_round=(gamma, lens[i], acc) if drafting else None)
        self._sample_prefills(engine, prefills, logits, logit_starts[len(decodes) :])
        if decodes:
            # Under steady traffic almost every step also carries a prefill chunk: leave out its
            # share of the forward (by token count) rather than the whole step, so the estimates
            # keep learning instead of freezing on the rare prefill-free steps.
            prefill_tokens = sum(c.num_tokens for c in prefills)
            prefill_s = result.seconds * prefill_tokens / max(1, result.batch.num_tokens)
            step_s = time.perf_counter() - t_start - prefill_s
            if self.gate is not None:
                self.gate.record(len(decodes), drafting, emitted, step_s)
            if self.overhead is not None:
                self.overhead.record(
                    len(decodes), step_s, result.seconds - prefill_s, draft_s if drafting else 0.0
                )

    def calibrate(self, confidence_logits: torch.Tensor, greedy_rows: torch.Tensor) -> torch.Tensor:
        """Raw confidence logits [R, γ] -> calibrated confidences, greedy rows by their own STS."""
        sampled = self.calibration.apply(confidence_logits)
        if not bool(greedy_rows.any()) or self.greedy_calibration is self.calibration:
            return sampled
        greedy = self.greedy_calibration.apply(confidence_logits)
        return torch.where(greedy_rows[:, None], greedy, sampled)

    def _planning_table(self, table: SpsCostTable) -> SpsCostTable:
        """Measured-cost planning (overhead priced) also plans on the roofline fitted to the probes
        (``fit_roofline``); the method doc's cost model uses the measured probes as they are."""
        return fit_roofline(table) if self.overhead is not None else monotone_envelope(table)

    def _refresh_sps_table(self, every: int = 16) -> None:
        """Hand the planner the live-refreshed curve; it moves slowly, so every few steps."""
        self._steps_since_refresh += 1
        if self.live_sps is None or self._steps_since_refresh < every:
            return
        self._steps_since_refresh = 0
        current = self.live_sps.current_table()
        if current is not self._planned_from:  # unchanged (e.g. refresh off): nothing to refit
            self._planned_from = current
            self.planner.set_sps_table(self._planning_table(current))

    def _write_context(
        self, alloc: PageAllocator, hidden: torch.Tensor, rows: list[tuple[PageTable, int, int, int]]
    ) -> None:
        """rows: (page table, packed row of the first token, its position, token count)."""
        if not rows:
            return
        packed = torch.cat([torch.arange(off, off + n) for _, off, _, n in rows])
        positions = torch.cat([torch.arange(pos, pos + n) for _, _, pos, n in rows])
        slots = torch.cat([alloc.slots(table, pos, pos + n) for table, _, pos, n in rows])
        self.drafter.write_context(hidden[packed], positions, slots, self.pool)

    def sample_drafts(
        self,
        decodes: list[Request],
        block: DraftBlock,
        anchors: torch.Tensor,
        sampling: SamplingTensors,
        generators: Sequence[torch.Generator],
    ) -> Drafts:
        """Left to right: x_k ~ q_k = shape(U_k + B_k(x_{k-1}, state)), the request's settings."""
        greedy = sampling.all_greedy
        state = self.drafter.init_head_state(block.hidden[:, 0])
        prev = anchors
        tokens, probs, prevs = [], [], []
        for k in range(self.gamma):
            step_logits, state = self.drafter.step_logits(block.logits[:, k], prev, block.hidden[:, k], state)
            prevs.append(prev)
            if greedy:
                prev = step_logits.argmax(dim=-1)
            else:
                qk = shape_probs(step_logits, sampling)
                prev = sample(qk, generators)
                probs.append(qk)
            tokens.append(prev)
        conf = self.drafter.confidence_logits(block.hidden[:, : self.gamma], torch.stack(prevs, dim=1))
        return Drafts(torch.stack(tokens, dim=1), torch.stack(probs, dim=1) if probs else None, conf)

    def _sample_prefills(
        self,
        engine: LLMEngine,
        prefills: list[ScheduledChunk],
        logits: torch.Tensor,
        logit_starts: Sequence[int],
    ) -> None:
        """Complete prefill chunks sample their request's next token from their last row."""
        sampled = [(c.request, ls) for c, ls in zip(prefills, logit_starts, strict=True) if c.completes]
        if not sampled:
            return
        reqs = [r for r, _ in sampled]
        rows = logits[torch.tensor([ls for _, ls in sampled])]
        toks = sample_from_logits(
            rows, SamplingTensors.from_params([r.params for r in reqs]), [r.generator for r in reqs]
        )
        for req, tok in zip(reqs, toks.tolist(), strict=True):
            engine.commit(req, [tok])


def _rows(s: SamplingTensors, i: int, n: int) -> SamplingTensors:
    return SamplingTensors(
        s.temperature[i : i + 1].expand(n), s.top_p[i : i + 1].expand(n), s.top_k[i : i + 1].expand(n)
    )
