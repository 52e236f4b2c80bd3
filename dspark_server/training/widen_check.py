"""Compare a widened twin pair with its source: the largest logit differences on one sequence.

Used by ``dspark train widen`` after writing the twin (and by its tests): the target's logits over
a prefill, and the drafter's teacher-forced block logits (base + Markov bias) and raw confidences
for a handful of anchors, with each drafter conditioned on its own target's features.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dspark_server.models.attention import DenseCausalAttention
from dspark_server.models.drafter_checkpoint import load_drafter
from dspark_server.models.loader import load_target
from dspark_server.models.target import TargetModel, TargetOutput


@dataclass(frozen=True)
class PairDiff:
    target_logits: float
    draft_logits: float | None = None
    confidence_logits: float | None = None

    def __str__(self) -> str:
        parts = [f"target {self.target_logits:.2e}"]
        if self.draft_logits is not None:
            parts.append(f"draft {self.draft_logits:.2e}")
        if self.confidence_logits is not None:
            parts.append(f"confidence {self.confidence_logits:.2e}")
        return ", ".join(parts)


def sample_ids(vocab_size: int, length: int = 48, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4 if vocab_size > 8 else 0, vocab_size, (length,), generator=g)


def prefill(target: TargetModel, ids: torch.Tensor, capture: tuple[int, ...] = ()) -> TargetOutput:
    """One sequence's logits (every row) and captured layer outputs, no cache."""
    with torch.no_grad():
        return target(ids, torch.arange(len(ids)), DenseCausalAttention(1, len(ids)), capture_layers=capture)


def _max_diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float | None:
    if a is None or b is None:
        return None
    return float((a.double() - b.double()).abs().max())


def compare_pairs(
    src_target: str | Path,
    src_draft: str | Path | None,
    twin_target: str | Path,
    twin_draft: str | Path | None,
    ids: torch.Tensor | None = None,
) -> PairDiff:
    """Max |difference| of target logits, draft logits and raw confidences, source vs twin (fp32)."""
    a, b = load_target(src_target), load_target(twin_target)
    ids = sample_ids(a.config.vocab_size) if ids is None else ids
    if src_draft is None or twin_draft is None:
        diff = _max_diff(prefill(a, ids).logits, prefill(b, ids).logits)
        assert diff is not None
        return PairDiff(diff)
    da, db = load_drafter(src_draft, a), load_drafter(twin_draft, b)
    out_a, out_b = prefill(a, ids, da.capture_layers), prefill(b, ids, db.capture_layers)
    assert out_a.hidden is not None and out_b.hidden is not None
    n = len(ids)
    anchors = torch.arange(1, n - da.gamma, max(1, (n - da.gamma) // 6))[None, :]
    with torch.no_grad():
        ta = da.forward_train(out_a.hidden[None], ids[None], anchors)
        tb = db.forward_train(out_b.hidden[None], ids[None], anchors)
    target_diff = _max_diff(out_a.logits, out_b.logits)
    assert target_diff is not None
    return PairDiff(
        target_diff, _max_diff(ta.logits, tb.logits), _max_diff(ta.confidence_logits, tb.confidence_logits)
    )
