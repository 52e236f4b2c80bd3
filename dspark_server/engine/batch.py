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
    """Build the packed batch; pages for ``start + len(token_ids)`` must already be reserved.

    Vectorised over the chunks (a fixed handful of tensor ops, whatever their number): positions,
    new-token slots and every sequence's key slots come from one padded page matrix."""
    if not chunks:
        raise ValueError("cannot pack an empty batch")
    ps = allocator.page_size
    lengths = [len(c.token_ids) for c in chunks]
    if min(lengths) == 0:
        raise ValueError("a chunk must add at least one token")
    kv_lens = [c.start + n for c, n in zip(chunks, lengths, strict=True)]
    need = [-(-k // ps) for k in kv_lens]
    for c, k, m in zip(chunks, kv_lens, need, strict=True):
        if m > len(c.table.pages):
            raise ValueError(f"positions up to {k} are not reserved ({len(c.table.pages)} pages)")
    width = max(need)
    pages = torch.tensor([c.table.pages[:m] + [0] * (width - m) for c, m in zip(chunks, need, strict=True)])
    key_pos = torch.arange(max(kv_lens))
    kv_len = torch.tensor(kv_lens)
    slots = pages[:, key_pos // ps] * ps + key_pos % ps  # [R, Kmax]
    slots = torch.where(key_pos[None, :] < kv_len[:, None], slots, 0)  # padding: slot 0 (page 0)
    layout = PagedLayout.causal_padded(lengths, kv_lens, slots)
    positions = layout.kv_limit - 1  # a query sees the keys up to its own position
    seq = torch.repeat_interleave(torch.arange(len(chunks)), layout.q_len)
    return PackedBatch(
        input_ids=torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long),
        positions=positions,
        slot_mapping=slots[seq, positions],
        layout=layout,
        offsets=tuple(layout.q_start.tolist()),
        lengths=tuple(lengths),
    )
