"""The drafter's context after each step: which committed positions get their K/V written now
(a drafting step's accepted tokens and its prefill chunks) and which are put off (a plain step's
rows, and a drafting step's plain decodes), and the catch-up of those before a request drafts.

Invariant (decoder.py): the drafter's context K/V hold the projected target features of every
committed position before a request's anchor when it drafts. Rows are the target forward's
captured features (``TargetOutput.hidden``), written by ``DSparkDrafter.write_context``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dspark_server.engine.kv_cache import PageAllocator, PageTable
from dspark_server.engine.model_runner import ForwardResult
from dspark_server.engine.request import Request
from dspark_server.engine.scheduler import ScheduledChunk
from dspark_server.engine.spec.deferred_context import DeferredContext, Run
from dspark_server.models.attention import KVPool
from dspark_server.models.drafter import DSparkDrafter
from dspark_server.models.row_ops import take_rows


@dataclass(frozen=True)
class _ContextRows:
    """``count`` new tokens of one sequence: packed rows ``row..``, positions ``position..``."""

    table: PageTable
    row: int
    position: int
    count: int


# Writes of fewer rows teach nothing of a row's cost (a call's fixed cost would dominate).
MIN_TIMED_ROWS = 32
ROW_SMOOTHING = 0.2


class ContextWrites:
    def __init__(self, drafter: DSparkDrafter, pool: KVPool) -> None:
        self.drafter = drafter
        self.pool = pool
        self.deferred = DeferredContext()  # drafter-context writes put off by plain steps
        self.row_seconds = 0.0  # a context row's write time (moving average; 0: not measured yet)

    def pending_seconds(self, requests: Sequence[Request]) -> float:
        """What catching up these requests' put-off rows would cost now: their computed positions
        without the drafter's K/V, at the measured time of a row (0 until a write measured it).
        At 16 requests on the K=8 twin, a whole drafting step after ~100 plain ones wrote ~2,500
        rows first, 370-570 ms against a ~27 ms plain step."""
        rows = sum(max(0, r.num_computed - r.drafter_context) for r in requests if not r.context_gap)
        return rows * self.row_seconds

    def _timed(self, rows: int, seconds: float) -> None:
        if rows >= MIN_TIMED_ROWS and seconds > 0:
            per_row = seconds / rows
            old = self.row_seconds
            self.row_seconds = per_row if old == 0.0 else old + ROW_SMOOTHING * (per_row - old)

    def keep_accepted(
        self,
        alloc: PageAllocator,
        decodes: Sequence[Request],
        anchor_pos: Sequence[int],
        accepted: Sequence[int],
        plain: Sequence[Run],
        prefills: Sequence[ScheduledChunk],
        forward: ForwardResult,
    ) -> None:
        """After verification: keep x0..x_acc in both caches, one drafter-context write for the
        drafting requests and the prefill chunks; the plain decodes' rows are put off."""
        offsets = forward.batch.offsets
        rows: list[_ContextRows] = []
        for i, (req, start) in enumerate(zip(decodes, anchor_pos, strict=True)):
            alloc.truncate(req.table, start + accepted[i] + 1)
            rows.append(_ContextRows(req.table, offsets[i], start, accepted[i] + 1))
            req.drafter_context = start + accepted[i] + 1  # it drafted: all before was caught up
        first_prefill = len(decodes) + len(plain)
        for off, c in zip(offsets[first_prefill:], prefills, strict=True):
            rows.append(_ContextRows(c.request.table, off, c.start, c.num_tokens))
            if c.request.drafter_context >= c.start:  # no rows of it put off before this chunk
                c.request.drafter_context = c.start + c.num_tokens
        self._write(alloc, forward, rows)
        if plain:
            hidden = forward.output.hidden
            assert hidden is not None
            at = torch.tensor(offsets[len(decodes) : first_prefill])
            if self.deferred.defer(plain, hidden[at]):
                self.catch_up(alloc)

    def catch_up(self, alloc: PageAllocator, only: Sequence[Request] | None = None) -> float:
        """Write the context steps without drafting put off (before drafting reads it): of
        ``only`` these requests, when given. Returns the share of the rows written that were
        prompt positions (0 when none were written)."""
        if not len(self.deferred):
            return 0.0
        t0 = time.perf_counter()
        writes = self.deferred.take(alloc, only)
        if writes is None:
            return 0.0
        self.drafter.write_context(writes.features, writes.positions, writes.slots, self.pool)
        if alloc.cache is not None:
            alloc.cache.mark_context(writes.slots.numpy())
        for req in writes.requests:  # every row of theirs put off is written now
            req.drafter_context = req.num_computed
        rows = int(writes.positions.numel())
        self._timed(rows, time.perf_counter() - t0)
        return writes.prompt_rows / max(1, rows)

    def _write(self, alloc: PageAllocator, forward: ForwardResult, rows: list[_ContextRows]) -> None:
        if not rows:
            return
        t0 = time.perf_counter()
        hidden = forward.output.hidden
        assert hidden is not None
        # NumPy index vectors (a NumPy call costs ~1 µs, a tensor op on these few rows 5-10)
        packed = np.concatenate([np.arange(r.row, r.row + r.count) for r in rows])
        positions = np.concatenate([np.arange(r.position, r.position + r.count) for r in rows])
        slots = np.concatenate([alloc.slot_run(r.table, r.position, r.count) for r in rows])
        features = take_rows(hidden, torch.from_numpy(packed))
        self.drafter.write_context(features, torch.from_numpy(positions), torch.from_numpy(slots), self.pool)
        if alloc.cache is not None:  # these pages' drafter K/V: a cached prefix may be reused to draft
            alloc.cache.mark_context(slots)
        self._timed(len(positions), time.perf_counter() - t0)
