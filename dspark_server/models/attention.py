"""Attention backends: how a layer's new q/k/v meet the keys and values they attend to.

A model layer computes q, k, v for the T tokens of a packed batch and hands them to a backend.
The backend decides where keys live (a paged KV pool for serving, nothing for dense training)
and which keys each query may see. Backends are tensors only: they know nothing of requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence


class AttentionBackend(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] for the new tokens -> attention output [T, Hq, D]."""
        ...


class KVPool:
    """Key/value storage for every layer, addressed by flat slot index (page * page_size + offset)."""

    def __init__(
        self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> None:
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]


@dataclass(frozen=True)
class AttentionGroup:
    """Requests whose queries are padded together into one attention call.

    q_index [G, Qmax]: packed-token index of each query (padding repeats a valid index).
    q_valid [G, Qmax]: which entries are real queries.
    kv_slots [G, Kmax]: pool slot of each visible key (padding points at slot 0).
    mask [G, 1, Qmax, Kmax]: True where the query may attend to the key.
    """

    q_index: torch.Tensor
    q_valid: torch.Tensor
    kv_slots: torch.Tensor
    mask: torch.Tensor
    # (first slot, count) when the group is one sequence whose keys sit in consecutive slots:
    # then they are read as a view of the pool instead of being gathered.
    kv_range: tuple[int, int] | None = None


@dataclass(frozen=True)
class PagedAttention:
    """Writes the new tokens' k/v into the pool, then attends over each sequence's cached keys.

    The packed linear layers cost scale with the number of new tokens; attention is run per group
    so that single-token decodes are never padded to the length of a prefill chunk.
    """

    pool: KVPool
    slot_mapping: torch.Tensor  # [T] destination slot of each new token
    groups: tuple[AttentionGroup, ...]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]
        k_cache.index_copy_(0, self.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, self.slot_mapping, v.to(v_cache.dtype))
        out = torch.empty_like(q)
        for g in self.groups:
            qg = q[g.q_index].transpose(1, 2)  # [G, Hq, Qmax, D]
            kg = gather_slots(k_cache, g.kv_slots, g.kv_range).transpose(1, 2)  # [G, Hkv, Kmax, D]
            vg = gather_slots(v_cache, g.kv_slots, g.kv_range).transpose(1, 2)
            og = _sdpa(qg, kg, vg, g.mask).transpose(1, 2)  # [G, Qmax, Hq, D]
            out[g.q_index[g.q_valid]] = og[g.q_valid]
        return out


@dataclass(frozen=True)
class DenseCausalAttention:
    """Plain causal attention over a [batch, seq] block of tokens (training, no cache)."""

    batch: int
    seq_len: int

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, s = self.batch, self.seq_len
        qb = q.view(b, s, *q.shape[1:]).transpose(1, 2)
        kb = k.view(b, s, *k.shape[1:]).transpose(1, 2)
        vb = v.view(b, s, *v.shape[1:]).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            qb, kb, vb, is_causal=True, enable_gqa=qb.shape[1] != kb.shape[1]
        )
        return out.transpose(1, 2).reshape(q.shape)


def gather_slots(
    cache: torch.Tensor, slots: torch.Tensor, kv_range: tuple[int, int] | None = None
) -> torch.Tensor:
    """cache [S, H, D] rows at slots [G, K] -> [G, K, H, D] (index_select is several times faster
    than advanced indexing on CPU; a consecutive range is a view, no copy at all)."""
    if kv_range is not None:
        start, count = kv_range
        return cache[start : start + count].unsqueeze(0)
    return cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])


def contiguous_range(slots: torch.Tensor) -> tuple[int, int] | None:
    """(first, count) if the 1-D slot list is first, first+1, ..., else None."""
    n = slots.numel()
    if n == 0:
        return None
    first = int(slots[0])
    if int(slots[-1]) - first != n - 1 or not bool((slots.diff() == 1).all()):
        return None
    return first, n


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def build_group(
    q_index: list[torch.Tensor], kv_slots: list[torch.Tensor], q_positions: list[torch.Tensor]
) -> AttentionGroup:
    """Pad per-sequence query/key index tensors into one group with a causal-by-position mask.

    Key j of a sequence sits at position j (keys are the sequence's cache in order), so a query at
    position p sees keys 0..p.
    """
    lens = torch.tensor([len(x) for x in q_index])
    klens = torch.tensor([len(x) for x in kv_slots])
    qi = pad_sequence(q_index, batch_first=True)
    qp = pad_sequence(q_positions, batch_first=True, padding_value=-1)
    ks = pad_sequence(kv_slots, batch_first=True)
    qmax, kmax = qi.shape[1], ks.shape[1]
    qv = torch.arange(qmax)[None, :] < lens[:, None]
    qi = torch.where(qv, qi, qi[:, :1])  # padding repeats a real query index
    key_pos = torch.arange(kmax)
    mask = (key_pos[None, None, :] <= qp[:, :, None]) & (key_pos[None, None, :] < klens[:, None, None])
    mask |= ~qv[:, :, None]  # padded query rows attend to something so softmax stays finite
    kv_range = contiguous_range(kv_slots[0]) if len(kv_slots) == 1 else None
    return AttentionGroup(qi, qv, ks, mask[:, None], kv_range)
