"""Packing many sequences' new tokens into one ragged batch for a single forward pass."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dspark_server.engine.kv_cache import PageAllocator, PageTable
from dspark_server.models.attention import KVPool, PagedAttention
from dspark_server.models.paged_layout import PagedLayout


@dataclass(frozen=True)
class SeqChunk:
    """New tokens of one sequence, placed after ``start`` tokens already in its cache."""

    table: PageTable
    start: int
    token_ids: list[int]


@dataclass(frozen=True)
class PackedBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T]
    layout: PagedLayout  # each chunk's query rows and key slots (it attends to its cache in place)
    offsets: tuple[int, ...]  # index of each chunk's first token in the packed dimension
    lengths: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def attention(self, pool: KVPool) -> PagedAttention:
        return PagedAttention(pool, self.slot_mapping, self.layout)

    def last_rows(self) -> torch.Tensor:
        """Packed index of each chunk's last token."""
        return torch.tensor([o + n - 1 for o, n in zip(self.offsets, self.lengths, strict=True)])


def pack(chunks: list[SeqChunk], allocator: PageAllocator) -> PackedBatch:
    """Build the packed batch; pages for ``start + len(token_ids)`` must already be reserved.

    The per-token and per-chunk vectors (ids, positions, new-token slots, visible key counts,
    query starts and lengths) are built in NumPy from Python lists and become tensors without a
    copy; every sequence's key slots come from one padded page matrix. NumPy's calls cost about a
    microsecond where PyTorch's cost five to ten on tensors this small: at one decoding request
    packing takes about 30 µs (113 with the same steps as tensor ops), at 64 about 250 (620)."""
    if not chunks:
        raise ValueError("cannot pack an empty batch")
    r = len(chunks)
    ids: list[int] = []
    for c in chunks:
        ids.extend(c.token_ids)
    if len(ids) == r:  # one token per sequence (decoding): no per-token expansion to do
        if any(not c.token_ids for c in chunks):
            raise ValueError("a chunk must add at least one token")
        lengths = np.ones(r, dtype=np.int64)
        positions = np.fromiter((c.start for c in chunks), dtype=np.int64, count=r)
        kv_lens = positions + 1
        slots = allocator.slot_matrix([c.table for c in chunks], kv_lens)
        q_start = np.arange(r, dtype=np.int64)
        slot_mapping = slots[q_start, positions]
    else:
        lengths = np.fromiter((len(c.token_ids) for c in chunks), dtype=np.int64, count=r)
        if not lengths.all():
            raise ValueError("a chunk must add at least one token")
        starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=r)
        kv_lens = starts + lengths
        slots = allocator.slot_matrix([c.table for c in chunks], kv_lens)
        q_start = np.cumsum(lengths) - lengths
        # token t of chunk i sits at position starts[i] + (t - q_start[i])
        seq = np.repeat(np.arange(r), lengths)
        positions = starts[seq] + np.arange(len(ids)) - q_start[seq]
        slot_mapping = slots[seq, positions]
    q_lens = tuple(lengths.tolist())
    layout = PagedLayout(
        q_start=torch.from_numpy(q_start),
        q_len=torch.from_numpy(lengths),
        slots=torch.from_numpy(slots),  # a new contiguous array
        kv_limit=torch.from_numpy(positions + 1),  # a query sees the keys up to its own position
        q_lens=q_lens,
        kv_lens=tuple(kv_lens.tolist()),
    )
    return PackedBatch(
        input_ids=torch.from_numpy(np.asarray(ids, dtype=np.int64)),
        positions=torch.from_numpy(positions),
        slot_mapping=torch.from_numpy(slot_mapping),
        layout=layout,
        offsets=tuple(q_start.tolist()),
        lengths=q_lens,
    )
