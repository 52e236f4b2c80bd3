"""Confidence calibration per sampling regime: STS temperatures + a per-position survival map.

Why more than STS. Temperature scaling rescales logits around 0: it cannot remove a bias, and
the product of per-position confidences cannot describe rounds that are either easy (every draft
accepted) or hard. At temperature 0 the head (trained on the temperature-1 acceptance c*) is far
too pessimistic; at 0.3 and 0.7 far too optimistic; one temperature per position leaves 3-10% ECE.

The model of one regime (requests sampled at one temperature; 0 = greedy):

1. STS (SGLang's): z_k = raw_k / T_k, score S_k = sum_{i<=k} log sigmoid(z_i) (the log of
   STS's prefix survival);
2. survival map g: first guess a'_k = g_k(S_k), g_k non-decreasing piecewise-linear through knots
   (score, survival), flat outside them;
3. capped map h: a_k = min(a_{k-1}, h_k(min(a'_k, a_{k-1}))) with a_0 = 1, h_k again
   non-decreasing piecewise-linear: survival never grows with k, and h_k recalibrates what the
   cap at a_{k-1} did to g's guess (capping alone biases a_k low where a_k ~ a_{k-1}).
The confidences the planner takes are c_k = a_k / a_{k-1} (their cumulative product is a).

Every a_k depends on raw_1..raw_k only (the planner's losslessness needs that: the decision to
verify x_k may not depend on x_k). Fit (``fit_regime``), deterministic, about a second: STS as
SGLang fits it; then per position, left to right, the rounds are cut into equal-count bins (of
S_k for g, of min(a'_k, a_{k-1}) for h; ``default_map_bins``: ~200 rounds a bin, at most 50), the
realised frequency of "at least k drafts accepted" of each bin is made non-decreasing by weighted
isotonic regression (pool adjacent violators) and becomes the knot (the bin's mean input,
frequency). A per-position temperature plus bias is not enough: on the demo pair's greedy rounds
it leaves 3-7% ECE (one logistic curve per position cannot follow the survival's shape), hence the
non-parametric maps.

Selection per request row, by its sampling temperature t (``CalibrationSet.weights``):

* t = 0 (greedy) uses the regime keyed 0 when the set has one;
* t > 0 interpolates linearly, in t, the survivals of the two sampled regimes around t, and takes
  the nearest sampled regime outside their range (so greedy rows, when the set has no greedy
  regime, take the lowest sampled one); the greedy regime serves sampled rows only when the set
  has nothing else.

File format: SGLang 0.5.23's ``DSparkStsCalibration`` JSON (``temperatures``, ``dataset``,
``num_samples``, ``ece_before``, ``ece_after``) holding stage 1 of one regime (SGLang applies those
temperatures to every request; its msgspec loader ignores unknown keys), plus one key SGLang
ignores, ``dspark_calibration``: {"version": 1, "sglang_regime": t, "regimes": [{
"sampling_temperature", "temperatures", "survival_map": {"score": [[...] per position],
"survival": [[...] per position]}, "capped_map": {same shape}, "num_samples", "ece_before",
"ece_sts", "ece_after", "ece_after_cv"}, ...]} (ECE per position, as fractions, on the fitting
rounds; ``ece_after_cv`` 2-fold cross-validated by prompt). A file without the key (any plain
STS file) reads as one regime without maps, i.e. plain STS.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .piecewise import ColumnInterp
from .sts import (
    DEFAULT_NUM_BINS,
    StsCalibration,
    expected_calibration_error,
    fit_sts,
    prefix_targets,
    reliability_curve,
)

EXTENSION_KEY = "dspark_calibration"
FORMAT_VERSION = 1
GREEDY = 0.0  # the sampling-temperature key of the greedy regime
MIN_SURVIVAL = 1e-4  # survival maps stay in [MIN_SURVIVAL, 1], so c_k = a_k / a_{k-1} is defined
MIN_ROUNDS_PER_BIN = 200
MAX_MAP_BINS = 50
MIN_MAP_BINS = 2


def default_map_bins(num_rounds: int) -> int:
    """Bins of the survival map: about MIN_ROUNDS_PER_BIN rounds each, within [2, 50]."""
    return max(MIN_MAP_BINS, min(MAX_MAP_BINS, num_rounds // MIN_ROUNDS_PER_BIN))


def _numbers(name: str, values: Sequence[Any], n: int | None, positive: bool = False) -> tuple[float, ...]:
    out = tuple(values)
    if n is not None and out and len(out) != n:
        raise ValueError(f"calibration {name} has {len(out)} entries for {n} positions")
    for v in out:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"calibration {name} entries must be finite numbers, got {v!r}")
        if positive and v <= 0:
            raise ValueError(f"calibration {name} entries must be > 0, got {v!r}")
    return tuple(float(v) for v in out)


@dataclass(frozen=True)
class SurvivalMap:
    """Per position k, knots (score[k][i], survival[k][i]): score strictly increasing, survival
    non-decreasing in [MIN_SURVIVAL, 1]."""

    score: tuple[tuple[float, ...], ...]
    survival: tuple[tuple[float, ...], ...]
    _interp: ColumnInterp = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.score) != len(self.survival) or not self.score:
            raise ValueError("survival map: score and survival need one knot list per position")
        xs_all, ys_all = [], []
        for k, (xs, ys) in enumerate(zip(self.score, self.survival, strict=True)):
            xs, ys = _numbers("survival map score", xs, None), _numbers("survival map survival", ys, None)
            if not xs or len(xs) != len(ys):
                raise ValueError(f"survival map position {k + 1}: {len(xs)} scores, {len(ys)} survivals")
            if any(b <= a for a, b in zip(xs, xs[1:], strict=False)):
                raise ValueError(f"survival map position {k + 1}: scores must increase strictly")
            if any(b < a for a, b in zip(ys, ys[1:], strict=False)) or ys[0] < MIN_SURVIVAL or ys[-1] > 1.0:
                raise ValueError(f"survival map position {k + 1}: survivals must rise within [1e-4, 1]")
            xs_all.append(xs)
            ys_all.append(ys)
        object.__setattr__(self, "score", tuple(xs_all))
        object.__setattr__(self, "survival", tuple(ys_all))
        # every position's map in one np.interp call (``at_all``), or on one value (``at_scalar``)
        object.__setattr__(self, "_interp", ColumnInterp(list(zip(xs_all, ys_all, strict=True))))

    @property
    def gamma(self) -> int:
        return len(self.score)

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        """[R, gamma] scores -> [R, gamma] survival (before the running minimum over k)."""
        x = scores.detach().to("cpu", torch.float64).numpy()
        out = np.stack([self.at(k, x[:, k]) for k in range(self.gamma)], axis=1)
        return torch.from_numpy(out).to(scores.device, scores.dtype)

    def at(self, k: int, x: np.ndarray) -> np.ndarray:
        """Position k's map on float64 inputs: piecewise-linear through the knots, flat outside."""
        return self._interp.column(k, x)

    def at_all(self, x: np.ndarray) -> np.ndarray:
        """Every position's map at once on a float64 [R, gamma] array (column k: position k)."""
        return self._interp(x)

    def at_scalar(self, k: int, x: float) -> float:
        """Position k's map on one value (``at``'s arithmetic, without numpy's per-call cost)."""
        return self._interp.scalar(k, x)

    def to_dict(self) -> dict[str, Any]:
        return {"score": [list(x) for x in self.score], "survival": [list(y) for y in self.survival]}

    @classmethod
    def from_dict(cls, data: Any) -> SurvivalMap:
        keys = ("score", "survival")
        if not isinstance(data, Mapping) or not all(isinstance(data.get(k), list) for k in keys):
            raise ValueError("survival_map must be an object with 'score' and 'survival' lists")
        for key in ("score", "survival"):
            if not all(isinstance(v, list) for v in data[key]):
                raise ValueError(f"survival_map {key!r} must hold one list per position")
        return cls(tuple(tuple(x) for x in data["score"]), tuple(tuple(y) for y in data["survival"]))


def _isotonic(values: list[float], weights: list[float]) -> list[float]:
    """Weighted non-decreasing least-squares fit (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, w in zip(values, weights, strict=True):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, c2 = blocks.pop()
            v1, w1, c1 = blocks.pop()
            total = w1 + w2
            blocks.append([(v1 * w1 + v2 * w2) / total if total > 0 else (v1 + v2) / 2, total, c1 + c2])
    return [b[0] for b in blocks for _ in range(int(b[2]))]


def sts_scores(raw_logits: torch.Tensor, temperatures: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """[N, gamma] raw logits -> S_k = sum_{i<=k} log sigmoid(raw_i / T_i), float64."""
    temps = torch.as_tensor(temperatures, dtype=torch.float64, device=raw_logits.device)
    return torch.cumsum(F.logsigmoid(raw_logits.to(torch.float64) / temps), dim=-1)


@dataclass(frozen=True)
class RegimeCalibration:
    """The calibration of requests sampled at one temperature (0 = greedy)."""

    sampling_temperature: float
    temperatures: tuple[float, ...]  # STS, stage 1 (what SGLang applies)
    survival_map: SurvivalMap | None = None  # stage 2, g; None: plain STS
    capped_map: SurvivalMap | None = None  # stage 2, h (needs g)
    num_samples: int = 0
    ece_before: tuple[float, ...] = ()  # raw confidences, on the fitting rounds
    ece_sts: tuple[float, ...] = ()  # stage 1 only
    ece_after: tuple[float, ...] = ()  # both stages
    ece_after_cv: tuple[float, ...] = ()  # both stages, 2-fold cross-validated by prompt

    def __post_init__(self) -> None:
        t = self.sampling_temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"sampling_temperature must be finite and >= 0, got {t!r}")
        object.__setattr__(self, "sampling_temperature", float(t))
        temps = _numbers("temperatures", self.temperatures, None, positive=True)
        if not temps:
            raise ValueError("calibration needs at least one position")
        object.__setattr__(self, "temperatures", temps)
        for name in ("survival_map", "capped_map"):
            m = getattr(self, name)
            if m is not None and m.gamma != len(temps):
                raise ValueError(f"{name} has {m.gamma} positions, STS {len(temps)}")
        if self.capped_map is not None and self.survival_map is None:
            raise ValueError("capped_map needs a survival_map")
        for name in ("ece_before", "ece_sts", "ece_after", "ece_after_cv"):
            object.__setattr__(self, name, _numbers(name, getattr(self, name), len(temps)))
        n = self.num_samples
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"num_samples must be an int >= 0, got {n!r}")

    @property
    def gamma(self) -> int:
        return len(self.temperatures)

    @property
    def is_greedy(self) -> bool:
        return self.sampling_temperature == GREEDY

    @classmethod
    def from_sts(cls, sts: StsCalibration, sampling_temperature: float) -> RegimeCalibration:
        return cls(
            sampling_temperature, sts.temperatures, None, None, sts.num_samples, sts.ece_before, sts.ece_after
        )

    def sts(self, dataset: str = "") -> StsCalibration:
        """Stage 1 in SGLang's format."""
        return StsCalibration(self.temperatures, dataset, self.num_samples, self.ece_before, self.ece_sts)

    def truncated(self, gamma: int) -> RegimeCalibration:
        if gamma > self.gamma:
            raise ValueError(f"calibration covers {self.gamma} positions, gamma is {gamma}")

        def cut(m: SurvivalMap | None) -> SurvivalMap | None:
            return None if m is None else SurvivalMap(m.score[:gamma], m.survival[:gamma])

        return replace(
            self,
            temperatures=self.temperatures[:gamma],
            survival_map=cut(self.survival_map),
            capped_map=cut(self.capped_map),
            ece_before=self.ece_before[:gamma],
            ece_sts=self.ece_sts[:gamma],
            ece_after=self.ece_after[:gamma],
            ece_after_cv=self.ece_after_cv[:gamma],
        )

    def survival(self, raw_logits: torch.Tensor) -> torch.Tensor:
        """[R, gamma] raw logits -> calibrated prefix survival a [R, gamma], non-increasing in k
        (float32 on the logits' device)."""
        if raw_logits.shape[-1] != self.gamma:
            raise ValueError(f"raw logits have {raw_logits.shape[-1]} positions, calibration {self.gamma}")
        raw = raw_logits.detach().reshape(-1, self.gamma).to("cpu", torch.float64).numpy()
        surv = torch.from_numpy(self.survival_np(raw)).to(raw_logits.device, torch.float32)
        return surv.reshape(raw_logits.shape)

    def survival_np(self, raw: np.ndarray) -> np.ndarray:
        """``survival`` on a float64 [R, gamma] array (the engine's per-step path: a few numpy
        calls per position, whatever R, instead of a dozen tensor ops)."""
        if raw.shape[0] == 1:
            return np.array([self._survival_row(raw[0].tolist())])
        z = raw / np.asarray(self.temperatures)
        scores = np.cumsum(-np.logaddexp(0.0, -z), axis=1)  # log sigmoid, summed over k
        if self.survival_map is None:
            return np.exp(scores)
        first = self.survival_map.at_all(scores)
        if self.capped_map is None:
            return np.minimum.accumulate(first, axis=1)
        h, prev = self.capped_map, np.ones(len(first))
        for k in range(self.gamma):
            prev = np.minimum(h.at(k, np.minimum(first[:, k], prev)), prev)
            first[:, k] = prev
        return first

    def _survival_row(self, raw: list[float]) -> list[float]:
        """``survival_np`` of one row in plain floats (at one request a step calibrates γ values,
        and the numpy path's ~20 calls cost more than its arithmetic)."""
        out, score = [], 0.0
        for x, t in zip(raw, self.temperatures, strict=True):
            z = x / t
            if z > 0:  # log sigmoid(z), as np.logaddexp(0, -z) computes it
                score -= math.log1p(math.exp(-z))
            else:
                score -= math.log(2.0) if z == 0 else -z + math.log1p(math.exp(z))
            out.append(score)
        if self.survival_map is None:
            return [math.exp(v) for v in out]
        first = [self.survival_map.at_scalar(k, v) for k, v in enumerate(out)]
        prev = 1.0
        for k, v in enumerate(first):
            v = min(v, prev)
            if self.capped_map is not None:
                v = min(self.capped_map.at_scalar(k, v), prev)
            first[k] = prev = v
        return first

    def apply(self, raw_logits: torch.Tensor) -> torch.Tensor:
        """[R, gamma] raw logits -> per-position confidences c_k = a_k / a_{k-1}."""
        return conditionals(self.survival(raw_logits))

    def to_dict(self) -> dict[str, Any]:
        return {
            "sampling_temperature": self.sampling_temperature,
            "temperatures": list(self.temperatures),
            "survival_map": None if self.survival_map is None else self.survival_map.to_dict(),
            "capped_map": None if self.capped_map is None else self.capped_map.to_dict(),
            "num_samples": self.num_samples,
            "ece_before": list(self.ece_before),
            "ece_sts": list(self.ece_sts),
            "ece_after": list(self.ece_after),
            "ece_after_cv": list(self.ece_after_cv),
        }

    @classmethod
    def from_dict(cls, data: Any) -> RegimeCalibration:
        if not isinstance(data, Mapping):
            raise ValueError(f"calibration regime: expected an object, got {type(data).__name__}")
        for key in ("sampling_temperature", "temperatures"):
            if key not in data:
                raise ValueError(f"calibration regime: missing key {key!r}")
        lists = ("temperatures", "ece_before", "ece_sts", "ece_after", "ece_after_cv")
        for key in lists:
            if not isinstance(data.get(key, []), list):
                raise ValueError(f"calibration regime: {key!r} must be a list, got {data[key]!r}")

        def survival_map(key: str) -> SurvivalMap | None:
            raw = data.get(key)
            return None if raw is None else SurvivalMap.from_dict(raw)

        def numbers(key: str) -> tuple[float, ...]:
            return tuple(data.get(key, []))

        return cls(
            sampling_temperature=data["sampling_temperature"],
            temperatures=numbers("temperatures"),
            survival_map=survival_map("survival_map"),
            capped_map=survival_map("capped_map"),
            num_samples=data.get("num_samples", 0),
            ece_before=numbers("ece_before"),
            ece_sts=numbers("ece_sts"),
            ece_after=numbers("ece_after"),
            ece_after_cv=numbers("ece_after_cv"),
        )


def conditionals(survival: torch.Tensor) -> torch.Tensor:
    """Prefix survival [..., gamma] (positive, non-increasing) -> c_k = a_k / a_{k-1}."""
    prev = torch.cat([torch.ones_like(survival[..., :1]), survival[..., :-1]], dim=-1)
    return (survival / prev).clamp(0.0, 1.0)


@dataclass(frozen=True)
class CalibrationSet:
    """Regimes keyed by sampling temperature: distinct keys (sorted ascending), one gamma."""

    regimes: tuple[RegimeCalibration, ...]
    _rows: dict[float, tuple[float, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        regimes = tuple(sorted(self.regimes, key=lambda r: r.sampling_temperature))
        if not regimes:
            raise ValueError("a calibration set needs at least one regime")
        keys = [r.sampling_temperature for r in regimes]
        if len(set(keys)) != len(keys):
            raise ValueError(f"calibration regimes repeat a sampling temperature: {keys}")
        if len({r.gamma for r in regimes}) != 1:
            raise ValueError(f"calibration regimes differ in gamma: {[r.gamma for r in regimes]}")
        object.__setattr__(self, "regimes", regimes)
        object.__setattr__(self, "_rows", {})

    @property
    def gamma(self) -> int:
        return self.regimes[0].gamma

    @property
    def sampling_temperatures(self) -> tuple[float, ...]:
        return tuple(r.sampling_temperature for r in self.regimes)

    @classmethod
    def identity(cls, gamma: int) -> CalibrationSet:
        return cls((RegimeCalibration(1.0, (1.0,) * gamma),))

    @classmethod
    def from_sts(cls, sts: StsCalibration, sampling_temperature: float) -> CalibrationSet:
        return cls((RegimeCalibration.from_sts(sts, sampling_temperature),))

    @classmethod
    def coerce(cls, cal: StsCalibration | CalibrationSet, sampling_temperature: float) -> CalibrationSet:
        """A set as it is; a plain STS calibration as one regime keyed ``sampling_temperature``."""
        return cal if isinstance(cal, CalibrationSet) else cls.from_sts(cal, sampling_temperature)

    def regime(self, sampling_temperature: float) -> RegimeCalibration | None:
        """The regime keyed exactly ``sampling_temperature``, if any."""
        return next((r for r in self.regimes if r.sampling_temperature == sampling_temperature), None)

    def nearest(self, sampling_temperature: float) -> RegimeCalibration:
        """The regime whose key is nearest (ties to the lower key)."""
        return min(self.regimes, key=lambda r: abs(r.sampling_temperature - sampling_temperature))

    def with_regime(self, regime: RegimeCalibration) -> CalibrationSet:
        """This set with ``regime`` added, replacing the one with the same key."""
        kept = [r for r in self.regimes if r.sampling_temperature != regime.sampling_temperature]
        return CalibrationSet((*kept, regime))

    def with_greedy(self, greedy: CalibrationSet | None) -> CalibrationSet:
        """Greedy rows calibrated by ``greedy`` (its regime nearest temperature 0)."""
        if greedy is None:
            return self
        return self.with_regime(replace(greedy.nearest(GREEDY), sampling_temperature=GREEDY))

    def truncated(self, gamma: int) -> CalibrationSet:
        return CalibrationSet(tuple(r.truncated(gamma) for r in self.regimes))

    def weights(self, temperatures: torch.Tensor) -> torch.Tensor:
        """[R] sampling temperatures -> [R, M] weight of each regime per row (rows sum to 1), by
        the selection rule of the module docstring."""
        t = temperatures.detach().reshape(-1).to("cpu", torch.float64).tolist()
        return torch.tensor([self._weight_row(x) for x in t], dtype=torch.float64).reshape(len(t), -1)

    def _weight_row(self, t: float) -> tuple[float, ...]:
        """One row of ``weights``, memoised per temperature (a server sees a handful of values)."""
        row = self._rows.get(t)
        if row is not None:
            return row
        keys, m = self.sampling_temperatures, len(self.regimes)
        w = [0.0] * m
        if self.regimes[0].is_greedy and t <= 0:
            w[0] = 1.0
        else:
            cols = [i for i in range(m) if keys[i] > 0] or list(range(m))
            skeys = [keys[i] for i in cols]
            tc = min(max(t, skeys[0]), skeys[-1])
            hi = min(bisect.bisect_left(skeys, tc), len(skeys) - 1)
            lo = max(hi - 1, 0)
            span = skeys[hi] - skeys[lo]
            frac = (tc - skeys[lo]) / span if span > 0 else 1.0
            w[cols[lo]] += 1.0 - frac
            w[cols[hi]] += frac
        if len(self._rows) < 1024:
            self._rows[t] = tuple(w)
        return tuple(w)

    def survival(self, raw_logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
        """[R, gamma] raw logits, [R] sampling temperatures -> [R, gamma] calibrated prefix
        survival (float32, on the logits' device)."""
        if raw_logits.dim() != 2:
            raise ValueError(f"raw logits must be [R, gamma], got {tuple(raw_logits.shape)}")
        if temperatures.numel() != raw_logits.shape[0]:
            raise ValueError(f"{temperatures.numel()} temperatures for {raw_logits.shape[0]} rows")
        raw = raw_logits.detach().to("cpu", torch.float64).numpy()
        temps = temperatures.detach().reshape(-1).to("cpu", torch.float64).numpy()
        return torch.from_numpy(self.survival_array(raw, temps)).to(raw_logits.device, torch.float32)

    def survival_array(self, raw: np.ndarray, temps: np.ndarray) -> np.ndarray:
        """``survival`` on float64 numpy arrays ([R, gamma] raw logits, [R] sampling
        temperatures) -> float64 [R, gamma]: the engine's per-step path."""
        if raw.ndim != 2 or raw.shape[1] != self.gamma:
            raise ValueError(f"raw logits must be [R, {self.gamma}], got {raw.shape}")
        if temps.shape[0] != raw.shape[0]:
            raise ValueError(f"{temps.shape[0]} temperatures for {raw.shape[0]} rows")
        if len(self.regimes) == 1:
            return self.regimes[0].survival_np(raw)
        if raw.shape[0] and bool((temps == temps[0]).all()):  # the common case: one temperature
            weights = self._weight_row(float(temps[0]))
            used = [(r, w) for r, w in zip(self.regimes, weights, strict=True) if w > 0]
            if len(used) == 1 and used[0][1] == 1.0:
                return used[0][0].survival_np(raw)
            out = np.zeros_like(raw)
            for regime, wi in used:
                out += wi * regime.survival_np(raw)
            return out
        out = np.zeros_like(raw)
        w = self.weights(torch.from_numpy(temps)).numpy()
        for i, regime in enumerate(self.regimes):
            rows = np.nonzero(w[:, i] > 0)[0]
            if rows.size:
                out[rows] += w[rows, i : i + 1] * regime.survival_np(raw[rows])
        return out

    def apply(self, raw_logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
        """The engine's hook: [R, gamma] raw confidence logits and [R] sampling temperatures ->
        [R, gamma] calibrated per-position confidences (cumprod = the calibrated survival)."""
        return conditionals(self.survival(raw_logits, temperatures))

    def to_dict(self, sglang_regime: float | None = None, dataset: str = "") -> dict[str, Any]:
        """SGLang's STS JSON of regime ``sglang_regime`` (default: the highest sampling
        temperature) plus the ``dspark_calibration`` extension holding every regime."""
        key = self.regimes[-1].sampling_temperature if sglang_regime is None else sglang_regime
        primary = self.regime(key)
        if primary is None:
            raise ValueError(f"no regime at sampling temperature {key}; have {self.sampling_temperatures}")
        out = primary.sts(dataset).to_dict()
        out[EXTENSION_KEY] = {
            "version": FORMAT_VERSION,
            "sglang_regime": primary.sampling_temperature,
            "regimes": [r.to_dict() for r in self.regimes],
        }
        return out

    @classmethod
    def from_dict(cls, data: Any, default_regime: float = 1.0) -> CalibrationSet:
        """Our extended file, or a plain STS file (one regime keyed ``default_regime``)."""
        base = StsCalibration.from_dict(data)  # the SGLang part must be valid on its own
        ext = data.get(EXTENSION_KEY)
        if ext is None:
            return cls.from_sts(base, default_regime)
        if not isinstance(ext, Mapping) or not isinstance(ext.get("regimes"), list):
            raise ValueError(f"{EXTENSION_KEY!r} must be an object with a 'regimes' list")
        if ext.get("version") != FORMAT_VERSION:
            raise ValueError(f"{EXTENSION_KEY!r} version {ext.get('version')!r} is not {FORMAT_VERSION}")
        out = cls(tuple(RegimeCalibration.from_dict(r) for r in ext["regimes"]))
        if out.gamma != base.gamma:
            raise ValueError(f"regimes cover {out.gamma} positions, the STS temperatures {base.gamma}")
        return out


def load_calibration_set(path: str | Path, default_regime: float = 1.0) -> CalibrationSet:
    """Read an extended or plain STS file (a plain one becomes one regime keyed
    ``default_regime``)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"calibration {p}: cannot read ({e})") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"calibration {p}: invalid JSON ({e})") from e
    try:
        return CalibrationSet.from_dict(data, default_regime)
    except ValueError as e:
        raise ValueError(f"{p}: {e}") from e


def save_calibration_set(
    cal: CalibrationSet, path: str | Path, sglang_regime: float | None = None, dataset: str = ""
) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(cal.to_dict(sglang_regime, dataset), indent=2, allow_nan=False)
    p.write_text(text + "\n", encoding="utf-8")


def survival_ece(
    survival: torch.Tensor, accepted: torch.Tensor, num_bins: int = DEFAULT_NUM_BINS
) -> tuple[float, ...]:
    """Per-position ECE of a prefix survival [N, gamma] against "at least k accepted"."""
    gamma = survival.shape[-1]
    targets = prefix_targets(accepted, gamma)
    surv = survival.to(torch.float64)
    return tuple(expected_calibration_error(surv[:, k], targets[:, k], num_bins) for k in range(gamma))


def reliability_knots(
    x: torch.Tensor, y: torch.Tensor, bins: int
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Equal-count bins of ``x``, isotonic realised frequencies of ``y``, knots at the bins'
    mean ``x`` (bins whose means tie are pooled)."""
    n = x.numel()
    bins = max(1, min(bins, n))
    order = torch.argsort(x, stable=True)
    which = torch.empty(n, dtype=torch.long)
    which[order] = torch.div(torch.arange(n) * bins, n, rounding_mode="floor")
    count = torch.bincount(which, minlength=bins).to(torch.float64)
    mean_x = torch.bincount(which, weights=x.to(torch.float64), minlength=bins) / count
    freq = torch.bincount(which, weights=y.to(torch.float64), minlength=bins) / count
    xs: list[float] = []
    ws: list[float] = []
    ys: list[float] = []
    for mx, w, f in zip(mean_x.tolist(), count.tolist(), freq.tolist(), strict=True):
        if xs and mx <= xs[-1]:  # tie (identical values): pool into the previous knot
            ys[-1] = (ys[-1] * ws[-1] + f * w) / (ws[-1] + w)
            ws[-1] += w
        else:
            xs.append(mx)
            ws.append(w)
            ys.append(f)
    return tuple(xs), tuple(min(1.0, max(MIN_SURVIVAL, v)) for v in _isotonic(ys, ws))


def fit_survival_maps(
    scores: torch.Tensor, accepted: torch.Tensor, bins: int
) -> tuple[SurvivalMap, SurvivalMap]:
    """Stage 2 on STS scores [N, gamma]: the survival map g (per position, from the score) and
    the capped map h (per position, from min(g_k, a_{k-1}), fit left to right)."""
    n, gamma = scores.shape
    targets = prefix_targets(accepted, gamma)
    g_knots = [reliability_knots(scores[:, k], targets[:, k], bins) for k in range(gamma)]
    g = SurvivalMap(tuple(x for x, _ in g_knots), tuple(y for _, y in g_knots))
    first = g(scores.to(torch.float64))
    prev = torch.ones(n, dtype=torch.float64)
    h_knots = []
    for k in range(gamma):
        capped = torch.minimum(first[:, k], prev)
        xs, ys = reliability_knots(capped, targets[:, k], bins)
        h_knots.append((xs, ys))
        h_k = torch.from_numpy(np.interp(capped.numpy(), xs, ys))
        prev = torch.minimum(h_k, prev)
    return g, SurvivalMap(tuple(x for x, _ in h_knots), tuple(y for _, y in h_knots))


def fit_regime(
    raw_logits: torch.Tensor,
    accepted: torch.Tensor,
    sampling_temperature: float,
    groups: torch.Tensor | None = None,
    bins: int | None = None,
    num_bins: int = DEFAULT_NUM_BINS,
) -> RegimeCalibration:
    """Fit both stages on full-gamma rounds: ``raw_logits`` [N, gamma], ``accepted`` [N] in
    0..gamma. ``groups`` [N] (e.g. the prompt of each round) enables the 2-fold cross-validated
    ECE (folds by group parity). ``bins``: survival-map bins (default ``default_map_bins(N)``)."""
    sts = fit_sts(raw_logits, accepted, num_bins=num_bins)  # validates the inputs
    logits = raw_logits.detach().to("cpu", torch.float64)
    acc = accepted.reshape(-1).to(torch.int64)
    n = logits.shape[0]
    nb = default_map_bins(n) if bins is None else bins
    g, h = fit_survival_maps(sts_scores(logits, sts.temperatures), acc, nb)
    regime = RegimeCalibration(sampling_temperature, sts.temperatures, g, h, n, sts.ece_before, sts.ece_after)
    after = survival_ece(regime.survival(logits), acc, num_bins)
    cv: tuple[float, ...] = ()
    if groups is not None:
        cv = cross_validated_ece(logits, acc, groups, sampling_temperature, bins, num_bins)
    return replace(regime, ece_after=after, ece_after_cv=cv)


def cross_validated_ece(
    raw_logits: torch.Tensor,
    accepted: torch.Tensor,
    groups: torch.Tensor,
    sampling_temperature: float,
    bins: int | None = None,
    num_bins: int = DEFAULT_NUM_BINS,
) -> tuple[float, ...]:
    """ECE of both stages on rounds they were not fit on: two folds by ``groups`` parity, each
    fit on one fold and measured on the other; per position, the mean over the two folds."""
    g = groups.reshape(-1).to(torch.int64)
    if g.numel() != raw_logits.shape[0]:
        raise ValueError(f"{g.numel()} groups for {raw_logits.shape[0]} rounds")
    folds = [g % 2 == 0, g % 2 == 1]
    if not all(bool(f.any()) for f in folds):
        return ()
    per_fold = []
    for fit_on, test_on in (folds, folds[::-1]):
        fitted = fit_regime(raw_logits[fit_on], accepted[fit_on], sampling_temperature, None, bins, num_bins)
        per_fold.append(survival_ece(fitted.survival(raw_logits[test_on]), accepted[test_on], num_bins))
    return tuple((a + b) / 2 for a, b in zip(*per_fold, strict=True))


def plot_calibration_set(
    records: Mapping[float, tuple[torch.Tensor, torch.Tensor]],
    cal: CalibrationSet,
    png_path: str | Path,
    num_bins: int = DEFAULT_NUM_BINS,
) -> Path:
    """Reliability diagrams of prefix survival, one row per regime (``records``: sampling
    temperature -> (raw logits [N, gamma], accepted [N])), one column per position: raw, STS
    (stage 1) and the full calibration."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    gamma = cal.gamma
    temps = sorted(records)
    fig = Figure(figsize=(2.5 * gamma, 2.6 * len(temps)), dpi=90)
    FigureCanvasAgg(fig)
    for row, t in enumerate(temps):
        logits, accepted = records[t]
        logits = logits.detach().cpu()
        regime = cal.nearest(t)
        targets = prefix_targets(accepted, gamma)
        curves = (
            ("raw", torch.cumprod(torch.sigmoid(logits.double()), dim=-1), "tab:red"),
            ("STS", regime.sts().survival(logits), "tab:orange"),
            ("cal", cal.survival(logits, torch.full((logits.shape[0],), t)), "tab:blue"),
        )
        for k in range(gamma):
            ax = fig.add_subplot(len(temps), gamma, row * gamma + k + 1)
            ax.plot([0, 1], [0, 1], "--", color="gray", linewidth=1)
            for label, probs, color in curves:
                pred, real, ece = reliability_curve(probs[:, k], targets[:, k], num_bins)
                ax.plot(
                    pred,
                    real,
                    "o-",
                    color=color,
                    markersize=2,
                    linewidth=1,
                    label=f"{label} {100 * ece:.1f}%",
                )
            ax.set_xlim(0, 1)
            ax.set_ylim(0, 1)
            ax.tick_params(labelsize=6)
            ax.set_title(f"t={t:g}  k={k + 1}", fontsize=8)
            ax.legend(fontsize=6, loc="upper left")
    fig.supxlabel("predicted a_k (prefix survival)", fontsize=9)
    fig.supylabel("realised P(accepted >= k)", fontsize=9)
    fig.tight_layout()
    out = Path(png_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out
