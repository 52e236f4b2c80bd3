"""The page allocator's slot arrays: every step reads its slots from them, so after any sequence
of reserve / truncate / release they must equal the page-table formula."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from dspark_server.engine.kv_cache import PageAllocator, PageTable


def formula(table: PageTable, page_size: int, n: int) -> np.ndarray:
    return np.array([table.pages[p // page_size] * page_size + p % page_size for p in range(n)])


def test_slots_follow_the_pages_through_reserve_truncate_and_release() -> None:
    rng = random.Random(0)
    ps = 4
    alloc = PageAllocator(num_pages=64, page_size=ps)
    tables = [PageTable() for _ in range(5)]
    for _ in range(400):
        t = rng.choice(tables)
        op = rng.random()
        if op < 0.55:
            new_len = t.length + rng.randint(1, 9)
            if alloc.reserve(t, new_len):
                t.length = new_len
        elif op < 0.9 and t.length:
            alloc.truncate(t, rng.randint(0, t.length))
        else:
            alloc.release(t)
        live = [x for x in tables if x.length]
        if not live:
            continue
        lens = np.array([x.length for x in live])
        matrix = alloc.slot_matrix(live, lens)
        assert matrix.shape == (len(live), lens.max())
        for row, x in zip(matrix, live, strict=True):
            np.testing.assert_array_equal(row[: x.length], formula(x, ps, x.length))
            assert not row[x.length :].any()  # padding: slot 0
        x = live[0]
        start = rng.randint(0, x.length - 1)
        count = rng.randint(1, x.length - start)
        np.testing.assert_array_equal(
            alloc.slot_run(x, start, count), formula(x, ps, x.length)[start:][:count]
        )
        at = torch.tensor(rng.sample(range(x.length), min(3, x.length)))
        assert alloc.slots_at(x, at).tolist() == formula(x, ps, x.length)[at.numpy()].tolist()


def test_unreserved_positions_are_refused() -> None:
    alloc = PageAllocator(num_pages=8, page_size=4)
    t = PageTable()
    assert alloc.reserve(t, 5)
    for call in (
        lambda: alloc.slot_matrix([t], np.array([9])),
        lambda: alloc.slot_matrix([t, t], np.array([1, 9])),
        lambda: alloc.slot_run(t, 6, 3),
        lambda: alloc.slots_at(t, torch.tensor([8])),
    ):
        with pytest.raises(ValueError, match="not reserved"):
            call()


def test_a_returned_slot_row_is_not_changed_by_later_reservations() -> None:
    alloc = PageAllocator(num_pages=16, page_size=2)
    t = PageTable()
    alloc.reserve(t, 8)  # the table's slot array now holds 8 slots: later pages reuse it
    row = alloc.slot_matrix([t], np.array([3]))
    before = row.copy()
    alloc.truncate(t, 0)
    other = PageTable()
    alloc.reserve(other, 4)
    alloc.reserve(t, 8)
    np.testing.assert_array_equal(row, before)
