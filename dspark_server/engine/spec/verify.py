"""Rejection sampling for semi-autoregressive drafts (lossless speculative verification).

For each admitted draft x_k drawn from q_k, accept with probability min(1, p_k(x_k) / q_k(x_k));
at the first rejection emit a token from normalize(max(0, p_k - q_k)); if all ℓ drafts pass, emit
a bonus token from p_{ℓ+1}. The emitted sequence is then distributed exactly as plain sampling
from p, for any ℓ chosen without looking at the drafted tokens' values. p and q must be shaped by
the same sampling settings (``sampling.shape_probs``); for greedy rows both are one-hot and this
reduces to "accept while the draft equals the target argmax".

Seeded requests (a ``NoiseKey``) verify by coupling instead (``engine/noise.py``): the drafts were
drawn with the same keyed Gumbel noise the target's tokens are drawn with, a draft is accepted
while it equals the target's keyed draw, and the first differing target draw is emitted; the tokens
are exactly those plain decoding emits for the same seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dspark_server.engine.noise import NoiseKey, keyed_argmax


@dataclass(frozen=True)
class VerifyOutcome:
    accepted: list[int]  # drafts accepted per request (0..ℓ_r)
    next_tokens: list[int]  # the corrected token (after a rejection) or the bonus token


def verify(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: list[torch.Tensor],
    lengths: Sequence[int],
    generators: Sequence[torch.Generator],
    keys: Sequence[NoiseKey | None] | None = None,
) -> VerifyOutcome:
    """Verify each request's first ℓ_r drafts.

    draft_tokens [R, γ]; draft_probs [R, γ, V] (q each draft was sampled from; None only when
    every ℓ_r is 0, i.e. nothing was drafted);
    target_probs[r] [ℓ_r + 1, V] (p at the anchor and at each verified draft position).
    """
    accepted: list[int] = []
    next_tokens: list[int] = []
    for r, ell in enumerate(lengths):
        p = target_probs[r]
        key = keys[r] if keys is not None else None
        if key is not None:
            n, token = _verify_keyed(draft_tokens[r, :ell].tolist(), p, key)
            accepted.append(n)
            next_tokens.append(token)
            continue
        gen = generators[r]
        n = 0
        correction: int | None = None
        for k in range(ell):
            assert draft_probs is not None, "drafts to verify need the distribution they came from"
            x = int(draft_tokens[r, k])
            px, qx = float(p[k, x]), float(draft_probs[r, k, x])
            if _accept(px, qx, gen):
                n += 1
                continue
            correction = _sample(torch.clamp(p[k] - draft_probs[r, k], min=0.0), p[k], gen)
            break
        accepted.append(n)
        next_tokens.append(correction if correction is not None else _sample(p[n], p[n], gen))
    return VerifyOutcome(accepted, next_tokens)


def verify_greedy(draft_tokens: list[list[int]], target_argmax: list[list[int]]) -> VerifyOutcome:
    """Temperature-0 fast path: target_argmax[r] holds the argmax at the ℓ_r + 1 verified rows."""
    accepted, next_tokens = [], []
    for drafts, argmax in zip(draft_tokens, target_argmax, strict=True):
        n = 0
        while n < len(argmax) - 1 and drafts[n] == argmax[n]:
            n += 1
        accepted.append(n)
        next_tokens.append(argmax[n])
    return VerifyOutcome(accepted, next_tokens)


def _verify_keyed(drafts: list[int], p: torch.Tensor, key: NoiseKey) -> tuple[int, int]:
    """Accept while each draft equals the target's keyed draw; emit the first differing draw."""
    draws = keyed_argmax(p, key).tolist()
    n = 0
    while n < len(drafts) and drafts[n] == draws[n]:
        n += 1
    return n, draws[n]


def _accept(px: float, qx: float, gen: torch.Generator) -> bool:
    if qx > 0.0 and px >= qx:
        return True  # probability 1: no random draw needed (greedy hits stay draw-free)
    u = float(torch.rand((), generator=gen))
    return u * qx < px


def _sample(weights: torch.Tensor, fallback: torch.Tensor, gen: torch.Generator) -> int:
    total = float(weights.sum())
    if total <= 0.0:  # p == q up to rounding: the residual is empty, p itself is the answer
        weights, total = fallback, float(fallback.sum())
    if float(weights.max()) >= total * (1 - 1e-9):
        return int(weights.argmax())  # one-hot (greedy): no random draw
    return int(torch.multinomial(weights / total, 1, generator=gen))
