"""Verification-length planners: confidences [R, gamma] -> verify lengths [R].

All planners see calibrated per-position confidences c(r, j) in [0, 1] and work on the
prefix survival a(r, j) = prod_{i<=j} c(r, i). A verify length l_r counts draft tokens
only; the anchor token is always verified, so request r puts 1 + l_r tokens in the batch
(SGLang's "verify_len" is our 1 + l_r, and its "budget" is our sum of l_r).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from .sps import SpsCostTable

PLANNER_MODES: tuple[str, ...] = ("off", "fixed", "threshold", "dspark", "dspark_budget")
DEFAULT_SURVIVAL_EPS = 1e-6


@dataclass(frozen=True)
class PlannerConfig:
    """``mode``: off (no drafts verified), fixed (all gamma), threshold (static confidence
    cut-off on a(r, j)), dspark (greedy with early stop), dspark_budget (the paper's
    production variant: token budget from stale confidences, top-k allocation)."""

    mode: str = "dspark"
    gamma: int = 7
    threshold: float = 0.5
    survival_eps: float = DEFAULT_SURVIVAL_EPS

    def __post_init__(self) -> None:
        if self.mode not in PLANNER_MODES:
            raise ValueError(f"planner mode must be one of {PLANNER_MODES}, got {self.mode!r}")
        if not isinstance(self.gamma, int) or self.gamma < 1:
            raise ValueError(f"gamma must be an int >= 1, got {self.gamma!r}")
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {self.threshold}")
        if self.survival_eps < 0:
            raise ValueError(f"survival_eps must be >= 0, got {self.survival_eps}")


@dataclass(frozen=True)
class _PlanInputs:
    """What every planner plans from: position-major survival ``surv`` [gamma, R], the stale
    survival a budget planner sizes its budget from (``history``), a cap on admitted drafts
    and the step's other batch tokens (prefill chunks, plain decodes)."""

    surv: np.ndarray
    history: np.ndarray | None
    max_draft_tokens: int | None
    extra_batch_tokens: int


@dataclass(frozen=True)
class PlanResult:
    """A plan and its model quantities (for metrics)."""

    verify_lens: torch.Tensor  # [R] int64, l_r in 0..gamma
    batch_tokens: int  # B = sum_r (1 + l_r)
    expected_tokens: float  # tau = sum_r (1 + sum_{j<=l_r} a(r, j))
    expected_throughput: float  # Theta = tau * SPS(B); NaN when the planner has no SPS table
    budget: int | None = None  # dspark_budget only: the target sum of l_r


def _position_major_survival(confidences: torch.Tensor, gamma: int | None = None) -> np.ndarray:
    """a(r, j) as float32 numpy laid out [gamma, R] (row j holds every request's a(., j));
    this layout makes the cumulative product and the candidate flattening contiguous."""
    if confidences.dim() != 2:
        raise ValueError(f"confidences must be [R, gamma], got shape {tuple(confidences.shape)}")
    if gamma is not None and confidences.shape[1] != gamma:
        raise ValueError(f"confidences have {confidences.shape[1]} positions, planner gamma is {gamma}")
    c = torch.nan_to_num_(confidences.detach().to("cpu", torch.float32).clamp(0.0, 1.0), nan=0.0)
    return np.ascontiguousarray(torch.cumprod(c, dim=1).numpy().T)


def survival_position_major(survival: np.ndarray, gamma: int | None = None) -> np.ndarray:
    """A prefix survival a(r, j) [R, gamma] (any float array) -> the planners' float32 [gamma, R]
    layout, as ``_position_major_survival`` makes it from confidences: NaN counts as 0, values
    are clamped into [0, 1] and made non-increasing in j (a running minimum)."""
    a = np.asarray(survival)
    if a.ndim != 2:
        raise ValueError(f"survival must be [R, gamma], got shape {a.shape}")
    if gamma is not None and a.shape[1] != gamma:
        raise ValueError(f"survival has {a.shape[1]} positions, planner gamma is {gamma}")
    # NaN -> 0 and clamped into [0, 1] in two ufuncs (np.minimum keeps NaN, np.fmax drops it);
    # np.nan_to_num + np.clip cost ~10x more at one request
    a = np.fmax(np.minimum(a.astype(np.float32), np.float32(1.0)), np.float32(0.0))
    return np.ascontiguousarray(np.minimum.accumulate(a, axis=1).T)


def prefix_survival(confidences: torch.Tensor, gamma: int | None = None) -> torch.Tensor:
    """a(r, j) = cumulative product of confidences along j: float32 CPU tensor [R, gamma].

    NaN confidences count as 0 and values are clamped into [0, 1], which keeps a(r, j)
    non-increasing in j (a float product with a factor <= 1 never rounds upwards).
    """
    return torch.from_numpy(_position_major_survival(confidences, gamma)).t()


def _ranked_candidates(
    surv_pm: np.ndarray, valid_pm: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """All candidates in descending a(r, j), ties by j then r (SGLang's order), so each
    request's candidates come in prefix order. Takes [gamma, R] arrays; returns
    (values float64, flat indices j * R + r). Invalid candidates (``valid_pm`` False) sort
    after every valid one; callers must skip them.

    One int64 sort instead of a stable arg-sort (several times faster on CPU): for floats
    >= 0 the bit pattern orders like the value, so (~bits << 32 | j * R + r) sorts
    ascending into exactly that order. Masking the sign bit folds -0.0 into +0.0.
    """
    bits = surv_pm.reshape(-1).view(np.int32).astype(np.int64) & 0x7FFFFFFF
    if valid_pm is not None:
        # Valid values are >= eps > 0 whenever anything is invalid, so bits 0 sorts last.
        bits[~valid_pm.reshape(-1)] = 0
    keys = np.sort(((0x7FFFFFFF - bits) << 32) | np.arange(bits.size, dtype=np.int64))
    order = keys & 0xFFFFFFFF
    values = (0x7FFFFFFF - (keys >> 32)).astype(np.int32).view(np.float32).astype(np.float64)
    return values, order


def steps_per_sec(table: SpsCostTable, start: int, count: int, overhead_s: float = 0.0) -> np.ndarray:
    """Steps per second at B = start .. start + count - 1 when every step also spends
    ``overhead_s`` outside the verification forward (drafting, sampling, bookkeeping):
    1 / (overhead + 1 / SPS(B)). With no overhead this is the table itself."""
    sps = table.lookup_range(start, count)
    return sps if overhead_s <= 0.0 else 1.0 / (overhead_s + 1.0 / sps)


def _summary(
    surv_pm: np.ndarray, lens: np.ndarray, table: SpsCostTable | None, overhead_s: float = 0.0
) -> tuple[int, float, float]:
    gamma, num_requests = surv_pm.shape
    prefix_sums = np.zeros((gamma + 1, num_requests))
    np.cumsum(surv_pm, axis=0, dtype=np.float64, out=prefix_sums[1:])
    batch_tokens = num_requests + int(lens.sum())
    tau = num_requests + float(prefix_sums[lens, np.arange(num_requests)].sum())
    if table is None:
        return batch_tokens, tau, math.nan
    return batch_tokens, tau, tau * float(steps_per_sec(table, batch_tokens, 1, overhead_s)[0])


def summarize_plan(
    survival: torch.Tensor, verify_lens: torch.Tensor, sps_table: SpsCostTable | None
) -> tuple[int, float, float]:
    """(B, tau, Theta) of ``verify_lens`` under survival a(r, j) [R, gamma] and the table."""
    surv_pm = survival.detach().to("cpu", torch.float32).t().contiguous().numpy()
    return _summary(surv_pm, verify_lens.detach().to("cpu", torch.int64).numpy(), sps_table)


class VerifyPlanner(ABC):
    """Chooses l_r for every request of a round at once. ``plan`` is the hot path; the SPS
    table may be swapped between rounds with :meth:`set_sps_table` (live refresh), and the
    step's cost outside the verification forward set with :meth:`set_step_overhead`."""

    def __init__(self, config: PlannerConfig, sps_table: SpsCostTable | None = None) -> None:
        self._config = config
        self._sps_table = sps_table
        self._step_overhead_s = 0.0

    @property
    def config(self) -> PlannerConfig:
        return self._config

    @property
    def sps_table(self) -> SpsCostTable | None:
        return self._sps_table

    def set_sps_table(self, table: SpsCostTable | None) -> None:
        self._sps_table = table

    @property
    def step_overhead_s(self) -> float:
        return self._step_overhead_s

    def set_step_overhead(self, seconds: float) -> None:
        """Seconds every step spends besides the verification forward. The method doc's cost
        model is SPS(B) alone (overhead 0); on a CPU, where a draft pass can cost several
        verification forwards, pricing a step as overhead + 1/SPS(B) admits the drafts that
        are already paid for instead of verifying almost none."""
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"step overhead must be a finite number >= 0, got {seconds}")
        self._step_overhead_s = float(seconds)

    def plan(
        self,
        confidences: torch.Tensor,
        *,
        budget_confidences: torch.Tensor | None = None,
        max_draft_tokens: int | None = None,
        extra_batch_tokens: int = 0,
    ) -> torch.Tensor:
        """[R, gamma] calibrated confidences -> [R] int64 verify lengths.

        ``max_draft_tokens`` caps sum l_r (the step's token budget left after the prefill
        chunks); ``extra_batch_tokens`` are tokens the same forward carries besides the
        verification (prefill chunks), so a candidate is priced at SPS(extra + R + k). Both are
        lengths, never token values, so planning stays lossless."""
        return self.plan_detailed(
            confidences,
            budget_confidences=budget_confidences,
            max_draft_tokens=max_draft_tokens,
            extra_batch_tokens=extra_batch_tokens,
        ).verify_lens

    def plan_detailed(
        self,
        confidences: torch.Tensor,
        *,
        budget_confidences: torch.Tensor | None = None,
        max_draft_tokens: int | None = None,
        extra_batch_tokens: int = 0,
    ) -> PlanResult:
        """``plan`` with the plan's model quantities."""
        surv = _position_major_survival(confidences, self._config.gamma)
        history = None if budget_confidences is None else _position_major_survival(budget_confidences)
        return self._plan_pm(_PlanInputs(surv, history, max_draft_tokens, extra_batch_tokens))

    def plan_survival(
        self, survival: np.ndarray, *, max_draft_tokens: int | None = None, extra_batch_tokens: int = 0
    ) -> PlanResult:
        """The same plan from the prefix survival a(r, j) [R, gamma] itself (the engine's path:
        its calibration yields survival, and a round trip through confidences costs more than
        the plan at one request)."""
        surv = survival_position_major(survival, self._config.gamma)
        return self._plan_pm(_PlanInputs(surv, None, max_draft_tokens, extra_batch_tokens))

    @abstractmethod
    def _plan_pm(self, q: _PlanInputs) -> PlanResult:
        """The plan from ``q``'s position-major survival."""

    def _result(self, surv_pm: np.ndarray, lens: np.ndarray, budget: int | None = None) -> PlanResult:
        lens = lens.astype(np.int64, copy=False)
        b, tau, theta = _summary(surv_pm, lens, self._sps_table, self._step_overhead_s)
        return PlanResult(torch.from_numpy(lens), b, tau, theta, budget)


class OffPlanner(VerifyPlanner):
    """No speculation: only the anchor is verified."""

    def _plan_pm(self, q: _PlanInputs) -> PlanResult:
        return self._result(q.surv, np.zeros(q.surv.shape[1], dtype=np.int64))


class FixedPlanner(VerifyPlanner):
    """Verify every draft (l_r = gamma)."""

    def _plan_pm(self, q: _PlanInputs) -> PlanResult:
        lens = np.full(q.surv.shape[1], self._config.gamma, dtype=np.int64)
        return self._result(q.surv, cap_lengths(lens, q.max_draft_tokens))


class ThresholdPlanner(VerifyPlanner):
    """l_r = largest j with a(r, j) >= threshold (0 if none)."""

    def _plan_pm(self, q: _PlanInputs) -> PlanResult:
        admitted = (q.surv >= self._config.threshold).sum(axis=0)
        return self._result(q.surv, cap_lengths(admitted, q.max_draft_tokens))


def _require_table(planner: VerifyPlanner) -> SpsCostTable:
    if planner.sps_table is None:
        raise ValueError(f"planner mode {planner.config.mode!r} needs an SPS cost table")
    return planner.sps_table


class DSparkPlanner(VerifyPlanner):
    """The hardware-aware prefix scheduler with early stop.

    Walking candidates in descending a(r, j), step k has B_k = R + k and
    tau_k = R + (sum of the first k values); the greedy keeps admitting while
    Theta_k = tau_k * SPS(B_k) strictly beats Theta_{k-1} and stops at the first step that
    does not. So the admitted count is the length of the leading run of strict improvements.
    """

    def _plan_pm(self, q: _PlanInputs) -> PlanResult:
        table = _require_table(self)
        surv, max_draft_tokens = q.surv, q.max_draft_tokens
        num_requests = surv.shape[1]
        if num_requests == 0:
            return PlanResult(torch.zeros(0, dtype=torch.int64), 0, 0.0, 0.0)
        if num_requests == 1:  # one request: its survival is non-increasing, already in rank order
            return self._plan_one(table, surv[:, 0].tolist(), q)
        values, order = _ranked_candidates(surv)
        tau = np.empty(values.size + 1)
        tau[0] = 0.0
        np.cumsum(values, out=tau[1:])
        tau += num_requests
        start = num_requests + max(0, int(q.extra_batch_tokens))
        theta = tau * steps_per_sec(table, start, tau.size, self._step_overhead_s)
        declines = np.flatnonzero(theta[1:] <= theta[:-1])
        admitted = int(declines[0]) if declines.size else values.size
        if max_draft_tokens is not None:  # a cap on the count keeps the leading-run property
            admitted = min(admitted, max(0, int(max_draft_tokens)))
        lens = np.bincount(order[:admitted] % num_requests, minlength=num_requests)
        return PlanResult(
            torch.from_numpy(lens.astype(np.int64, copy=False)),
            num_requests + admitted,
            float(tau[admitted]),
            float(theta[admitted]),
        )

    def _plan_one(self, table: SpsCostTable, values: list[float], q: _PlanInputs) -> PlanResult:
        """``_plan_pm`` for one request in plain floats, the same arithmetic in the same order
        (at one request the numpy path's calls cost more than its γ multiplications)."""
        start = 1 + max(0, int(q.extra_batch_tokens))
        sps = table.lookup_range(start, len(values) + 1).tolist()
        overhead = self._step_overhead_s
        if overhead > 0.0:
            sps = [1.0 / (overhead + 1.0 / s) for s in sps]
        cap = len(values) if q.max_draft_tokens is None else max(0, int(q.max_draft_tokens))
        cum, tau, theta, admitted = 0.0, 1.0, sps[0], 0
        for k, v in enumerate(values):
            cum += v
            next_tau = cum + 1.0
            next_theta = next_tau * sps[k + 1]
            if next_theta <= theta or admitted >= cap:
                break
            tau, theta, admitted = next_tau, next_theta, k + 1
        return PlanResult(torch.tensor([admitted], dtype=torch.int64), 1 + admitted, tau, theta)


def cap_lengths(lens: np.ndarray, cap: int | None) -> np.ndarray:
    """Admit positions position-major — position 1 of every request, then position 2, ... (lower
    row first within a position) — until ``cap`` positions are admitted. A position's admission
    then depends only on positions before it in that order, never on its own drafted token nor on
    later positions of its request (which do depend on it): the cap stays lossless."""
    lens = np.asarray(lens, dtype=np.int64).copy()
    if cap is None or int(lens.sum()) <= cap:
        return lens
    cap = max(0, int(cap))
    level, used = 0, 0
    while True:
        nxt = int(np.minimum(lens, level + 1).sum())
        if nxt > cap:
            break
        level, used = level + 1, nxt
    out = np.minimum(lens, level)
    extra = np.flatnonzero(lens > level)[: cap - used]
    out[extra] += 1
    return out


def _budget_from_pm(
    surv_pm: np.ndarray, table: SpsCostTable, survival_eps: float, overhead_s: float = 0.0
) -> tuple[int, float]:
    num_requests = surv_pm.shape[1]
    cand = surv_pm.reshape(-1)
    ranked = np.sort(cand[cand >= survival_eps].astype(np.float64))[::-1]
    tau = np.concatenate(([0.0], np.cumsum(ranked)))
    tau += num_requests
    theta = tau * steps_per_sec(table, num_requests, tau.size, overhead_s)
    k = int(np.argmax(theta))
    return k, float(theta[k])


def _allocate_from_pm(surv_pm: np.ndarray, budget: int, survival_eps: float) -> np.ndarray:
    num_requests = surv_pm.shape[1]
    if budget <= 0 or surv_pm.size == 0:
        return np.zeros(num_requests, dtype=np.int64)
    valid = surv_pm >= survival_eps
    _, order = _ranked_candidates(surv_pm, valid)
    chosen = order[:budget]
    chosen = chosen[valid.reshape(-1)[chosen]]
    return np.bincount(chosen % num_requests, minlength=num_requests).astype(np.int64)


def _pm(survival: torch.Tensor) -> np.ndarray:
    if survival.dim() != 2:
        raise ValueError(f"survival must be [R, gamma], got shape {tuple(survival.shape)}")
    return survival.detach().to("cpu", torch.float32).t().contiguous().numpy()


def verify_token_budget(
    survival: torch.Tensor, table: SpsCostTable, survival_eps: float = DEFAULT_SURVIVAL_EPS
) -> tuple[int, float]:
    """Token budget K (sum of l_r) maximising (R + top-K survival sum) * SPS(R + K), with no
    early stop, from survival a(r, j) [R, gamma].

    Same arithmetic as SGLang's ``compute_verify_token_budget`` for a plain SPS table:
    candidates below ``survival_eps`` are dropped and ties in Theta go to the smallest K.
    Returns (K, Theta_K).
    """
    return _budget_from_pm(_pm(survival), table, survival_eps)


def allocate_budget(
    survival: torch.Tensor, budget: int, survival_eps: float = DEFAULT_SURVIVAL_EPS
) -> torch.Tensor:
    """Give the ``budget`` highest-survival candidates (SGLang's tie order) to their requests;
    candidates below ``survival_eps`` never count. Returns [R] int64 l_r."""
    return torch.from_numpy(_allocate_from_pm(_pm(survival), int(budget), survival_eps))


class DSparkBudgetPlanner(VerifyPlanner):
    """Production variant: the budget K comes from ``budget_confidences`` (confidences from
    rounds ago, row-aligned with the current requests; rows of requests without history
    should be all 1.0, as SGLang does), then K is spent top-k on the current confidences.

    ``budget_confidences`` is required: a budget taken from the current confidences with no
    early stop lets a draft's value decide whether it is verified (the appendix-A case), so
    it is not lossless. Offline analysis may pass the current confidences explicitly.
    """

    def _plan_pm(self, q: _PlanInputs) -> PlanResult:
        table = _require_table(self)
        surv, history = q.surv, q.history
        if history is None:
            raise ValueError("dspark_budget needs budget_confidences (stale, from earlier rounds)")
        if history.shape[1] != surv.shape[1]:
            raise ValueError(f"budget_confidences has {history.shape[1]} rows, confidences {surv.shape[1]}")
        budget, _ = _budget_from_pm(history, table, self._config.survival_eps, self._step_overhead_s)
        if q.max_draft_tokens is not None:
            budget = min(budget, max(0, int(q.max_draft_tokens)))
        lens = _allocate_from_pm(surv, budget, self._config.survival_eps)
        return self._result(surv, lens, budget)


_PLANNERS: dict[str, type[VerifyPlanner]] = {
    "off": OffPlanner,
    "fixed": FixedPlanner,
    "threshold": ThresholdPlanner,
    "dspark": DSparkPlanner,
    "dspark_budget": DSparkBudgetPlanner,
}


def make_planner(config: PlannerConfig, sps_table: SpsCostTable | None = None) -> VerifyPlanner:
    """Planner for ``config.mode``; dspark modes need ``sps_table`` (here or via set_sps_table
    before the first plan)."""
    return _PLANNERS[config.mode](config, sps_table)
