"""Drafter-context writes put off by steps (or requests) that do not draft.

Drafting reads, for every committed position, K/V that the drafter computes from the target's
captured features (``DSparkDrafter.write_context``). A step that does not draft (the draft gate
chose plain) still captures those features, but writing them would make a plain step in dspark
mode cost more than a plain step. So such a step only keeps its feature rows here — its decoding
requests' new tokens and its prefill chunks, one tensor per step — and so does a step that drafts
for a few requests only (the gate exploring), for the requests it does not draft. A drafting
step takes the rows of the requests it drafts for (``take(alloc, only=...)``), or all of them,
and writes them in one call; so does the step that fills the buffer.

Keeping a step costs O(1): it is filed as it is, with no per-request index (at 64 decoding
requests, indexing every row cost ~0.2 ms a plain step, 2-3% of it); a request's rows are found
by scanning the steps when it drafts, which is rare while steps are plain.

Rows are written only for requests still running, and only for positions they have computed: a
finished request's slots may already belong to another request, and a preempted one recomputes
its context with its prompt (its rows, when it runs again, are deferred anew). At high load,
where the gate rarely drafts, most requests finish before their rows would be written, and the
writes of their prompts and tokens are never paid for.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from dspark_server.engine.kv_cache import PageAllocator
from dspark_server.engine.request import Request, Status

# Deferrals between two looks for the oldest steps whose requests all left: a look touches those
# requests (cold after a forward), and forgetting a departed step a few steps late costs nothing.
DROP_EVERY = 16


class Run(NamedTuple):
    """``num_tokens`` new tokens of one request at positions ``start..``: consecutive feature rows
    (a tuple: plain steps make one per decoding request)."""

    request: Request
    start: int
    num_tokens: int = 1


@dataclass
class _DeferredStep:
    """One step's rows: one per request of ``decodes`` (at ``starts``), then ``more`` runs. The
    runs are made when first read (rarely: a plain step only files its lists)."""

    decodes: Sequence[Request]
    starts: Sequence[int]
    more: Sequence[Run]
    parts: Sequence[torch.Tensor]  # the runs' rows, in order, in one or more [n, F] blocks
    taken: set[int] = field(default_factory=set)  # ids of the requests whose rows were taken
    _runs: list[Run] | None = None

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    @property
    def features(self) -> torch.Tensor:
        """[N, F]: the rows in one block, joined when first read (rarely, at high load, where
        most steps are forgotten unread: joining a held run of 32 plain steps' rows as it was
        filed cost ~0.2 ms, ~0.8% of the time at 16 requests on the demo pair)."""
        if len(self.parts) > 1:
            self.parts = (torch.cat(list(self.parts)),)
        return self.parts[0]

    def requests(self) -> Iterator[Request]:
        """Every run's request, in order (without making the runs)."""
        yield from self.decodes
        for run in self.more:
            yield run.request

    @property
    def runs(self) -> list[Run]:
        if self._runs is None:
            self._runs = [Run(r, p) for r, p in zip(self.decodes, self.starts, strict=True)]
            self._runs += self.more
        return self._runs

    def rows(self) -> list[int]:
        """Each run's first feature row."""
        starts, at = [], 0
        for run in self.runs:
            starts.append(at)
            at += run.num_tokens
        return starts


@dataclass(frozen=True)
class ContextWrites:
    features: torch.Tensor  # [N, F]
    positions: torch.Tensor  # [N]
    slots: torch.Tensor  # [N]
    prompt_rows: int = 0  # of the N, the rows of prompt positions (prefill chunks put off)
    requests: tuple[Request, ...] = ()  # whose rows these are: none of theirs is left pending


@dataclass
class _Picked:
    """Per request (in the order first met), its (step, row, count, position) segments."""

    segments: dict[int, list[tuple[int, int, int, int]]] = field(default_factory=dict)
    requests: dict[int, Request] = field(default_factory=dict)

    def add(self, req: Request, step: int, row: int, count: int, position: int) -> None:
        key = id(req)
        if key not in self.requests:
            self.requests[key] = req
            self.segments[key] = []
        self.segments[key].append((step, row, count, position))


class DeferredContext:
    """At most ``max_steps`` steps or ``max_bytes`` of features are held: writes taken at the
    bound cost what writing them at once would have, so the bound is set high enough that at high
    load (where drafting rarely resumes) most requests finish first and their rows are dropped.
    A token's features are 3 target layers' hidden states: 3 KB on the demo pair, 24 KB on the
    K=8 twin, where 64 requests' prompts alone (~19k tokens) overflowed a 256 MB bound and the
    catch-ups it forced cost 1.6 s of a 25.6 s run held on plain steps (off: 24.1 s)."""

    def __init__(self, max_steps: int = 4096, max_bytes: int = 1 << 30) -> None:
        if max_steps < 1 or max_bytes < 1:
            raise ValueError("max_steps and max_bytes must be >= 1")
        self.max_steps = max_steps
        self.max_bytes = max_bytes
        self._steps: dict[int, _DeferredStep] = {}  # in deferral order
        self._next_key = 0
        self._defers = 0
        self._bytes = 0
        # a request of the oldest step seen running: while it runs, that step stays (one check
        # instead of a scan of the step's runs at every deferral)
        self._keeps_oldest: tuple[int, Request] | None = None

    def __len__(self) -> int:
        """Steps whose writes are pending."""
        return len(self._steps)

    def pending(self, request: Request) -> int:
        """Rows of ``request`` waiting to be written."""
        key = id(request)
        return sum(
            run.num_tokens
            for step in self._steps.values()
            if key not in step.taken
            for run in step.runs
            if run.request is request
        )

    def defer(
        self,
        runs: Sequence[Run],
        features: torch.Tensor | Sequence[torch.Tensor],
        decodes: Sequence[Request] = (),
        starts: Sequence[int] = (),
    ) -> bool:
        """Keep one step's rows (``features`` [sum of counts, F], or blocks of them in order, as a
        held run of plain steps captured them): first one row per request of ``decodes`` at
        ``starts`` (a plain step's decoding requests), then the ``runs``' rows, in order. The
        lists are kept as they are: the caller must not change them. True: the buffer is full,
        take the writes now."""
        self._defers += 1
        if self._defers % DROP_EVERY == 0:
            self._drop_departed()
        key, self._next_key = self._next_key, self._next_key + 1
        step = _DeferredStep(
            decodes, starts, runs, (features,) if isinstance(features, torch.Tensor) else features
        )
        self._steps[key] = step
        self._bytes += step.nbytes
        return len(self._steps) >= self.max_steps or self._bytes >= self.max_bytes

    def take(self, alloc: PageAllocator, only: Iterable[Request] | None = None) -> ContextWrites | None:
        """Every pending write of requests still running (of ``only`` when given), for positions
        they have computed, with the slots those positions hold now. Taken rows leave the buffer;
        without ``only`` so does everything else."""
        wanted = None if only is None else {id(r) for r in only}
        steps = self._steps
        picked = _Picked()
        touched: dict[int, set[int]] = {}  # step -> the wanted requests it holds rows of
        for key, step in steps.items():
            for run, row in zip(step.runs, step.rows(), strict=True):
                req = run.request
                rid = id(req)
                if rid in step.taken or (wanted is not None and rid not in wanted):
                    continue
                touched.setdefault(key, set()).add(rid)
                if req.status is not Status.RUNNING:
                    continue
                keep = min(run.num_tokens, req.num_computed - run.start)
                if keep > 0:
                    picked.add(req, key, row, keep, run.start)
        writes = self._gather(alloc, steps, picked) if picked.requests else None
        if wanted is None:
            self._steps, self._bytes, self._keeps_oldest = {}, 0, None
        else:
            for key, rids in touched.items():
                step = steps[key]
                step.taken.update(rids)
                if all(id(run.request) in step.taken for run in step.runs):
                    self._forget(key)
            if self._keeps_oldest is not None and id(self._keeps_oldest[1]) in wanted:
                self._keeps_oldest = None  # taken: no longer what keeps the oldest step
        return writes

    @staticmethod
    def _gather(alloc: PageAllocator, steps: dict[int, _DeferredStep], picked: _Picked) -> ContextWrites:
        segments = [s for key in picked.requests for s in picked.segments[key]]
        counts = np.array([c for _, _, c, _ in segments])
        offsets = np.cumsum(counts) - counts  # each segment's first row in the result
        within = np.arange(int(counts.sum())) - np.repeat(offsets, counts)
        involved = dict.fromkeys(s for s, _, _, _ in segments)
        if len(segments) > 4 * len(involved):  # many rows per step (a whole catch-up): one gather
            base, total = {}, 0
            for key in involved:
                base[key] = total
                total += steps[key].features.shape[0]
            starts = np.array([base[s] + r for s, r, _, _ in segments])
            index = torch.from_numpy(np.repeat(starts, counts) + within)
            features = torch.cat([steps[key].features for key in involved])[index]
        else:  # a few requests: their rows only
            features = torch.cat([steps[s].features[r : r + c] for s, r, c, _ in segments])
        positions = torch.from_numpy(np.repeat(np.array([p for _, _, _, p in segments]), counts) + within)
        slots, at, prompt_rows = [], 0, 0
        for key, req in picked.requests.items():
            n = sum(c for _, _, c, _ in picked.segments[key])
            slots.append(alloc.slots_at(req.table, positions[at : at + n]))
            at += n
            prompt = len(req.prompt_ids)
            prompt_rows += sum(max(0, min(c, prompt - p)) for _, _, c, p in picked.segments[key])
        requests = tuple(picked.requests.values())
        return ContextWrites(features, positions, torch.cat(slots), prompt_rows, requests)

    def _forget(self, key: int) -> None:
        step = self._steps.pop(key, None)
        if step is not None:
            self._bytes -= step.nbytes
        if self._keeps_oldest is not None and self._keeps_oldest[0] == key:
            self._keeps_oldest = None

    def _drop_departed(self) -> None:
        """Forget the oldest steps once none of their requests (not yet taken) runs any more."""
        while self._steps:
            key, oldest = next(iter(self._steps.items()))
            hint = self._keeps_oldest
            if hint is not None and hint[0] == key and hint[1].status is Status.RUNNING:
                return
            taken = oldest.taken
            running = next(
                (r for r in oldest.requests() if r.status is Status.RUNNING and id(r) not in taken),
                None,
            )
            if running is not None:
                self._keeps_oldest = (key, running)
                return
            self._forget(key)  # not running: none of its rows will be written
