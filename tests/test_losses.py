"""DSpark training losses against values computed by hand on tiny tensors."""

from __future__ import annotations

import math

import pytest
import torch

from dspark_server.training.losses import (
    LossConfig,
    acceptance,
    block_labels,
    dspark_loss,
    gather_rows,
    label_positions,
    position_weights,
    sample_anchors,
)

# One block of gamma = 2 over a 3-token vocab. Probabilities chosen so every term is easy by hand.
P_DRAFT = [[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]]
P_TARGET = [[0.5, 0.3, 0.2], [0.6, 0.2, 0.2]]
LABELS = [0, 2]
CONF = [0.0, 1.0]


def logits(p: list[list[float]]) -> torch.Tensor:
    return torch.tensor(p).log().view(1, 1, 2, 3)


def hand_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        logits(P_DRAFT),
        logits(P_TARGET),
        torch.tensor(LABELS).view(1, 1, 2),
        torch.ones(1, 1, 2, dtype=torch.bool),
        torch.tensor(CONF).view(1, 1, 2),
    )


def test_position_weights() -> None:
    w = position_weights(7, 4.0)
    assert w.tolist() == pytest.approx([math.exp(-(k - 1) / 4.0) for k in range(1, 8)])
    assert w[0] == 1.0 and w[4] == pytest.approx(math.exp(-1.0))
    assert position_weights(3, 0.0).tolist() == [1.0, 1.0, 1.0]


def test_c_star_is_one_minus_half_l1() -> None:
    d, t, *_ = hand_case()
    assert acceptance(d, t).flatten().tolist() == pytest.approx([0.8, 0.4], abs=1e-6)  # L1 = 0.4, 1.2
    same = torch.randn(4, 9)
    assert acceptance(same, same).tolist() == pytest.approx([1.0] * 4)
    disjoint = torch.tensor([[0.0, -1e9], [-1e9, 0.0]])
    assert acceptance(disjoint, disjoint.flip(0)).tolist() == pytest.approx([0.0, 0.0])


def test_loss_terms_match_hand_computation() -> None:
    out = dspark_loss(*hand_case(), cfg=LossConfig())
    w1, w2 = 1.0, math.exp(-0.25)
    den = w1 + w2
    ce = (w1 * -math.log(0.7) + w2 * -math.log(0.8)) / den
    tv = (w1 * 0.4 + w2 * 1.2) / den  # full L1, no 1/2 (DeepSpec's l1_loss)

    def bce(z: float, c: float) -> float:
        s = 1 / (1 + math.exp(-z))
        return -(c * math.log(s) + (1 - c) * math.log(1 - s))

    conf = (w1 * bce(0.0, 0.8) + w2 * bce(1.0, 0.4)) / den
    assert float(out.ce) == pytest.approx(ce, rel=1e-5)
    assert float(out.tv) == pytest.approx(tv, rel=1e-5)
    assert float(out.confidence) == pytest.approx(conf, rel=1e-5)
    assert float(out.loss) == pytest.approx(0.1 * ce + 0.9 * tv + 1.0 * conf, rel=1e-5)
    assert float(out.ce) == pytest.approx(0.298211, abs=1e-5)  # the same number, written out
    assert out.accept_per_pos.tolist() == pytest.approx([0.8, 0.4], abs=1e-6)
    assert out.tv_per_pos.tolist() == pytest.approx([0.4, 1.2], abs=1e-6)
    assert out.accuracy_per_pos.tolist() == [1.0, 1.0]
    assert float(out.tau) == pytest.approx(1 + 0.8 + 0.8 * 0.4, abs=1e-6)
    no_conf = dspark_loss(*hand_case()[:4], None, LossConfig())
    assert float(no_conf.loss) == pytest.approx(0.1 * ce + 0.9 * tv, rel=1e-5)


def test_confidence_target_and_target_logits_are_detached() -> None:
    d, t, labels, mask, conf = hand_case()
    d.requires_grad_(True)
    t.requires_grad_(True)
    conf.requires_grad_(True)
    dspark_loss(d, t, labels, mask, conf, LossConfig(ce_alpha=0.0, tv_alpha=0.0)).loss.backward()
    assert d.grad is None or torch.count_nonzero(d.grad) == 0  # c* carries no gradient
    assert t.grad is None
    assert conf.grad is not None and torch.count_nonzero(conf.grad) == 2
    d.grad = None
    dspark_loss(d, t, labels, mask, None, LossConfig(ce_alpha=0.0)).loss.backward()
    assert d.grad is not None and torch.count_nonzero(d.grad) > 0 and t.grad is None


def test_block_labels_and_masks() -> None:
    ids = torch.arange(10, 18).view(1, 8)  # S = 8
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1]])
    anchors = torch.tensor([[2, 6, 0]])
    valid = torch.tensor([[True, True, False]])
    target_ids, mask = block_labels(ids, loss_mask, anchors, valid, gamma=3)
    assert label_positions(anchors, 3)[0, 0].tolist() == [3, 4, 5]
    assert target_ids[0, 0].tolist() == [13, 14, 15]
    assert mask[0, 0].tolist() == [True, True, False]  # position 5 is not supervised
    assert target_ids[0, 1].tolist() == [17, 17, 17]  # past the end: clamped ids ...
    assert mask[0, 1].tolist() == [True, False, False]  # ... and masked
    assert mask[0, 2].tolist() == [False, False, False]  # padded anchor
    hole = torch.tensor([[1, 1, 1, 0, 1, 1, 1, 1]])
    _, m = block_labels(ids, hole, torch.tensor([[1]]), torch.tensor([[True]]), gamma=4)
    assert m[0, 0].tolist() == [True, False, False, False]  # cut at the first masked label


def test_masked_rows_do_not_change_the_loss() -> None:
    d, t, labels, _, conf = hand_case()
    mask = torch.tensor([[[True, False]]])
    a = dspark_loss(d, t, labels, mask, conf)
    d2, conf2 = d.clone(), conf.clone()
    d2[..., 1, :] = torch.tensor([5.0, -3.0, 0.0])
    conf2[..., 1] = -7.0
    b = dspark_loss(d2, t, labels, mask, conf2)
    assert float(a.loss) == pytest.approx(float(b.loss))
    assert float(a.ce) == pytest.approx(-math.log(0.7), rel=1e-5)
    assert a.count_per_pos.tolist() == [1.0, 0.0]


def test_gather_rows_reads_target_rows_of_each_block() -> None:
    x = torch.arange(2 * 6 * 2).view(2, 6, 2)
    pos = label_positions(torch.tensor([[0, 3], [4, 1]]), 2) - 1  # rows a .. a+g-1
    out = gather_rows(x, pos)
    assert out.shape == (2, 2, 2, 2)
    assert out[0, 1].tolist() == [x[0, 3].tolist(), x[0, 4].tolist()]
    assert out[1, 0].tolist() == [x[1, 4].tolist(), x[1, 5].tolist()]


def test_sample_anchors() -> None:
    loss_mask = torch.tensor([[0, 0, 0, 0] + [1] * 8, [0] * 11 + [1]])
    g = torch.Generator().manual_seed(0)
    anchors, valid = sample_anchors(loss_mask, 5, generator=g)
    a0 = anchors[0].tolist()
    assert valid[0].all() and len(set(a0)) == 5 and a0 == sorted(a0) and all(4 <= a <= 10 for a in a0)
    assert not valid[1].any() and anchors[1].tolist() == [0] * 5  # no candidate in sequence 1
    anchors, valid = sample_anchors(loss_mask, 10, generator=g)
    assert anchors[0, valid[0]].tolist() == list(range(4, 11)) and int(valid[0].sum()) == 7
    seen = set()
    for _ in range(50):
        seen |= set(sample_anchors(loss_mask, 2, generator=g)[0][0].tolist())
    assert seen == set(range(4, 11))
