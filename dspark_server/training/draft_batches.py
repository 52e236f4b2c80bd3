"""Drafter training data per step: the held-out split, a resumable batch order, right-padded
batches and the per-step anchor generator — all pure functions of (seed, step)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from dspark_server.training.distill import SequenceSet


def split_heldout(n: int, fraction: float, max_eval: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, held-out indices): an evenly spaced deterministic slice is held out."""
    n_eval = min(max_eval, round(fraction * n)) if n >= 2 else 0
    n_eval = max(1, n_eval) if n >= 2 and fraction > 0 else n_eval
    held = np.zeros(0, np.int64)
    if n_eval:
        held = np.unique(np.linspace(0, n - 1, n_eval).round().astype(np.int64))
    train = np.setdiff1d(np.arange(n, dtype=np.int64), held)
    return train, held


class BatchOrder:
    """Sequence indices of step s: a seeded permutation per epoch, walked ``batch_size`` at a time.
    A pure function of (seed, step), so a resumed run sees the same batches."""

    def __init__(self, indices: np.ndarray, batch_size: int, seed: int) -> None:
        if len(indices) == 0:
            raise ValueError("no training sequences")
        self.indices, self.batch_size, self.seed = indices, batch_size, seed

    @lru_cache(maxsize=4)  # noqa: B019 - a handful of epochs, bounded
    def _perm(self, epoch: int) -> np.ndarray:
        return self.indices[np.random.default_rng([self.seed, epoch]).permutation(len(self.indices))]

    def batch(self, step: int) -> list[int]:
        n = len(self.indices)
        flat = np.arange(step * self.batch_size, (step + 1) * self.batch_size)
        return [int(self._perm(int(i // n))[i % n]) for i in flat]


@dataclass(frozen=True)
class Batch:
    ids: torch.Tensor  # [B, S] long
    loss_mask: torch.Tensor  # [B, S] float (1 on answer tokens)

    @property
    def num_tokens(self) -> int:
        return int(self.ids.numel())


def make_batch(data: SequenceSet, indices: list[int], seq_len: int, pad_id: int = 0) -> Batch:
    """Right-pad (mask 0) the sequences to the longest one, cutting each at ``seq_len`` tokens.
    Padding sits after every real token, so causal attention never lets a real row see it."""
    parts = [data.get(i) for i in indices]
    s = max(2, min(seq_len, max(len(p[0]) for p in parts)))
    ids = torch.full((len(parts), s), pad_id, dtype=torch.long)
    mask = torch.zeros(len(parts), s)
    for r, (x, m) in enumerate(parts):
        n = min(s, len(x))
        ids[r, :n] = torch.from_numpy(x[:n].astype(np.int64))
        mask[r, :n] = torch.from_numpy(m[:n].astype(np.float32))
    return Batch(ids, mask)


def anchor_generator(seed: int, step: int, salt: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 7 + salt)
