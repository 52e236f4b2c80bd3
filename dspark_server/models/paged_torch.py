"""Paged attention in plain PyTorch: blocks of keys gathered a few at a time, online softmax.

The fallback of the C++ kernel (no compiler, float64, an unusual head size) with the same
contract: ``PagedLayout`` in, output and log-sum-exp out. Sequences adding at most ``SHORT_QUERY``
tokens (decodes, verification blocks, draft blocks) are padded together; each longer one (a
prefill chunk) runs alone, its keys read as views of the pool when its slots are consecutive.
Only ``KEY_BLOCK`` keys per sequence are copied at a time, never a whole history per layer.
"""

from __future__ import annotations

import torch
from torch.nn.utils.rnn import pad_sequence

from dspark_server.models.paged_layout import PagedLayout

SHORT_QUERY = 32
KEY_BLOCK = 256


def torch_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: PagedLayout, want_lse: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q [T, Hq, D], caches [S, Hkv, D] -> out [T, Hq, D] (and log-sum-exp [T, Hq] float32)."""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32) if want_lse else None
    short = [r for r, n in enumerate(layout.q_lens) if n <= SHORT_QUERY]
    groups = ([short] if short else []) + [[r] for r, n in enumerate(layout.q_lens) if n > SHORT_QUERY]
    for seqs in groups:
        rows, o, s = _group(q, k_cache, v_cache, layout, seqs)
        out[rows] = o.to(q.dtype)
        if lse is not None:
            lse[rows] = s.float()
    return out, lse


def _group(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: PagedLayout, seqs: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of the sequences ``seqs`` padded together -> (packed rows, out, lse) of their rows."""
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[1]
    rep = hq // hkv
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    starts = [int(layout.q_start[r]) for r in seqs]
    q_index = pad_sequence(
        [torch.arange(s, s + layout.q_lens[r]) for s, r in zip(starts, seqs, strict=True)], batch_first=True
    )  # [G, Qmax], padding repeats row 0 and is dropped at the end
    valid = torch.arange(q_index.shape[1])[None, :] < torch.tensor([layout.q_lens[r] for r in seqs])[:, None]
    limit = torch.where(valid, layout.kv_limit[q_index], 0)  # [G, Qmax]
    g, qmax = q_index.shape
    # [G, Hkv, Qmax * rep, D]: the rep query heads sharing kv head h, row-major (row, head).
    qg = q[q_index].to(cdt).view(g, qmax, hkv, rep, d).permute(0, 2, 1, 3, 4).reshape(g, hkv, qmax * rep, d)
    qg = qg * d**-0.5
    limit = limit.repeat_interleave(rep, dim=1)[:, None, :, None]  # [G, 1, Qmax * rep, 1]
    kmax = max(layout.kv_lens[r] for r in seqs)
    slots = layout.slots[seqs, :kmax]
    first = int(slots[0, 0]) if len(seqs) == 1 and kmax else -1
    contiguous = first >= 0 and int(slots[0, -1]) - first == kmax - 1 and bool((slots.diff() == 1).all())
    m = torch.full((g, hkv, qmax * rep, 1), float("-inf"), dtype=cdt)
    l_sum = torch.zeros_like(m)
    acc = torch.zeros(g, hkv, qmax * rep, d, dtype=cdt)
    for j0 in range(0, kmax, KEY_BLOCK):
        j1 = min(kmax, j0 + KEY_BLOCK)
        if contiguous:
            kb, vb = k_cache[first + j0 : first + j1][None], v_cache[first + j0 : first + j1][None]
        else:
            idx = slots[:, j0:j1].reshape(-1)
            kb = k_cache.index_select(0, idx).view(g, j1 - j0, hkv, d)
            vb = v_cache.index_select(0, idx).view(g, j1 - j0, hkv, d)
        kb = kb.permute(0, 2, 3, 1).to(cdt)  # [G, Hkv, D, B]
        vb = vb.permute(0, 2, 1, 3).to(cdt)  # [G, Hkv, B, D]
        s = qg @ kb  # [G, Hkv, Qmax * rep, B]
        s = s.masked_fill(torch.arange(j0, j1) >= limit, float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
        m_safe = torch.where(torch.isinf(m_new), 0.0, m_new)  # rows that have seen no key yet
        p = torch.exp(s - m_safe)
        alpha = torch.exp(m - m_safe)
        l_sum = l_sum * alpha + p.sum(dim=-1, keepdim=True)
        acc = acc * alpha + p @ vb
        m = m_new
    out = acc / torch.where(l_sum > 0, l_sum, 1.0)
    lse = (m + torch.log(l_sum)).squeeze(-1)  # -inf for rows that see no key
    # back to [G, Qmax, Hq, D] / [G, Qmax, Hq], then the valid rows in packed order
    out = out.view(g, hkv, qmax, rep, d).permute(0, 2, 1, 3, 4).reshape(g, qmax, hq, d)
    lse = lse.view(g, hkv, qmax, rep).permute(0, 2, 1, 3).reshape(g, qmax, hq)
    return q_index[valid], out[valid], lse[valid]
