"""Sequential Temperature Scaling (STS) for the drafter's confidence head.

Calibrated confidence at position k is sigmoid(raw_logit_k / T_k). The temperatures are fit
left to right: T_k minimises the ECE of the prefix survival a_k = prod_{i<=k} c_i against the
event "at least k drafts were accepted", with T_1..T_{k-1} already fixed.

The JSON format is SGLang 0.5.23's ``DSparkStsCalibration``: ``temperatures`` (one per
position, all > 0), ``dataset`` (str), ``num_samples`` (int), ``ece_before`` / ``ece_after``
(per-position ECE with identity temperatures / with the fitted ones). The ECE, bin count (15)
and temperature grid (41 log-spaced values over [0.1, 10]) follow SGLang's fitter.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DEFAULT_NUM_BINS = 15
_PROB_EPS = 1e-8
# Bounds the [grid, N] candidate matrix so fitting on millions of rounds stays in memory.
_GRID_CHUNK_ELEMENTS = 2_000_000


def default_temperature_grid() -> torch.Tensor:
    """SGLang's grid: 41 log-spaced values over [0.1, 10], generated in float32 (so fitted
    temperatures equal SGLang's bit for bit), returned as float64."""
    return torch.logspace(math.log10(0.1), math.log10(10.0), steps=41, dtype=torch.float32).to(torch.float64)


def _batched_ece(probs: torch.Tensor, targets: torch.Tensor, num_bins: int) -> torch.Tensor:
    """ECE of each row of ``probs`` [G, N] against ``targets`` [N]: equal-width bins over
    [0, 1], sum over bins of |mean predicted - mean realised| weighted by bin share."""
    g, n = probs.shape
    p = probs.to(torch.float64).clamp(_PROB_EPS, 1.0 - _PROB_EPS)
    t = targets.to(torch.float64).reshape(1, n).expand(g, n)
    bins = (p * num_bins).long().clamp_(0, num_bins - 1)
    bins += torch.arange(g).unsqueeze(1) * num_bins
    size = g * num_bins
    pred = torch.zeros(size, dtype=torch.float64).scatter_add_(0, bins.reshape(-1), p.reshape(-1))
    real = torch.zeros(size, dtype=torch.float64).scatter_add_(0, bins.reshape(-1), t.reshape(-1))
    gap = (pred - real).abs().reshape(g, num_bins)
    # |sum(pred) - sum(real)| / n per bin == share * |mean gap|.
    return gap.sum(dim=1) / n


def expected_calibration_error(
    probs: torch.Tensor, targets: torch.Tensor, num_bins: int = DEFAULT_NUM_BINS
) -> float:
    """Equal-width-bin ECE (SGLang's definition; probabilities clamped to [1e-8, 1-1e-8])."""
    p = probs.reshape(-1)
    if p.numel() == 0:
        return math.nan
    if targets.numel() != p.numel():
        raise ValueError(f"probs and targets differ in size ({p.numel()} vs {targets.numel()})")
    return float(_batched_ece(p.unsqueeze(0), targets.reshape(-1), num_bins)[0])


def reliability_bins(
    probs: torch.Tensor, targets: torch.Tensor, num_bins: int = DEFAULT_NUM_BINS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per bin: (mean predicted, realised frequency, count); empty bins give NaN means."""
    p = probs.reshape(-1).to(torch.float64).clamp(_PROB_EPS, 1.0 - _PROB_EPS)
    t = targets.reshape(-1).to(torch.float64)
    bins = (p * num_bins).long().clamp_(0, num_bins - 1)
    count = torch.bincount(bins, minlength=num_bins).to(torch.float64)
    pred = torch.bincount(bins, weights=p, minlength=num_bins)
    real = torch.bincount(bins, weights=t, minlength=num_bins)
    return pred / count, real / count, count


def reliability_curve(
    probs: torch.Tensor, targets: torch.Tensor, num_bins: int = DEFAULT_NUM_BINS
) -> tuple[list[float], list[float], float]:
    """What a reliability plot draws: mean predicted and realised frequency of the non-empty bins,
    and the ECE."""
    pred, real, count = reliability_bins(probs, targets, num_bins)
    keep = count > 0
    ece = expected_calibration_error(probs, targets, num_bins)
    return pred[keep].tolist(), real[keep].tolist(), ece


def prefix_targets(accepted: torch.Tensor, gamma: int) -> torch.Tensor:
    """[N, gamma] float: entry (n, k-1) is 1 when round n accepted at least k drafts
    (SGLang's ``prefix_mask``)."""
    acc = accepted.reshape(-1, 1).to(torch.int64)
    return (torch.arange(gamma).unsqueeze(0) < acc).to(torch.float64)


@dataclass(frozen=True)
class StsCalibration:
    temperatures: tuple[float, ...]
    dataset: str = ""
    num_samples: int = 0
    ece_before: tuple[float, ...] = ()
    ece_after: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        temps = tuple(self.temperatures)
        if not temps:
            raise ValueError("STS calibration needs at least one temperature")
        for t in temps:
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
                raise ValueError(f"STS temperatures must be finite and > 0, got {t!r}")
        if not isinstance(self.dataset, str):
            raise ValueError(f"STS dataset must be a string, got {self.dataset!r}")
        if (
            isinstance(self.num_samples, bool)
            or not isinstance(self.num_samples, int)
            or self.num_samples < 0
        ):
            raise ValueError(f"STS num_samples must be an int >= 0, got {self.num_samples!r}")
        for name in ("ece_before", "ece_after"):
            values = tuple(getattr(self, name))
            if values and len(values) != len(temps):
                raise ValueError(f"STS {name} has {len(values)} entries for {len(temps)} positions")
            for v in values:
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise ValueError(f"STS {name} entries must be numbers, got {v!r}")
            object.__setattr__(self, name, tuple(float(v) for v in values))
        object.__setattr__(self, "temperatures", tuple(float(t) for t in temps))

    @property
    def gamma(self) -> int:
        return len(self.temperatures)

    @classmethod
    def identity(cls, gamma: int) -> StsCalibration:
        return cls(temperatures=(1.0,) * gamma)

    def temperature_tensor(self) -> torch.Tensor:
        return torch.tensor(self.temperatures, dtype=torch.float32)

    def apply(self, raw_logits: torch.Tensor) -> torch.Tensor:
        """[..., gamma] raw confidence logits -> calibrated per-position confidences (float32,
        on the logits' device)."""
        if raw_logits.shape[-1] != self.gamma:
            raise ValueError(
                f"raw logits have {raw_logits.shape[-1]} positions, calibration has {self.gamma}"
            )
        temps = self.temperature_tensor().to(raw_logits.device)
        return torch.sigmoid(raw_logits.float() / temps)

    def survival(self, raw_logits: torch.Tensor) -> torch.Tensor:
        return torch.cumprod(self.apply(raw_logits), dim=-1)

    def to_dict(self) -> dict[str, Any]:
        return {
            "temperatures": list(self.temperatures),
            "dataset": self.dataset,
            "num_samples": self.num_samples,
            "ece_before": list(self.ece_before),
            "ece_after": list(self.ece_after),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StsCalibration:
        if not isinstance(data, Mapping):
            raise ValueError(f"STS calibration: expected a JSON object, got {type(data).__name__}")
        if "temperatures" not in data:
            raise ValueError("STS calibration: missing key 'temperatures'")
        lists = {k: data.get(k, []) for k in ("temperatures", "ece_before", "ece_after")}
        for key, value in lists.items():
            if not isinstance(value, list):
                raise ValueError(f"STS calibration: {key!r} must be a list, got {value!r}")
        return cls(
            temperatures=tuple(lists["temperatures"]),
            dataset=data.get("dataset", ""),
            num_samples=data.get("num_samples", 0),
            ece_before=tuple(lists["ece_before"]),
            ece_after=tuple(lists["ece_after"]),
        )


def load_sts_calibration(path: str | Path) -> StsCalibration:
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"STS calibration {p}: cannot read ({e})") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"STS calibration {p}: invalid JSON ({e})") from e
    try:
        return StsCalibration.from_dict(data)
    except ValueError as e:
        raise ValueError(f"{p}: {e}") from e


def save_sts_calibration(calibration: StsCalibration, path: str | Path) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(calibration.to_dict(), indent=2, allow_nan=False) + "\n", encoding="utf-8")


def _scaled_survival(prev: torch.Tensor, logits_k: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
    """[len(temps), N]: prev * sigmoid(logits_k / T) for each candidate T."""
    return prev.unsqueeze(0) * torch.sigmoid(logits_k.unsqueeze(0) / temps.unsqueeze(1))


def fit_sts(
    raw_logits: torch.Tensor,
    accepted: torch.Tensor,
    grid: torch.Tensor | Sequence[float] | None = None,
    num_bins: int = DEFAULT_NUM_BINS,
    dataset: str = "",
) -> StsCalibration:
    """Fit per-position temperatures left to right.

    ``raw_logits`` [N, gamma]: confidence-head logits of full-gamma verification rounds;
    ``accepted`` [N]: drafts accepted in each round (0..gamma). Ties in ECE go to the first
    grid value, as in SGLang's fitter.
    """
    if raw_logits.dim() != 2 or raw_logits.shape[0] == 0 or raw_logits.shape[1] == 0:
        raise ValueError(f"raw_logits must be a non-empty [N, gamma] tensor, got {tuple(raw_logits.shape)}")
    n, gamma = raw_logits.shape
    acc = accepted.reshape(-1).to(torch.int64)
    if acc.numel() != n:
        raise ValueError(f"accepted has {acc.numel()} entries for {n} rows of logits")
    if bool((acc < 0).any()) or bool((acc > gamma).any()):
        raise ValueError(f"accepted counts must lie in 0..{gamma}")
    grid_t = default_temperature_grid() if grid is None else torch.as_tensor(grid, dtype=torch.float64)
    grid_t = grid_t.reshape(-1)
    if grid_t.numel() == 0 or not bool(torch.isfinite(grid_t).all()) or bool((grid_t <= 0).any()):
        raise ValueError("temperature grid must be non-empty, finite and > 0")
    logits = raw_logits.detach().to("cpu", torch.float64)
    targets = prefix_targets(acc, gamma)

    temps: list[float] = []
    before: list[float] = []
    after: list[float] = []
    chunk = max(1, _GRID_CHUNK_ELEMENTS // n)
    surv_identity = torch.ones(n, dtype=torch.float64)
    surv_fitted = torch.ones(n, dtype=torch.float64)
    for k in range(gamma):
        surv_identity = surv_identity * torch.sigmoid(logits[:, k])
        before.append(expected_calibration_error(surv_identity, targets[:, k], num_bins))
        eces = torch.cat(
            [
                _batched_ece(
                    _scaled_survival(surv_fitted, logits[:, k], grid_t[i : i + chunk]),
                    targets[:, k],
                    num_bins,
                )
                for i in range(0, grid_t.numel(), chunk)
            ]
        )
        best = int(torch.argmin(eces))
        temps.append(float(grid_t[best]))
        after.append(float(eces[best]))
        surv_fitted = _scaled_survival(surv_fitted, logits[:, k], grid_t[best : best + 1])[0]
    return StsCalibration(tuple(temps), dataset, n, tuple(before), tuple(after))


def plot_reliability_diagram(
    raw_logits: torch.Tensor,
    accepted: torch.Tensor,
    calibration: StsCalibration,
    png_path: str | Path,
    num_bins: int = DEFAULT_NUM_BINS,
) -> Path:
    """Per-position reliability diagram of prefix survival: realised frequency of
    "accepted >= k" against predicted a_k, raw (T = 1) and calibrated."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    gamma = calibration.gamma
    targets = prefix_targets(accepted, gamma)
    raw = StsCalibration.identity(gamma).survival(raw_logits.detach().cpu())
    cal = calibration.survival(raw_logits.detach().cpu())
    cols = min(gamma, 4)
    rows = math.ceil(gamma / cols)
    fig = Figure(figsize=(3.2 * cols, 3.2 * rows), dpi=100)
    FigureCanvasAgg(fig)
    for k in range(gamma):
        ax = fig.add_subplot(rows, cols, k + 1)
        ax.plot([0, 1], [0, 1], "--", color="gray", linewidth=1)
        for probs, label, color in ((raw, "raw", "tab:red"), (cal, "STS", "tab:blue")):
            pred, real, ece = reliability_curve(probs[:, k], targets[:, k], num_bins)
            ax.plot(
                pred,
                real,
                "o-",
                color=color,
                markersize=3,
                label=f"{label} ECE {ece:.3f}",
            )
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_title(f"k={k + 1}  T={calibration.temperatures[k]:.2f}", fontsize=9)
        ax.set_xlabel("predicted a_k", fontsize=8)
        ax.set_ylabel("realised P(accepted >= k)", fontsize=8)
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    out = Path(png_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out
