"""Paged KV-cache bookkeeping: which pages of the pool each sequence owns.

Capacity is fixed at start: ``num_pages`` pages of ``page_size`` token slots. A sequence's cache
is a page table; token position p lives in slot ``pages[p // page_size] * page_size + p % page_size``.
The target's and the drafter's KV pools are indexed by the same slots, so one page table covers
both and a rollback truncates both at once.

With a prefix cache (engine/prefix_cache.py) pages are counted: a full page of committed tokens
may be held by several tables, and outlives them, idle, until a page is needed and none is free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from dspark_server.engine.prefix_cache import PrefixCache, extend_hashes


@dataclass
class PageTable:
    pages: list[int] = field(default_factory=list)
    length: int = 0  # tokens whose K/V are written in the cache
    # the slot of every position its pages hold (the first len(pages) * page_size entries are
    # valid; kept by the allocator as pages come and go): a step reads its slots as a slice
    # instead of rebuilding them from the page list (at one request of ~600 positions that took
    # ~5% of a plain step on the demo pair in a py-spy record)
    slots: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64), repr=False)
    # prefix caching: the chain hashes of its first full pages (prefix_cache.extend_hashes), and
    # how many of its pages were offered to the cache
    hashes: list[bytes] = field(default_factory=list, repr=False)
    named: int = 0


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int, prefix_cache: bool = False) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError("num_pages and page_size must be positive")
        self.num_pages = num_pages
        self.page_size = page_size
        # Page 0 is never handed out: padding entries of attention groups point at slot 0.
        self._free: list[int] = list(range(num_pages - 1, 0, -1))
        self._refs = [0] * num_pages  # tables holding each page
        self.cache = PrefixCache(num_pages, page_size) if prefix_cache else None

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def capacity_pages(self) -> int:
        return self.num_pages - 1

    @property
    def free_pages(self) -> int:
        """Pages a table can get: free ones and the cache's idle ones."""
        return len(self._free) + (self.cache.num_idle if self.cache is not None else 0)

    def pages_needed(self, table: PageTable, new_length: int) -> int:
        return max(0, -(-new_length // self.page_size) - len(table.pages))

    def can_reserve(self, table: PageTable, new_length: int) -> bool:
        return self.pages_needed(table, new_length) <= self.free_pages

    def reserve(self, table: PageTable, new_length: int) -> bool:
        """Give the table enough pages to hold ``new_length`` tokens; all or nothing."""
        need = self.pages_needed(table, new_length)
        if need > self.free_pages:
            return False
        if need:
            first = len(table.pages)
            for _ in range(need):
                table.pages.append(self._take())
            self._extend_slots(table, first)
        return True

    def _take(self) -> int:
        """A page for one table: a free one, else the cache's idle page left longest ago."""
        cache = self.cache
        if cache is None:
            page = self._free.pop()
        else:
            page = self._free.pop() if self._free else cache.evict()
            cache.reset(page)
        self._refs[page] = 1
        return page

    def _drop(self, page: int) -> None:
        """One table fewer holds ``page``: at none it is free, or idle where the cache names it."""
        self._refs[page] -= 1
        if self._refs[page] == 0:
            if self.cache is not None and self.cache.named(page):
                self.cache.park(page)
            else:
                self._free.append(page)

    def _extend_slots(self, table: PageTable, first: int) -> None:
        """Write the slots of pages ``first..`` into the table's slot array (grown by doubling)."""
        ps = self.page_size
        end = len(table.pages) * ps
        if table.slots.shape[0] < end:
            grown = np.empty(max(end, 2 * table.slots.shape[0]), dtype=np.int64)
            grown[: first * ps] = table.slots[: first * ps]
            table.slots = grown
        new = np.asarray(table.pages[first:], dtype=np.int64)
        table.slots[first * ps : end] = (new[:, None] * ps + np.arange(ps)).ravel()

    def truncate(self, table: PageTable, new_length: int) -> None:
        """Forget positions >= new_length and return pages no longer needed."""
        if new_length < 0 or new_length > table.length:
            raise ValueError(f"cannot truncate a cache of length {table.length} to {new_length}")
        if new_length < table.named * self.page_size:  # a cached page is never written again
            raise ValueError(f"cannot truncate into the table's {table.named} cached pages")
        table.length = new_length
        keep = -(-new_length // self.page_size)
        while len(table.pages) > keep:
            self._drop(table.pages.pop())

    def release(self, table: PageTable, tokens: Sequence[int] | None = None) -> None:
        """Give the table's pages back; with ``tokens`` (the sequence's tokens, at least its
        cached ones) its full pages stay in the prefix cache. The last page goes first, so the
        cache evicts a sequence's tail before its head."""
        if tokens is not None:
            # all its full pages once more: a page named while its drafter K/V were put off may
            # now replace an idle copy that lacks them
            table.named = 0
            self.name_full_pages(table, tokens)
        for page in reversed(table.pages):
            self._drop(page)
        table.pages.clear()
        table.length = 0
        table.hashes.clear()
        table.named = 0

    def name_full_pages(self, table: PageTable, tokens: Sequence[int]) -> None:
        """Offer the table's full pages of cached tokens to the prefix cache (no-op without one);
        ``tokens``: the sequence's tokens. A page is full when the cache holds all its positions
        and their tokens are known: a request that stops inside a speculative round keeps the
        K/V of drafts accepted past its last token, which no token of the sequence names."""
        full = min(table.length, len(tokens)) // self.page_size
        if self.cache is None or full <= table.named:
            return
        extend_hashes(table.hashes, tokens, self.page_size, full)
        for i in range(table.named, full):
            replaced = self.cache.name(table.pages[i], table.hashes[i])
            if replaced is not None:  # an idle copy without the drafter's K/V
                self._free.append(replaced)
        table.named = full

    def match_prefix(self, table: PageTable, tokens: Sequence[int], need_context: bool) -> int:
        """Start the empty ``table`` with the cached pages of the longest prefix of ``tokens``,
        leaving at least the last token to compute (its logits give the next token). Returns the
        tokens found. ``need_context``: only pages whose drafter K/V are written too."""
        cache = self.cache
        if cache is None or table.pages:
            return 0
        full = (len(tokens) - 1) // self.page_size
        if full < 1:
            return 0
        extend_hashes(table.hashes, tokens, self.page_size, full)
        pages = cache.lookup(table.hashes, need_context)
        for page in pages:
            if self._refs[page] == 0:
                cache.claim(page)
            self._refs[page] += 1
        table.pages.extend(pages)
        if pages:
            self._extend_slots(table, 0)
        table.named = len(pages)
        table.length = len(pages) * self.page_size
        return table.length

    def slots(self, table: PageTable, start: int, end: int) -> torch.Tensor:
        """Slot indices of positions start..end-1 (pages must already be reserved)."""
        return torch.from_numpy(self.slot_run(table, start, end - start))

    def slot_matrix(self, tables: Sequence[PageTable], lengths: np.ndarray) -> np.ndarray:
        """[R, max(lengths)] int64: the slots of positions 0 .. lengths[r] - 1 of table r, padded
        with slot 0 (page 0, never handed out); the pages must already be reserved. NumPy: at
        one request of ~600 positions this is a few microseconds, the tensor ops ~50."""
        counts = lengths.tolist()
        if len(counts) == 1:  # one sequence: its slots, as they are (a copy: the table changes)
            self._check_reserved(tables[0], counts[0])
            return tables[0].slots[None, : counts[0]].copy()
        out = np.zeros((len(counts), max(counts, default=0)), dtype=np.int64)
        for i, (table, n) in enumerate(zip(tables, counts, strict=True)):
            self._check_reserved(table, n)
            out[i, :n] = table.slots[:n]
        return out

    def _check_reserved(self, table: PageTable, end: int) -> None:
        if end > len(table.pages) * self.page_size:
            raise ValueError(f"positions up to {end} are not reserved ({len(table.pages)} pages)")

    def slot_run(self, table: PageTable, start: int, count: int) -> np.ndarray:
        """[count] int64: the slots of positions start .. start + count - 1 (reserved pages)."""
        self._check_reserved(table, start + count)
        return table.slots[start : start + count].copy()

    def slots_at(self, table: PageTable, positions: torch.Tensor) -> torch.Tensor:
        """Slot indices of the given positions (pages must already be reserved)."""
        if positions.numel():
            self._check_reserved(table, int(positions.max()) + 1)
        return torch.from_numpy(table.slots[positions.numpy()])
