"""One drafter-training step and the held-out evaluation: a frozen dense target pass capturing
the drafter's features, every block of the batch in one ``forward_train``, the DSpark loss."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dspark_server.models.attention import DenseCausalAttention
from dspark_server.models.drafter import DSparkDrafter
from dspark_server.models.target import TargetModel
from dspark_server.training.draft_batches import Batch, anchor_generator
from dspark_server.training.losses import (
    LossConfig,
    LossOutput,
    block_labels,
    dspark_loss,
    label_positions,
    position_weights,
    sample_anchors,
)


@torch.no_grad()
def target_pass(
    target: TargetModel, drafter: DSparkDrafter, ids: torch.Tensor, anchors: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Features [B, S, n*H] of every position and the target logits of every block row
    [B, A, g, V] (row ``label - 1`` = anchor + k), computing the LM head only on needed rows."""
    b, s = ids.shape
    g = drafter.gamma
    rows = (label_positions(anchors, g) - 1).clamp(0, s - 1)  # [B, A, g]
    flat = (rows + torch.arange(b)[:, None, None] * s).reshape(-1)
    uniq, inverse = torch.unique(flat, return_inverse=True)
    out = target(
        ids.reshape(-1),
        torch.arange(s).repeat(b),
        DenseCausalAttention(b, s),
        logits_rows=uniq,
        capture_layers=drafter.capture_layers,
    )
    assert out.hidden is not None
    return out.hidden.view(b, s, -1), out.logits[inverse].view(*rows.shape, -1)


def greedy_tau(
    draft_logits: torch.Tensor, target_logits: torch.Tensor, eval_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature-0 estimate: per block 1 + Σ_k Π_{i≤k} [argmax draft_i == argmax target_i]
    (teacher-forced). -> (sum over valid blocks, number of valid blocks)."""
    match = (draft_logits.argmax(-1) == target_logits.argmax(-1)) & eval_mask
    blocks = eval_mask.any(-1)
    per_block = 1.0 + match.int().cumprod(-1).sum(-1).float()
    return (per_block * blocks).sum(), blocks.sum()


@dataclass(frozen=True)
class StepResult:
    res: LossOutput
    greedy_tau_sum: float  # NaN when not computed
    blocks: int
    weight: float  # Σ w of the batch (for weighting loss averages)


def batch_loss(
    drafter: DSparkDrafter,
    target: TargetModel,
    batch: Batch,
    anchors_per_seq: int,
    generator: torch.Generator,
    loss_cfg: LossConfig,
    with_greedy: bool = True,
) -> StepResult:
    """Sample anchors, run the target and the drafter, compute the loss. ``with_greedy=False``
    skips the τ_greedy metric (two argmax passes over [B, A, g, V])."""
    g = drafter.gamma
    anchors, valid = sample_anchors(batch.loss_mask, anchors_per_seq, generator=generator)
    labels, eval_mask = block_labels(batch.ids, batch.loss_mask, anchors, valid, g)
    feats, target_block = target_pass(target, drafter, batch.ids, anchors)
    out = drafter.forward_train(feats, batch.ids, anchors)
    res = dspark_loss(out.logits, target_block, labels, eval_mask, out.confidence_logits, loss_cfg)
    with torch.no_grad():
        nb = int(eval_mask.any(-1).sum())
        gt = float(greedy_tau(out.logits, target_block, eval_mask)[0]) if with_greedy else float("nan")
        w = float((eval_mask.float() * position_weights(g, loss_cfg.decay)).sum())
    return StepResult(res, gt, nb, w)


def train_step(
    drafter: DSparkDrafter,
    target: TargetModel,
    opt: torch.optim.Optimizer,
    batch: Batch,
    anchors_per_seq: int,
    generator: torch.Generator,
    lr: float,
    loss_cfg: LossConfig,
    grad_clip: float = 1.0,
) -> tuple[StepResult, float]:
    for group in opt.param_groups:
        group["lr"] = lr
    drafter.train()
    r = batch_loss(drafter, target, batch, anchors_per_seq, generator, loss_cfg, with_greedy=False)
    opt.zero_grad(set_to_none=True)
    r.res.loss.backward()
    params = [p for group in opt.param_groups for p in group["params"]]
    gnorm = float(torch.nn.utils.clip_grad_norm_(params, grad_clip))
    opt.step()
    return r, gnorm


@torch.no_grad()
def evaluate(
    drafter: DSparkDrafter,
    target: TargetModel,
    batches: list[Batch],
    anchors_per_seq: int,
    loss_cfg: LossConfig,
    seed: int = 0,
) -> dict[str, Any]:
    """Held-out metrics with fixed anchors: loss terms (weighted like the loss), τ, τ_greedy,
    per-position acceptance / TV / accuracy (weighted by supervised rows)."""
    was = drafter.training
    drafter.eval()
    g = drafter.gamma
    tot = {"loss": 0.0, "ce": 0.0, "tv": 0.0, "confidence": 0.0}
    wsum = tau_sum = gtau_sum = 0.0
    blocks = 0
    acc = torch.zeros(g, dtype=torch.float64)
    acc_pos = torch.zeros(g, dtype=torch.float64)
    tv_pos = torch.zeros(g, dtype=torch.float64)
    count = torch.zeros(g, dtype=torch.float64)
    for i, batch in enumerate(batches):
        r = batch_loss(drafter, target, batch, anchors_per_seq, anchor_generator(seed, i, salt=1), loss_cfg)
        res = r.res
        for k in tot:
            tot[k] += float(getattr(res, k)) * r.weight
        wsum += r.weight
        tau_sum += float(res.tau) * r.blocks
        gtau_sum += r.greedy_tau_sum
        blocks += r.blocks
        c = res.count_per_pos.double()
        acc += res.accept_per_pos.double() * c
        acc_pos += res.accuracy_per_pos.double() * c
        tv_pos += res.tv_per_pos.double() * c
        count += c
    drafter.train(was)
    per = count.clamp_min(1.0)
    return {
        **{k: round(v / max(wsum, 1e-9), 5) for k, v in tot.items()},
        "tau": round(tau_sum / max(blocks, 1), 4),
        "tau_greedy": round(gtau_sum / max(blocks, 1), 4),
        "accept_per_pos": [round(float(x), 4) for x in acc / per],
        "accuracy_per_pos": [round(float(x), 4) for x in acc_pos / per],
        "tv_per_pos": [round(float(x), 4) for x in tv_pos / per],
        "blocks": blocks,
    }
