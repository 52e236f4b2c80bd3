"""Keyed noise for seeded requests: Gumbel-max sampling whose randomness is a pure function of
(seed, output position).

Plain decoding samples token t as argmax(log p_t + G(seed, t)); speculative decoding drafts
x_t = argmax(log q_t + G(seed, t)) with the same noise and accepts while x_t equals the target's
argmax(log p_t + G(seed, t)), emitting the target's token at the first mismatch. Every emitted token
is then exactly the token plain decoding emits, so the output is the same in every mode, batch
and load, and each token is an exact sample of p_t (Gumbel-max with fresh noise per position).
The price: a draft is accepted with P(argmax agreement) <= 1 - TV(p, q), below rejection
sampling's acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark_server.models.row_ops import row_argmax


@dataclass(frozen=True)
class NoiseKey:
    """Where a seeded request's noise comes from: its seed and the output index sampled."""

    seed: int
    position: int

    def shifted(self, k: int) -> NoiseKey:
        return NoiseKey(self.seed, self.position + k)


_MIX_A = 0x9E3779B97F4A7C15
_MIX_B = 0xBF58476D1CE4E5B9
_MASK63 = (1 << 63) - 1


def keyed_gumbel(key: NoiseKey, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise [vocab] that is a pure function of (seed, position)."""
    mixed = (key.seed * _MIX_A + (key.position + 1) * _MIX_B) & _MASK63
    mixed ^= mixed >> 31
    gen = torch.Generator().manual_seed(mixed)
    u = torch.rand(vocab, generator=gen, dtype=torch.float64).clamp_(min=1e-300)
    return (-torch.log(-torch.log(u))).float()


def keyed_argmax(probs: torch.Tensor, key: NoiseKey) -> torch.Tensor:
    """Gumbel-max draws from probs [n, V] at positions key.position .. +n-1: each row is an exact
    sample of its distribution, and the same key always gives the same token."""
    noise = torch.stack([keyed_gumbel(key.shifted(k), probs.shape[-1]) for k in range(probs.shape[0])])
    return row_argmax(probs.log() + noise)
