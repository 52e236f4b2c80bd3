"""Drafter-context writes put off by steps that do not draft.

Drafting reads, for every committed position, K/V that the drafter computes from the target's
captured features (``DSparkDrafter.write_context``). A step that does not draft (the draft gate
chose plain) still captures those features, but writing them would make a plain step in dspark
mode cost more than a plain step. So such a step only keeps its feature rows here — its decoding
requests' new tokens and its prefill chunks, one tensor per step; the next drafting step (or the
step that fills the buffer) takes them all and writes them in one call.

Rows are written only for requests still running, and only for positions they have computed: a
finished request's slots may already belong to another request, and a preempted one recomputes
its context with its prompt (its rows, when it runs again, hold the same features). At high load,
where the gate rarely drafts, most requests finish before their rows would be written, and the
writes of their prompts and tokens are never paid for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dspark_server.engine.kv_cache import PageAllocator
from dspark_server.engine.request import Request, Status


@dataclass(frozen=True)
class Run:
    """``count`` new tokens of one request at positions ``start..``: consecutive feature rows."""

    request: Request
    start: int
    count: int = 1


@dataclass(frozen=True)
class _DeferredStep:
    runs: list[Run]
    features: torch.Tensor  # [N, F]: the runs' rows, in order


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

    def defer(self, runs: Sequence[Run], features: torch.Tensor) -> bool:
        """Keep one step's rows (``features`` [sum of counts, F], the runs' rows in order). True:
        the buffer is full, take the writes now."""
        while self._steps and not any(r.request.status is Status.RUNNING for r in self._steps[0].runs):
            gone = self._steps.pop(0)  # its requests all left: nothing of it will be written
            self._bytes -= gone.features.numel() * gone.features.element_size()
        self._steps.append(_DeferredStep(list(runs), features))
        self._bytes += features.numel() * features.element_size()
        return len(self._steps) >= self.max_steps or self._bytes >= self.max_bytes

    def take(self, alloc: PageAllocator) -> ContextWrites | None:
        """Every pending write of requests still running, for positions they have computed, with
        the slots those positions hold now; the rest is dropped, and the buffer emptied."""
        steps, self._steps, self._bytes = self._steps, [], 0
        picked: dict[int, tuple[Request, list[torch.Tensor], list[torch.Tensor]]] = {}
        base = 0
        for step in steps:
            for run in step.runs:
                req = run.request
                keep = min(run.count, req.num_computed - run.start) if req.status is Status.RUNNING else 0
                if keep > 0:
                    _, rows, positions = picked.setdefault(id(req), (req, [], []))
                    rows.append(torch.arange(base, base + keep))
                    positions.append(torch.arange(run.start, run.start + keep))
                base += run.count
        if not picked:
            return None
        index = torch.cat([i for _, rows, _ in picked.values() for i in rows])
        where = [(req, torch.cat(positions)) for req, _, positions in picked.values()]
        return ContextWrites(
            torch.cat([s.features for s in steps])[index],
            torch.cat([w for _, w in where]),
            torch.cat([alloc.slots_at(req.table, w) for req, w in where]),
        )
