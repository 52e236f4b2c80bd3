"""Drafter-context writes put off by steps (or requests) that do not draft.

Drafting reads, for every committed position, K/V that the drafter computes from the target's
captured features (``DSparkDrafter.write_context``). A step that does not draft (the draft gate
chose plain) still captures those features, but writing them would make a plain step in dspark
mode cost more than a plain step. So such a step only keeps its feature rows here — its decoding
requests' new tokens and its prefill chunks, one tensor per step — and so does a step that drafts
for a few requests only (the gate exploring), for the requests it does not draft. A drafting
step takes the rows of the requests it drafts for (``take(alloc, only=...)``), or all of them,
and writes them in one call; so does the step that fills the buffer.

Rows are written only for requests still running, and only for positions they have computed: a
finished request's slots may already belong to another request, and a preempted one recomputes
its context with its prompt (its rows, when it runs again, are deferred anew). At high load,
where the gate rarely drafts, most requests finish before their rows would be written, and the
writes of their prompts and tokens are never paid for.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from dspark_server.engine.kv_cache import PageAllocator
from dspark_server.engine.request import Request, Status


class Run(NamedTuple):
    """``num_tokens`` new tokens of one request at positions ``start..``: consecutive feature rows
    (a tuple: plain steps make one per decoding request)."""

    request: Request
    start: int
    num_tokens: int = 1


@dataclass
class _DeferredStep:
    runs: list[Run]
    features: torch.Tensor  # [N, F]: the runs' rows, in order
    live: int = 0  # runs not yet taken or forgotten


class _Pending(NamedTuple):
    step: int  # key of its _DeferredStep
    row: int  # its first feature row in that step
    run: Run


@dataclass(frozen=True)
class ContextWrites:
    features: torch.Tensor  # [N, F]
    positions: torch.Tensor  # [N]
    slots: torch.Tensor  # [N]


@dataclass
class _Picked:
    segments: list[tuple[int, int, int]] = field(default_factory=list)  # (step, row, count)
    position_starts: list[int] = field(default_factory=list)
    requests: list[tuple[Request, int]] = field(default_factory=list)  # (request, rows)


class DeferredContext:
    """At most ``max_steps`` steps or ``max_bytes`` of features are held: writes taken at the
    bound cost what writing them at once would have, so the bound is set high enough that at high
    load (where drafting rarely resumes) most requests finish first and their rows are dropped."""

    def __init__(self, max_steps: int = 4096, max_bytes: int = 256 << 20) -> None:
        if max_steps < 1 or max_bytes < 1:
            raise ValueError("max_steps and max_bytes must be >= 1")
        self.max_steps = max_steps
        self.max_bytes = max_bytes
        self._steps: dict[int, _DeferredStep] = {}  # in deferral order
        self._pending: dict[int, list[_Pending]] = {}  # id(request) -> its rows, oldest first
        self._next_key = 0
        self._bytes = 0

    def __len__(self) -> int:
        """Steps whose writes are pending."""
        return len(self._steps)

    def pending(self, request: Request) -> int:
        """Rows of ``request`` waiting to be written."""
        return sum(p.run.num_tokens for p in self._pending.get(id(request), ()))

    def defer(self, runs: Sequence[Run], features: torch.Tensor) -> bool:
        """Keep one step's rows (``features`` [sum of counts, F], the runs' rows in order). True:
        the buffer is full, take the writes now."""
        self._drop_departed()
        key, self._next_key = self._next_key, self._next_key + 1
        self._steps[key] = _DeferredStep(list(runs), features, len(runs))
        self._bytes += features.nbytes
        row, pending = 0, self._pending
        for run in runs:
            rows = pending.get(id(run.request))
            if rows is None:
                pending[id(run.request)] = [_Pending(key, row, run)]
            else:
                rows.append(_Pending(key, row, run))
            row += run.num_tokens
        return len(self._steps) >= self.max_steps or self._bytes >= self.max_bytes

    def take(self, alloc: PageAllocator, only: Iterable[Request] | None = None) -> ContextWrites | None:
        """Every pending write of requests still running (of ``only`` when given), for positions
        they have computed, with the slots those positions hold now. Taken rows leave the buffer;
        without ``only`` so does everything else."""
        if only is None:
            steps, entries = self._steps, list(self._pending.values())
            self._steps, self._pending, self._bytes = {}, {}, 0
        else:
            steps = self._steps
            entries = [e for r in only if (e := self._pending.pop(id(r), None)) is not None]
        picked = _Picked()
        for rows in entries:
            req = rows[0].run.request
            count = 0
            for p in rows:
                keep = (
                    min(p.run.num_tokens, req.num_computed - p.run.start)
                    if req.status is Status.RUNNING
                    else 0
                )
                if keep > 0:
                    picked.segments.append((p.step, p.row, keep))
                    picked.position_starts.append(p.run.start)
                    count += keep
            if count:
                picked.requests.append((req, count))
        writes = self._gather(alloc, steps, picked, whole=only is None) if picked.requests else None
        if only is not None:
            for rows in entries:
                self._release(rows)
        return writes

    @staticmethod
    def _gather(
        alloc: PageAllocator, steps: dict[int, _DeferredStep], picked: _Picked, whole: bool
    ) -> ContextWrites:
        counts = np.array([c for _, _, c in picked.segments])
        offsets = np.cumsum(counts) - counts  # each segment's first row in the result
        within = np.arange(int(counts.sum())) - np.repeat(offsets, counts)
        if whole:  # everything goes: one concatenation, one gather
            base, total = {}, 0
            for key, step in steps.items():
                base[key] = total
                total += step.features.shape[0]
            starts = np.array([base[s] + r for s, r, _ in picked.segments])
            index = torch.from_numpy(np.repeat(starts, counts) + within)
            features = torch.cat([s.features for s in steps.values()])[index]
        else:  # a few requests: their rows only, the rest of the buffer untouched
            features = torch.cat([steps[s].features[r : r + c] for s, r, c in picked.segments])
        positions = torch.from_numpy(np.repeat(np.array(picked.position_starts), counts) + within)
        slots, at = [], 0
        for req, n in picked.requests:
            slots.append(alloc.slots_at(req.table, positions[at : at + n]))
            at += n
        return ContextWrites(features, positions, torch.cat(slots))

    def _release(self, rows: list[_Pending]) -> None:
        for p in rows:
            step = self._steps.get(p.step)
            if step is None:
                continue
            step.live -= 1
            if step.live == 0:
                del self._steps[p.step]
                self._bytes -= step.features.nbytes

    def _drop_departed(self) -> None:
        """Forget the requests of the oldest steps once none of those requests runs any more."""
        while self._steps:
            key, oldest = next(iter(self._steps.items()))
            if any(r.request.status is Status.RUNNING for r in oldest.runs):
                return
            for run in oldest.runs:  # not running: none of its rows will be written
                self._release(self._pending.pop(id(run.request), []))
            if self._steps.pop(key, None) is not None:  # (each run released it already, normally)
                self._bytes -= oldest.features.nbytes
