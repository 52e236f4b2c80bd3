"""Automatic prefix caching: full KV pages kept after their request leaves, found again by content.

A page is named by the chain hash of the tokens it holds and of every token before it (page i's
hash covers tokens 0 .. (i + 1) * page_size - 1), so a new prompt reuses the longest run of
pages from the start whose hashes are known, as vLLM's automatic prefix caching and SGLang's radix
cache do, and its prefill starts after them. Only full pages of committed tokens (prompt or
output) are named: nothing writes them again, so any number of tables may hold one.

A named page that no table holds any more is idle: still findable, and the first to be taken back
(least recently left first) when the allocator has no free page. A request leaves its pages from
the last to the first, so a prompt's tail is evicted before its head, which other prompts are
likelier to share.

The drafter keeps its own K/V at the same slots, written from the target's captured features,
and a step that does not draft puts those writes off (engine/spec/deferred_context.py). A page
may therefore hold the target's K/V without the drafter's: ``context`` marks the slots whose
drafter K/V are written, and a lookup that needs them stops at the first page not fully marked.
Where the draft gate takes plain steps, a lookup takes pages without them too, and the request
that starts from such pages never drafts (``Request.context_gap``).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

HASH_BYTES = 16


def extend_hashes(hashes: list[bytes], tokens: Sequence[int], page_size: int, count: int) -> None:
    """Grow ``hashes`` (the chain hashes of a sequence's first pages) to ``count`` pages of
    ``tokens``, which must hold at least ``count * page_size`` tokens."""
    if len(tokens) < count * page_size:
        raise ValueError(f"{len(tokens)} tokens do not fill {count} pages of {page_size}")
    previous = hashes[-1] if hashes else b""
    for i in range(len(hashes), count):
        page = np.asarray(tokens[i * page_size : (i + 1) * page_size], dtype=np.int64)
        previous = hashlib.blake2b(previous + page.tobytes(), digest_size=HASH_BYTES).digest()
        hashes.append(previous)


class PrefixCache:
    """Which pages hold which token prefixes, which of them no table holds (idle, evictable), and
    which slots hold the drafter's K/V. Reference counts stay with the allocator."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self._page_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # least recently left first
        self.context = np.zeros(num_pages * page_size, dtype=bool)  # drafter K/V written
        self.queries = 0  # prompt tokens looked up by admitted requests (each prompt less its last)
        self.hits = 0  # of those, tokens found

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def record(self, looked_up: int, found: int) -> None:
        """A request was admitted after looking up ``looked_up`` tokens and finding ``found``."""
        self.queries += looked_up
        self.hits += found

    def named(self, page: int) -> bool:
        return page in self._hash_of

    def lookup(self, hashes: Sequence[bytes], need_context: bool) -> list[int]:
        """The pages of the longest run of ``hashes`` from the first that are cached (whose
        drafter K/V are all written too, with ``need_context``)."""
        pages: list[int] = []
        for h in hashes:
            page = self._page_of.get(h)
            if page is None or (need_context and not self.has_context(page)):
                break
            pages.append(page)
        return pages

    def name(self, page: int, page_hash: bytes) -> int | None:
        """``page`` holds the prefix ``page_hash`` names. A prefix already cached keeps its page,
        unless that page is idle and lacks drafter K/V ``page`` has: then ``page`` takes its
        name and the old page is returned, free."""
        old = self._page_of.get(page_hash)
        if old is None:
            if page not in self._hash_of:
                self._page_of[page_hash] = page
                self._hash_of[page] = page_hash
            return None
        if old == page or old not in self._idle or not self.has_context(page) or self.has_context(old):
            return None
        del self._idle[old]
        del self._hash_of[old]
        self._page_of[page_hash] = page
        self._hash_of[page] = page_hash
        return old

    def has_context(self, page: int) -> bool:
        """Every slot of ``page`` holds the drafter's K/V."""
        ps = self.page_size
        return bool(self.context[page * ps : (page + 1) * ps].all())

    def park(self, page: int) -> None:
        """No table holds the named ``page`` any more: keep it findable, evictable."""
        self._idle[page] = None

    def claim(self, page: int) -> None:
        """A table takes the idle ``page`` again."""
        del self._idle[page]

    def evict(self) -> int:
        """Forget the idle page left longest ago and return it (``num_idle`` must be > 0)."""
        page, _ = self._idle.popitem(last=False)
        del self._page_of[self._hash_of.pop(page)]
        return page

    def reset(self, page: int) -> None:
        """``page`` is handed out afresh: its slots hold nothing of the drafter's yet."""
        ps = self.page_size
        self.context[page * ps : (page + 1) * ps] = False

    def mark_context(self, slots: np.ndarray) -> None:
        """The drafter's K/V of these slots are written."""
        self.context[slots] = True
