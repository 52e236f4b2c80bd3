"""Keyed noise for seeded requests: Gumbel-max sampling whose randomness is a pure function of
(seed, output position).

Plain decoding samples token t as argmax(log p_t + G(seed, t)); speculative decoding drafts
x_t = argmax(log q_t + G(seed, t)) with the same noise and accepts while x_t equals the target's
argmax(log p_t + G(seed, t)), emitting the target's token at the first mismatch. Every emitted token
is then exactly the token plain decoding emits, so the output is the same in every mode, batch
and load, and each token is an exact sample of p_t (Gumbel-max with fresh noise per position).
The price: a draft is accepted with P(argmax agreement) <= 1 - TV(p, q), below rejection
sampling's acceptance.

The draw is computed in its exponential-race form, argmax_i w_i / E_i with E_i = -log u_i (the
same argmax: G_i = -log E_i), where u_i comes from a counter-based generator (SplitMix64 over the
row's key and i). A row's key mixes the seed and the position (``row_key``). The kernel
(models/kernels/keyed_draw.h) and the NumPy form here compute the same uniforms bit for bit; their
logs may differ in the last place, which could change a draw only where two scores agree to ~1e-16.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dspark_server.models.kernel_library import load_library

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX_1 = 0xBF58476D1CE4E5B9
_MIX_2 = 0x94D049BB133111EB


@dataclass(frozen=True)
class NoiseKey:
    """Where a seeded request's noise comes from: its seed and the output index sampled."""

    seed: int
    position: int

    def shifted(self, k: int) -> NoiseKey:
        return NoiseKey(self.seed, self.position + k)


def _mix64(z: int) -> int:
    """SplitMix64's finaliser on a 64-bit integer."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * _MIX_1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX_2) & _MASK64
    return z ^ (z >> 31)


def row_key(key: NoiseKey) -> int:
    """The 64-bit key of one row's noise: the seed and the output position, mixed."""
    return _mix64(key.seed * _GOLDEN + _mix64(key.position + 1))


def row_keys(keys: Sequence[NoiseKey | None], width: int) -> tuple[np.ndarray, np.ndarray] | None:
    """For rows that draw ``width`` positions each: (keyed [R] uint8, keys [R, width] uint64, the
    key of position key.position + k in column k; zeros for unseeded rows), or None when no row
    is seeded."""
    if all(key is None for key in keys):
        return None
    flags = np.array([key is not None for key in keys], dtype=np.uint8)
    table = np.zeros((len(keys), width), dtype=np.uint64)
    for r, key in enumerate(keys):
        if key is not None:
            table[r] = [row_key(key.shifted(k)) for k in range(width)]
    return flags, table


def keyed_uniforms(key: int, n: int) -> np.ndarray:
    """u_i in (0, 1) for i < n: ((mix64(key + (i + 1) · golden) >> 11) + 1/2) · 2^-53, float64."""
    z = np.uint64(key) + np.arange(1, n + 1, dtype=np.uint64) * np.uint64(_GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX_1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX_2)
    z ^= z >> np.uint64(31)
    return ((z >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53


def keyed_argmax_rows(weights: torch.Tensor, keys: np.ndarray) -> torch.Tensor:
    """One keyed draw per row of weights [N, V] (unnormalised, >= 0) with row keys [N] (uint64):
    argmax_i w_i / -log u_i, the lowest index among equal scores."""
    lib = load_library()
    keys = np.ascontiguousarray(keys, dtype=np.uint64)
    out = torch.empty(weights.shape[0], dtype=torch.long)
    if lib is not None and weights.shape[0] > 0:
        w = weights.float().contiguous()
        rc = lib.dspark_keyed_argmax(
            w.data_ptr(), w.shape[0], w.shape[1], keys.ctypes.data, out.data_ptr(), 1
        )
        if rc != 0:
            raise RuntimeError(f"keyed draw kernel failed with code {rc}")
        return out
    w64 = weights.double().numpy()
    for r in range(weights.shape[0]):
        out[r] = int(np.argmax(w64[r] / -np.log(keyed_uniforms(int(keys[r]), w64.shape[1]))))
    return out


def keyed_argmax(probs: torch.Tensor, key: NoiseKey) -> torch.Tensor:
    """Gumbel-max draws from probs [n, V] at positions key.position .. +n-1: each row is an exact
    sample of its distribution, and the same key always gives the same token."""
    keys = np.array([row_key(key.shifted(k)) for k in range(probs.shape[0])], dtype=np.uint64)
    return keyed_argmax_rows(probs, keys)
