"""The gather path (``attention_impl="gather"``): each layer copies every sequence's whole KV
history into a padded tensor with ``index_select`` and runs SDPA over it.

Kept as the reference the in-place paths are measured and tested against (benchmarks/
attention_speed.py, tests/test_paged_attention.py); the paged paths in ``attention`` replace it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from dspark_server.models.paged_layout import PagedLayout

# Sequences adding at most this many tokens (decodes, verification blocks) share one padded
# attention call; longer prefill chunks get a call of their own.
SMALL_QUERY = 32


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


def gather_attend(
    groups: tuple[AttentionGroup, ...], q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> torch.Tensor:
    out = torch.empty_like(q)
    for g in groups:
        qg = q[g.q_index].transpose(1, 2)  # [G, Hq, Qmax, D]
        kg = gather_slots(k_cache, g.kv_slots, g.kv_range).transpose(1, 2)  # [G, Hkv, Kmax, D]
        vg = gather_slots(v_cache, g.kv_slots, g.kv_range).transpose(1, 2)
        og = sdpa(qg, kg, vg, g.mask).transpose(1, 2)  # [G, Qmax, Hq, D]
        out[g.q_index[g.q_valid]] = og[g.q_valid]
    return out


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


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def build_groups(layout: PagedLayout) -> tuple[AttentionGroup, ...]:
    """One padded group for the short queries, one group per long prefill chunk."""
    q_index = [torch.arange(int(s), int(s) + n) for s, n in zip(layout.q_start, layout.q_lens, strict=True)]
    positions = [layout.kv_limit[i] - 1 for i in q_index]
    kv_slots = [layout.seq_slots(r) for r in range(layout.num_seqs)]
    small = [i for i, n in enumerate(layout.q_lens) if n <= SMALL_QUERY]
    large = [i for i, n in enumerate(layout.q_lens) if n > SMALL_QUERY]
    groups: list[AttentionGroup] = []
    if small:
        groups.append(
            build_group(
                [q_index[i] for i in small], [kv_slots[i] for i in small], [positions[i] for i in small]
            )
        )
    for i in large:
        groups.append(build_group([q_index[i]], [kv_slots[i]], [positions[i]]))
    return tuple(groups)


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
