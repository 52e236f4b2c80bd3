"""Each request's uniform draws in [0, 1), taken from its own generator a block at a time.

Sampling a token, a draft block or a verification round takes one to γ + 1 uniforms per request
per step. Drawn one ``torch.rand`` call per request, they cost a few microseconds each plus a
stack of the results, paid per request at every step (at 64 sampled requests, ~0.3 ms of a
plain step). Here each generator fills a block of ``BLOCK`` float64 uniforms in one call and
the steps take from it; a request's draws are still its own generator's, in order, and every
uniform is used once (a take that does not fit what is left of a block starts a new one).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import numpy as np
import torch

BLOCK = 256  # uniforms a generator draws at a time


class _Block:
    __slots__ = ("values", "used")

    def __init__(self, values: np.ndarray) -> None:
        self.values = values
        self.used = 0


_BLOCKS: weakref.WeakKeyDictionary[torch.Generator, _Block] = weakref.WeakKeyDictionary()


def take(generator: torch.Generator, n: int) -> np.ndarray:
    """The next ``n`` uniforms of ``generator`` (float64 [n], a view: copy to keep it)."""
    block = _BLOCKS.get(generator)
    if block is None or block.used + n > block.values.shape[0]:
        values = torch.rand(max(BLOCK, n), generator=generator, dtype=torch.float64).numpy()
        block = _BLOCKS[generator] = _Block(values)
    out = block.values[block.used : block.used + n]
    block.used += n
    return out


def draw_uniforms(generators: Sequence[torch.Generator], n: int) -> torch.Tensor:
    """[R, n] float64: the next ``n`` uniforms of each row's generator."""
    if not generators:
        return torch.zeros(0, n, dtype=torch.float64)
    return torch.from_numpy(np.stack([take(g, n) for g in generators]))


def draw_one(generators: Sequence[torch.Generator]) -> np.ndarray:
    """[R] float64: the next uniform of each row's generator (``draw_uniforms(generators, 1)``
    as one NumPy vector, for the kernels that read it in place)."""
    return np.fromiter((take(g, 1)[0] for g in generators), dtype=np.float64, count=len(generators))
