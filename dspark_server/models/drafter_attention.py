"""How the drafter's block attends: to its request's context K/V in the pool (keys before the
anchor, written by ``DSparkDrafter.write_context``) and bidirectionally to its own g tokens."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from dspark_server.models.attention import KVPool, paged_attend
from dspark_server.models.attention_gather import contiguous_range, gather_slots
from dspark_server.models.paged_layout import PagedLayout

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def paged_block_attend(pool: KVPool, layer: int, layout: PagedLayout) -> Attend:
    """Draft layer ``layer``: context keys read in place from the pool (``layout``: each block's
    queries and its context slots) plus the block's own new keys, unmasked."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return paged_attend(q, pool.k[layer], pool.v[layer], layout, pool.impl, extra=(k, v))[0]

    return attend


def gather_attends(
    pool: KVPool,
    ctx_slots: torch.Tensor,
    ctx_lens: torch.Tensor,
    r: int,
    g: int,
    dims: tuple[int, int, int],
    num_layers: int,
) -> list[Attend]:
    """The gather path (impl "gather"): every layer copies all context K/V into a padded tensor."""
    hq, hkv, d = dims
    cmax = ctx_slots.shape[1]
    key_ok = torch.cat(
        [torch.arange(cmax)[None, :] < ctx_lens[:, None], torch.ones(r, g, dtype=torch.bool)], dim=1
    )
    mask = key_ok[:, None, None, :]  # [R, 1, 1, Cmax + g]
    kv_range = contiguous_range(ctx_slots[0]) if r == 1 else None

    def make(i: int) -> Attend:
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kc = gather_slots(pool.k[i], ctx_slots, kv_range).to(k.dtype)  # [R, Cmax, Hkv, D]
            vc = gather_slots(pool.v[i], ctx_slots, kv_range).to(v.dtype)
            kk = torch.cat([kc, k.view(r, g, hkv, d)], dim=1).transpose(1, 2)
            vv = torch.cat([vc, v.view(r, g, hkv, d)], dim=1).transpose(1, 2)
            qq = q.view(r, g, hq, d).transpose(1, 2)
            out = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, enable_gqa=hq != hkv)
            return out.transpose(1, 2).reshape(r * g, hq, d)

        return attend

    return [make(i) for i in range(num_layers)]
