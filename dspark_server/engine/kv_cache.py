"""Paged KV-cache bookkeeping: which pages of the pool each sequence owns.

Capacity is fixed at start: ``num_pages`` pages of ``page_size`` token slots. A sequence's cache
is a page table; token position p lives in slot ``pages[p // page_size] * page_size + p % page_size``.
The target's and the drafter's KV pools are indexed by the same slots, so one page table covers
both and a rollback truncates both at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class PageTable:
    pages: list[int] = field(default_factory=list)
    length: int = 0  # tokens whose K/V are written in the cache


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError("num_pages and page_size must be positive")
        self.num_pages = num_pages
        self.page_size = page_size
        # Page 0 is never handed out: padding entries of attention groups point at slot 0.
        self._free: list[int] = list(range(num_pages - 1, 0, -1))

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def capacity_pages(self) -> int:
        return self.num_pages - 1

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def pages_needed(self, table: PageTable, new_length: int) -> int:
        return max(0, -(-new_length // self.page_size) - len(table.pages))

    def can_reserve(self, table: PageTable, new_length: int) -> bool:
        return self.pages_needed(table, new_length) <= len(self._free)

    def reserve(self, table: PageTable, new_length: int) -> bool:
        """Give the table enough pages to hold ``new_length`` tokens; all or nothing."""
        need = self.pages_needed(table, new_length)
        if need > len(self._free):
            return False
        for _ in range(need):
            table.pages.append(self._free.pop())
        return True

    def truncate(self, table: PageTable, new_length: int) -> None:
        """Forget positions >= new_length and return pages no longer needed."""
        if new_length < 0 or new_length > table.length:
            raise ValueError(f"cannot truncate a cache of length {table.length} to {new_length}")
        table.length = new_length
        keep = -(-new_length // self.page_size)
        while len(table.pages) > keep:
            self._free.append(table.pages.pop())

    def release(self, table: PageTable) -> None:
        self._free.extend(reversed(table.pages))
        table.pages.clear()
        table.length = 0

    def slots(self, table: PageTable, start: int, end: int) -> torch.Tensor:
        """Slot indices of positions start..end-1 (pages must already be reserved)."""
        return torch.from_numpy(self.slot_run(table, start, end - start))

    def slot_matrix(self, tables: Sequence[PageTable], lengths: np.ndarray) -> np.ndarray:
        """[R, max(lengths)] int64: the slots of positions 0 .. lengths[r] - 1 of table r, padded
        with slot 0 (page 0, never handed out); the pages must already be reserved. NumPy: at
        one request of ~600 positions this is a few microseconds, the tensor ops ~50."""
        ps, r = self.page_size, len(tables)
        kmax = int(lengths.max()) if r else 0
        need = -(-lengths // ps)
        width = int(need.max()) if r else 0
        pages = np.zeros((r, width), dtype=np.int64)
        for i, (table, n) in enumerate(zip(tables, need.tolist(), strict=True)):
            if n > len(table.pages):
                end = int(lengths[i])
                raise ValueError(f"positions up to {end} are not reserved ({len(table.pages)} pages)")
            pages[i, :n] = table.pages[:n]
        slots = (pages[:, :, None] * ps + np.arange(ps)).reshape(r, width * ps)[:, :kmax]
        return np.where(np.arange(kmax)[None, :] < lengths[:, None], slots, 0)

    def slot_run(self, table: PageTable, start: int, count: int) -> np.ndarray:
        """[count] int64: the slots of positions start .. start + count - 1 (reserved pages)."""
        end = start + count
        if end > len(table.pages) * self.page_size:
            raise ValueError(f"positions up to {end} are not reserved ({len(table.pages)} pages)")
        ps = self.page_size
        first = start // ps
        pages = np.asarray(table.pages[first : -(-end // ps)], dtype=np.int64)
        at = np.arange(start, end)
        return pages[at // ps - first] * ps + at % ps

    def slots_at(self, table: PageTable, positions: torch.Tensor) -> torch.Tensor:
        """Slot indices of the given positions (pages must already be reserved)."""
        if positions.numel() and int(positions.max()) >= len(table.pages) * self.page_size:
            end = int(positions.max()) + 1
            raise ValueError(f"positions up to {end} are not reserved ({len(table.pages)} pages)")
        pages = torch.tensor(table.pages, dtype=torch.long)
        return pages[positions // self.page_size] * self.page_size + positions % self.page_size
