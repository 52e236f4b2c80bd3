"""Drafter-context writes put off by steps that do not draft.

Drafting reads, for every committed position, K/V that the drafter computes from the target's
captured features (``DSparkDrafter.write_context``). A step that does not draft (the draft gate
chose plain) still captures those features, but writing them would make a plain step in dspark
mode cost more than a plain step. So such a step only keeps its decoding requests' feature rows
here, one tensor per step; the next drafting step (or the step that fills the buffer) takes
them all and writes them in one call.

Rows of requests that are no longer decoding when the writes are taken are dropped: a finished
request's slots may already belong to another request, and a preempted one recomputes its
context with its prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dspark_server.engine.kv_cache import PageAllocator
from dspark_server.engine.request import Request


@dataclass(frozen=True)
class _DeferredStep:
    requests: list[Request]
    positions: list[int]
    features: torch.Tensor  # [R, F], row r: the feature of requests[r]'s token at positions[r]


@dataclass(frozen=True)
class ContextWrites:
    features: torch.Tensor  # [N, F]
    positions: torch.Tensor  # [N]
    slots: torch.Tensor  # [N]


class DeferredContext:
    """At most ``max_steps`` steps or ``max_bytes`` of features are held: writes taken at the
    bound cost what writing them at once would have, so the bound is set high enough that at high
    load (where drafting rarely resumes) most requests finish first and their rows are dropped."""

    def __init__(self, max_steps: int = 4096, max_bytes: int = 256 << 20) -> None:
        if max_steps < 1 or max_bytes < 1:
            raise ValueError("max_steps and max_bytes must be >= 1")
        self.max_steps = max_steps
        self.max_bytes = max_bytes
        self._steps: list[_DeferredStep] = []
        self._bytes = 0

    def __len__(self) -> int:
        """Steps whose writes are pending."""
        return len(self._steps)

    def defer(self, requests: Sequence[Request], positions: Sequence[int], features: torch.Tensor) -> bool:
        """Keep one step's rows (each request committed one token, at ``positions``). True: the
        buffer is full, take the writes now."""
        live = {id(r) for r in requests}  # every decoding request is in every step
        while self._steps and not any(id(r) in live for r in self._steps[0].requests):
            gone = self._steps.pop(0)  # its requests all left: nothing of it will be written
            self._bytes -= gone.features.numel() * gone.features.element_size()
        self._steps.append(_DeferredStep(list(requests), list(positions), features))
        self._bytes += features.numel() * features.element_size()
        return len(self._steps) >= self.max_steps or self._bytes >= self.max_bytes

    def take(self, alloc: PageAllocator, live: Sequence[Request]) -> ContextWrites | None:
        """Every pending write of the ``live`` requests (the step's decoding requests), with the
        slots their positions hold now; the rest is dropped, and the buffer emptied."""
        steps, self._steps, self._bytes = self._steps, [], 0
        wanted = {id(r) for r in live}
        picked: dict[int, tuple[Request, list[int], list[int]]] = {}  # request -> rows, positions
        base = 0
        for step in steps:
            for j, (req, pos) in enumerate(zip(step.requests, step.positions, strict=True)):
                if id(req) in wanted:
                    _, rows, positions = picked.setdefault(id(req), (req, [], []))
                    rows.append(base + j)
                    positions.append(pos)
            base += len(step.requests)
        if not picked:
            return None
        index = torch.tensor([i for _, rows, _ in picked.values() for i in rows])
        where = [(req, torch.tensor(positions)) for req, _, positions in picked.values()]
        return ContextWrites(
            torch.cat([s.features for s in steps])[index],
            torch.cat([w for _, w in where]),
            torch.cat([alloc.slots_at(req.table, w) for req, w in where]),
        )
