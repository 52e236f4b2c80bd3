"""Admission, chunked prefill, the running set and preemption -> the work of the next step.

Every request advances by feeding ``all_ids[num_computed : num_computed + n]``: a prefill chunk, a
recompute after preemption, or (n = 1) a decode. When a chunk reaches the newest token, the
forward's last logits row yields the next token. Decodes always run; prefill chunks fill the rest
of the step's token budget, so a long prompt cannot stall the running requests.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from dspark_server.config import EngineConfig
from dspark_server.engine.kv_cache import PageAllocator
from dspark_server.engine.request import Request, Status


@dataclass(frozen=True)
class ScheduledChunk:
    """Feed ``all_ids[start : start + num_tokens]``; fixed when scheduled, valid after the forward."""

    request: Request
    start: int
    num_tokens: int
    completes: bool  # the chunk feeds the newest token, so its last row samples a new one

    @classmethod
    def next_for(cls, request: Request, num_tokens: int) -> ScheduledChunk:
        start = request.num_computed
        return cls(request, start, num_tokens, start + num_tokens == request.num_tokens)

    @property
    def token_ids(self) -> list[int]:
        return self.request.all_ids[self.start : self.start + self.num_tokens]


@dataclass(frozen=True)
class SchedulerOutput:
    decodes: list[Request]  # requests whose whole history is cached except the newest token
    prefills: list[ScheduledChunk]
    preempted: list[Request]

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    def __init__(
        self,
        cfg: EngineConfig,
        allocator: PageAllocator,
        decode_lookahead: int = 0,
        prefix_needs_context: bool = False,
    ) -> None:
        """``decode_lookahead``: extra cache positions a decode may write (γ for speculation):
        reserved in the KV cache, not charged to the step's token budget.
        ``prefix_needs_context``: a cached prefix is reused only where the drafter's K/V of its
        pages are written too (speculative modes: a request may draft; the engine updates it
        from the draft gate's latest choice). Where it is off, a request that starts from pages
        without them is marked ``context_gap`` and never drafts."""
        self.cfg = cfg
        self.allocator = allocator
        self.decode_lookahead = decode_lookahead
        self.prefix_needs_context: Callable[[Request], bool] = lambda request: prefix_needs_context
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Take a request out of the queues and give its KV pages back."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        # a failed step may have left its positions half written: nothing of it is cached
        failed = request.finish_reason == "error"
        self.allocator.release(request.table, None if failed else request.all_ids)

    def schedule(self) -> SchedulerOutput:
        preempted: list[Request] = []
        decodes: list[Request] = []
        budget = self.cfg.max_batch_tokens
        for req in list(self.running):
            if req not in self.running or not req.is_decoding:
                continue
            need = req.num_tokens + self.decode_lookahead
            while not self.allocator.reserve(req.table, need):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req in self.running:
                decodes.append(req)
                self._name_full_pages(req)
                # Only the anchor token is charged: drafts are verified in what prefill leaves
                # (the speculative step caps sum l by it), so prefill gets what plain decoding
                # would give it.
                budget -= 1
        prefills = self._schedule_prefills(max(budget, 1) if not decodes else budget)
        return SchedulerOutput(decodes, prefills, preempted)

    def _schedule_prefills(self, budget: int) -> list[ScheduledChunk]:
        chunks: list[ScheduledChunk] = []
        candidates = [r for r in self.running if not r.is_decoding]
        for req in candidates:
            if budget <= 0:
                return chunks
            chunk = self._chunk(req, budget)
            if chunk is None:
                break
            chunks.append(chunk)
            budget -= chunk.num_tokens
        while budget > 0 and self.waiting and len(self.running) < self.cfg.max_running:
            req = self.waiting[0]
            found = None
            if not req.table.pages:
                found = self.allocator.match_prefix(req.table, req.all_ids, self.prefix_needs_context(req))
            chunk = self._chunk(req, budget)
            if chunk is None:
                self.allocator.release(req.table)  # the cached pages wait in the cache, not here
                break
            cache = self.allocator.cache
            if found is not None and cache is not None:
                cache.record(req.num_tokens - 1, found)
                req.context_gap = not all(
                    cache.has_context(p) for p in req.table.pages[: found // cache.page_size]
                )
                req.drafter_context = 0 if req.context_gap else found
                if req.cached_tokens is None:  # what its usage reports: the first admission's
                    req.cached_tokens = found
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            chunks.append(chunk)
            budget -= chunk.num_tokens
        return chunks

    def _chunk(self, req: Request, budget: int) -> ScheduledChunk | None:
        n = min(req.num_tokens - req.num_computed, budget, self.cfg.prefill_chunk)
        if n <= 0 or not self.allocator.reserve(req.table, req.num_computed + n):
            return None
        self._name_full_pages(req)  # a long prompt's chunks so far
        return ScheduledChunk.next_for(req, n)

    def _name_full_pages(self, req: Request) -> None:
        """Offer the request's newly filled pages to the prefix cache. The check comes first:
        it runs for every decoding request at every step, and ``all_ids`` builds a list."""
        alloc = self.allocator
        if alloc.cache is not None and req.table.length >= (req.table.named + 1) * alloc.page_size:
            alloc.name_full_pages(req.table, req.all_ids)

    def _preempt(self, req: Request) -> None:
        """Recompute-style preemption: drop the cache, keep the tokens, requeue at the front. Its
        full pages stay in the prefix cache, where they may still be when it runs again."""
        self.running.remove(req)
        self.allocator.release(req.table, req.all_ids)
        req.drafter_context = 0  # recomputed from its prompt when it runs again
        req.status = Status.WAITING
        self.waiting.appendleft(req)
