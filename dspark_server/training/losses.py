"""DSpark training objective: anchor sampling, block labels / masks, and the three loss terms.

Follows DeepSpec (``deepspec/modeling/dspark/{common,loss}.py``, configs ``config/dspark/*.py``):

- anchors: positions p in [0, S-2] with loss_mask[p] and loss_mask[p+1] set, ``num_anchors`` drawn
  uniformly without replacement per sequence (sorted); sequences with fewer candidates get padded
  anchors with ``valid = False``.
- block at anchor a, position k = 1..g: predicts token a+k (label), target distribution = the
  target's logits at row a+k-1; ``eval_mask`` = label inside the sequence and in the loss mask,
  block valid, and cut at the first masked position (contiguous prefix).
- weights w_k = eval_mask * exp(-(k-1)/decay), decay 4.0.
- CE = sum w * CE(draft, label) / sum w                                    (alpha 0.1)
- TV = sum w * ||p_draft - p_target||_1 / sum w   -- the FULL L1 (range 0..2), no 1/2 (alpha 0.9)
- confidence BCE(logit, c*) with c* = clamp(1 - 1/2 ||p_draft - p_target||_1, 0, 1) detached,
  weighted by the same w                                                   (alpha 1.0)
Each term is divided by (sum w + 1e-6).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LossConfig:
    decay: float = 4.0  # DeepSpec loss_decay_gamma; <= 0 disables the decay
    ce_alpha: float = 0.1
    tv_alpha: float = 0.9
    confidence_alpha: float = 1.0


@dataclass(frozen=True)
class LossOutput:
    loss: torch.Tensor  # scalar, differentiable
    ce: torch.Tensor  # scalar terms (detached)
    tv: torch.Tensor
    confidence: torch.Tensor
    accept_per_pos: torch.Tensor  # [g] mean c* (expected per-step acceptance) over supervised rows
    tv_per_pos: torch.Tensor  # [g] mean ||p_d - p_t||_1
    accuracy_per_pos: torch.Tensor  # [g] argmax(draft) == label
    count_per_pos: torch.Tensor  # [g] supervised rows per position
    tau: torch.Tensor  # expected tokens per round, 1 + sum_k prod_{i<=k} c*_i, over valid blocks


def position_weights(gamma: int, decay: float = 4.0) -> torch.Tensor:
    """w_k = exp(-(k-1)/decay) for k = 1..gamma -> [gamma]; all ones when decay <= 0."""
    k = torch.arange(gamma, dtype=torch.float32)
    return torch.exp(-k / decay) if decay > 0 else torch.ones(gamma)


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """[B, S] -> [B, S-1] bool: the anchor and its first label are both supervised."""
    m = loss_mask > 0.5
    return m[:, :-1] & m[:, 1:]


def sample_anchors(
    loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> anchors [B, A] (sorted; padding 0) and valid [B, A]."""
    cand = anchor_candidates(loss_mask)
    b, n = cand.shape
    if n == 0:
        return torch.zeros(b, num_anchors, dtype=torch.long), torch.zeros(b, num_anchors, dtype=torch.bool)
    keys = torch.rand(b, n, generator=generator).masked_fill(~cand, 2.0)
    picked = keys.argsort(dim=1)[:, :num_anchors]
    if picked.shape[1] < num_anchors:
        picked = torch.cat([picked, picked.new_zeros(b, num_anchors - picked.shape[1])], dim=1)
    valid = torch.arange(num_anchors)[None, :] < cand.sum(dim=1, keepdim=True).clamp(max=num_anchors)
    anchors = torch.where(valid, picked, torch.full_like(picked, n + 1)).sort(dim=1).values
    return torch.where(valid, anchors, torch.zeros_like(anchors)), valid


def label_positions(anchors: torch.Tensor, gamma: int) -> torch.Tensor:
    """[B, A] -> [B, A, g]: a+1..a+g, the positions of the tokens block position k predicts.
    The target distribution of position k is the target's logits at row ``label - 1``."""
    return anchors.long()[..., None] + torch.arange(1, gamma + 1)


def gather_rows(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [B, S, ...], positions [B, A, g] (clamped into [0, S-1]) -> [B, A, g, ...]."""
    b, s = x.shape[:2]
    idx = positions.clamp(0, s - 1).reshape(b, -1)
    out = torch.gather(x, 1, idx.view(b, -1, *([1] * (x.dim() - 2))).expand(b, idx.shape[1], *x.shape[2:]))
    return out.view(*positions.shape, *x.shape[2:])


def block_labels(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor, gamma: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> target_ids [B, A, g] and eval_mask [B, A, g] (bool, a contiguous prefix per block)."""
    s = input_ids.shape[1]
    pos = label_positions(anchors, gamma)
    target_ids = gather_rows(input_ids, pos)
    ok = (pos < s) & (gather_rows(loss_mask, pos) > 0.5) & valid[..., None]
    return target_ids, ok.int().cumprod(dim=-1).bool()


def acceptance(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Per-row acceptance probability 1 - 1/2 ||p_d - p_t||_1, clamped to [0, 1] -> [...]."""
    return (1.0 - 0.5 * l1_distance(draft_logits, target_logits)).clamp(0.0, 1.0)


def l1_distance(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """||softmax(draft) - softmax(target)||_1 over the vocab (float32) -> [...]."""
    p = torch.softmax(draft_logits.float(), dim=-1)
    q = torch.softmax(target_logits.float(), dim=-1)
    return (p - q).abs().sum(dim=-1)


def dspark_loss(
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    target_ids: torch.Tensor,
    eval_mask: torch.Tensor,
    confidence_logits: torch.Tensor | None,
    cfg: LossConfig = LossConfig(),
) -> LossOutput:
    """draft/target logits [B, A, g, V], target_ids / eval_mask [B, A, g], confidence logits
    [B, A, g] or None. The target logits are treated as constants (the target is frozen)."""
    g = draft_logits.shape[-2]
    mask = eval_mask.float()
    w = mask * position_weights(g, cfg.decay).to(draft_logits.device)
    den = w.sum() + 1e-6
    ce_rows = F.cross_entropy(
        draft_logits.float().flatten(0, -2), target_ids.flatten(), reduction="none"
    ).view_as(w)
    ce = (ce_rows * w).sum() / den
    l1 = l1_distance(draft_logits, target_logits.detach())
    tv = (l1 * w).sum() / den
    c_star = (1.0 - 0.5 * l1.detach()).clamp(0.0, 1.0)
    conf = ce.new_zeros(())
    if confidence_logits is not None:
        bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), c_star, reduction="none")
        conf = (bce * w).sum() / den
    loss = cfg.ce_alpha * ce + cfg.tv_alpha * tv + cfg.confidence_alpha * conf
    with torch.no_grad():
        dims = tuple(range(mask.dim() - 1))
        count = mask.sum(dim=dims)
        per = count.clamp_min(1.0)
        correct = (draft_logits.argmax(dim=-1) == target_ids).float()
        blocks = eval_mask.any(dim=-1).float()
        tau = ((1.0 + (c_star * mask).cumprod(dim=-1).sum(dim=-1)) * blocks).sum() / blocks.sum().clamp_min(1)
        return LossOutput(
            loss=loss,
            ce=ce.detach(),
            tv=tv.detach(),
            confidence=conf.detach(),
            accept_per_pos=(c_star * mask).sum(dim=dims) / per,
            tv_per_pos=(l1.detach() * mask).sum(dim=dims) / per,
            accuracy_per_pos=(correct * mask).sum(dim=dims) / per,
            count_per_pos=count,
            tau=tau,
        )
