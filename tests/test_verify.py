"""Rejection sampling emits tokens distributed exactly as the target (relative criterion)."""

from __future__ import annotations

import torch

from dspark_server.engine.spec.verify import verify


def _emitted_first_tokens(p: torch.Tensor, q: torch.Tensor, ell: int, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(p.shape[-1])
    for _ in range(n):
        drafts = torch.stack([torch.multinomial(q[k], 1, generator=gen)[0] for k in range(q.shape[0])])
        out = verify(drafts[None], q[None], [p[: ell + 1]], [ell], [gen])
        first = int(drafts[0]) if out.accepted[0] > 0 else out.next_tokens[0]
        counts[first] += 1
    return counts / n


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def test_first_emitted_token_follows_target_distribution() -> None:
    g = torch.Generator().manual_seed(0)
    vocab, gamma = 6, 3
    p = torch.softmax(torch.randn(gamma + 1, vocab, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(gamma, vocab, generator=g) * 1.5, -1)
    refs = [torch.softmax(torch.randn(vocab, generator=g) * 1.5, -1) for _ in range(10)]
    for ell in (0, 1, gamma):
        small = _emitted_first_tokens(p, q, ell, 300, seed=1)
        large = _emitted_first_tokens(p, q, ell, 6000, seed=2)
        assert _tv(large, p[0]) < _tv(small, p[0])  # converges towards the target ...
        assert _tv(large, p[0]) < 0.2 * min(_tv(large, r) for r in refs)  # ... and not elsewhere


def test_greedy_rows_accept_while_equal_to_target_argmax() -> None:
    vocab = 5
    target_argmax = [2, 4, 1, 3]
    p = torch.zeros(4, vocab)
    p[torch.arange(4), torch.tensor(target_argmax)] = 1.0
    drafts = torch.tensor([[2, 4, 0]])
    q = torch.zeros(1, 3, vocab)
    q[0, torch.arange(3), drafts[0]] = 1.0
    out = verify(drafts, q, [p], [3], [torch.Generator()])
    assert out.accepted == [2] and out.next_tokens == [1]
    out = verify(drafts[:, :2], q[:, :2], [p[:3]], [2], [torch.Generator()])
    assert out.accepted == [2] and out.next_tokens == [1]  # bonus = target argmax after 2 accepts
