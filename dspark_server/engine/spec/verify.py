"""Rejection sampling for semi-autoregressive drafts (lossless speculative verification).

For each admitted draft x_k drawn from q_k, accept with probability min(1, p_k(x_k) / q_k(x_k));
at the first rejection emit a token from normalize(max(0, p_k - q_k)); if all ℓ drafts pass, emit
a bonus token from p_{ℓ+1}. The emitted sequence is then distributed exactly as plain sampling
from p, for any ℓ chosen without looking at the drafted tokens' values. p and q must be shaped by
the same sampling settings (``sampling.shape_probs``); for greedy rows both are one-hot and this
reduces to "accept while the draft equals the target argmax".

All requests of a step are verified at once on padded tensors [R, L(+1), V] (L = max ℓ): each
request draws its L + 1 uniforms from its own generator in one call, acceptance is a cumulative
product, and the final token is one inverse-CDF draw per row — no per-position Python.

Seeded requests (a ``NoiseKey``) verify by coupling instead (``engine/noise.py``): the drafts were
drawn with the same keyed Gumbel noise the target's tokens are drawn with, a draft is accepted
while it equals the target's keyed draw, and the first differing target draw is emitted; the tokens
are exactly those plain decoding emits for the same seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dspark_server.engine.noise import NoiseKey, keyed_argmax
from dspark_server.engine.sampling import inverse_cdf
from dspark_server.engine.uniforms import draw_uniforms


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
    num = len(lengths)
    if num == 0:
        return VerifyOutcome([], [])
    width = max(lengths) + 1
    padded = torch.zeros(num, width, target_probs[0].shape[-1], dtype=target_probs[0].dtype)
    for r, p in enumerate(target_probs):
        padded[r, : p.shape[0]] = p
    return verify_padded(draft_tokens, draft_probs, padded, lengths, generators, keys)


def verify_padded(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    lengths: Sequence[int],
    generators: Sequence[torch.Generator],
    keys: Sequence[NoiseKey | None] | None = None,
) -> VerifyOutcome:
    """``verify`` on target_probs [R, ≥ max ℓ + 1, V] (rows past ℓ_r + 1 are ignored)."""
    num = len(lengths)
    if num == 0:
        return VerifyOutcome([], [])
    ell = torch.tensor(list(lengths), dtype=torch.long)
    width = int(ell.max())  # L: positions any request verifies
    p = target_probs[:, : width + 1].float()
    rows = torch.arange(num)
    uniforms = draw_uniforms(generators, width + 1)  # [R, L + 1]
    if width > 0:
        assert draft_probs is not None, "drafts to verify need the distribution they came from"
        x = draft_tokens[:, :width]
        q = draft_probs[:, :width].float()
        px = p[:, :width].gather(2, x[..., None])[..., 0]
        qx = q.gather(2, x[..., None])[..., 0]
        # min(1, px / qx) without dividing; px >= qx accepts with no draw (greedy hits included)
        ok = ((qx > 0) & (px >= qx)) | (uniforms[:, :width] * qx < px)
        ok &= torch.arange(width)[None, :] < ell[:, None]
        accepted = ok.long().cumprod(dim=1).sum(dim=1)
    else:
        accepted = torch.zeros(num, dtype=torch.long)
    final = p[rows, accepted]  # p at the first rejected position, or at ℓ_r + 1 (the bonus)
    rejected = accepted < ell
    if bool(rejected.any()):
        assert draft_probs is not None
        q_at = draft_probs[rows, accepted.clamp(max=draft_probs.shape[1] - 1)].float()
        residual = torch.clamp(final - q_at, min=0.0)
        # p == q up to rounding leaves an empty residual: p itself is then the answer
        empty = residual.sum(dim=1) <= 0.0
        residual = torch.where(empty[:, None], final, residual)
        final = torch.where(rejected[:, None], residual, final)
    tokens = inverse_cdf(final, uniforms[:, width])
    out_acc, out_tok = accepted.tolist(), tokens.tolist()
    for r, key in enumerate(keys or ()):
        if key is not None:
            out_acc[r], out_tok[r] = _verify_keyed(
                draft_tokens[r, : lengths[r]].tolist(), p[r, : lengths[r] + 1], key
            )
    return VerifyOutcome(out_acc, out_tok)


def verify_greedy(
    draft_tokens: torch.Tensor, target_argmax: torch.Tensor, lengths: Sequence[int]
) -> VerifyOutcome:
    """Temperature-0 fast path: draft_tokens [R, γ]; target_argmax [R, ≥ max ℓ + 1] the target's
    argmax at each verified row (rows past ℓ_r + 1 ignored)."""
    num = len(lengths)
    if num == 0:
        return VerifyOutcome([], [])
    # NumPy: a handful of calls on [R, γ] integers, each ~1 µs where a tensor op costs 5-10
    ell = np.asarray(lengths, dtype=np.int64)
    width = int(ell.max())
    drafts, argmax = draft_tokens.numpy(), target_argmax.numpy()
    match = (drafts[:, :width] == argmax[:, :width]) & (np.arange(width)[None, :] < ell[:, None])
    accepted = np.cumprod(match, axis=1).sum(axis=1)
    nxt = argmax[np.arange(num), accepted]
    return VerifyOutcome(accepted.tolist(), nxt.tolist())


def _verify_keyed(drafts: list[int], p: torch.Tensor, key: NoiseKey) -> tuple[int, int]:
    """Accept while each draft equals the target's keyed draw; emit the first differing draw."""
    draws = keyed_argmax(p, key).tolist()
    n = 0
    while n < len(drafts) and drafts[n] == draws[n]:
        n += 1
    return n, draws[n]
