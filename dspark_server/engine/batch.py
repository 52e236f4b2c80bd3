"""Packing many sequences' new tokens into one ragged batch for a single forward pass."""

from __future__ import annotations

from dataclasses import dataclass

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
    """Build the packed batch; pages for ``start + len(token_ids)`` must already be reserved."""
    if not chunks:
        raise ValueError("cannot pack an empty batch")
    ids: list[int] = []
    offsets: list[int] = []
    lengths: list[int] = []
    positions: list[torch.Tensor] = []
    slots: list[torch.Tensor] = []
    kv_slots: list[torch.Tensor] = []
    for c in chunks:
        n = len(c.token_ids)
        if n == 0:
            raise ValueError("a chunk must add at least one token")
        offsets.append(len(ids))
        lengths.append(n)
        ids.extend(c.token_ids)
        positions.append(torch.arange(c.start, c.start + n))
        seq_slots = allocator.slots(c.table, 0, c.start + n)
        kv_slots.append(seq_slots)
        slots.append(seq_slots[c.start :])
    return PackedBatch(
        input_ids=torch.tensor(ids, dtype=torch.long),
        positions=torch.cat(positions),
        slot_mapping=torch.cat(slots),
        layout=PagedLayout.causal(lengths, kv_slots),
        offsets=tuple(offsets),
        lengths=tuple(lengths),
    )
