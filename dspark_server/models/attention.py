"""Attention backends: how a layer's new q/k/v meet the keys and values they attend to.

A model layer computes q, k, v for the T tokens of a packed batch and hands them to a backend.
The backend decides where keys live (a paged KV pool for serving, nothing for dense training)
and which keys each query may see. Backends are tensors only: they know nothing of requests.

Serving reads the pool in place: ``paged_attend`` runs the C++ kernel of ``paged_kernel`` (float32
and bfloat16, common head sizes) or the blockwise PyTorch path of ``paged_torch``. A pool's
``impl`` chooses: "kernel" (fail if it cannot be built; the PyTorch path for what it does not
support), "torch", "gather" (the old copy-every-history path of ``attention_gather``), or "auto":
the kernel where it runs, else "gather" (measured faster than the blockwise PyTorch path on a
shared 2-core machine, benchmarks/attention_speed.py). The default is ``$DSPARK_ATTENTION``, else
"auto".
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from dspark_server.config import ATTENTION_IMPLS
from dspark_server.models.attention_gather import AttentionGroup, build_groups, gather_attend
from dspark_server.models.kernel_library import load_library
from dspark_server.models.paged_kernel import kernel_attention, kernel_supports
from dspark_server.models.paged_layout import PagedLayout
from dspark_server.models.paged_torch import torch_attention


class AttentionBackend(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] for the new tokens -> attention output [T, Hq, D]."""
        ...


def default_impl() -> str:
    impl = os.environ.get("DSPARK_ATTENTION", "auto")
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"DSPARK_ATTENTION={impl!r}: expected one of {ATTENTION_IMPLS}")
    return impl


class KVPool:
    """Key/value storage for every layer, addressed by flat slot index (page * page_size + offset).

    Layer l's keys are ``k[l]``, [num_slots, Hkv, D] = [num_pages, page_size, Hkv, D] in memory.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        impl: str | None = None,
    ) -> None:
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        self.impl = impl or default_impl()
        if self.impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention impl {self.impl!r}: expected one of {ATTENTION_IMPLS}")
        if self.impl in ("auto", "kernel"):
            kernel = load_library()  # built (or read from the cache) now, at start-up, not in a request
            if kernel is None and self.impl == "kernel":
                raise RuntimeError("attention impl 'kernel' requested but the C++ kernel could not be built")

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]


def resolve_impl(impl: str, q_dtype: torch.dtype, cache: torch.Tensor, num_heads: int) -> str:
    """The path a pool's ``impl`` takes for queries of this dtype / head count: "gather" or the
    impl ``paged_attend`` runs ("auto" becomes "kernel" where the kernel runs, else "gather")."""
    if impl != "auto":
        return impl
    fits = _kernel_fits(q_dtype, cache.dtype, cache.device.type, num_heads, cache.shape[1], cache.shape[-1])
    return "kernel" if fits and load_library() is not None else "gather"


@functools.cache
def _kernel_fits(q_dtype: torch.dtype, dtype: torch.dtype, device: str, hq: int, hkv: int, d: int) -> bool:
    probe = torch.empty(0, hq, d, dtype=q_dtype, device=device)
    return kernel_supports(probe, torch.empty(0, hkv, d, dtype=dtype, device=device))


def paged_attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: PagedLayout,
    impl: str = "auto",
    want_lse: bool = False,
    extra: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of q [T, Hq, D] over the keys ``layout`` assigns each row, read in place from
    caches [S, Hkv, D] -> out [T, Hq, D] and, if asked, log-sum-exp [T, Hq] (float32; -inf or a
    very negative number for a row that sees no key, whose output is then 0).

    ``extra`` = (k, v) [T, Hkv, D]: each query of a sequence also sees, unmasked, the k / v rows
    of that sequence's own queries (the drafter's block, bidirectional inside itself); the
    PyTorch path needs every sequence to have the same number of queries then."""
    if impl in ("auto", "kernel"):
        lib = load_library()
        if lib is None and impl == "kernel":
            raise RuntimeError("attention impl 'kernel' requested but the C++ kernel could not be built")
        if lib is not None and kernel_supports(q, k_cache):
            return kernel_attention(lib, q, k_cache, v_cache, layout, want_lse, extra)
    elif impl != "torch":
        raise ValueError(f"paged_attend does not run impl {impl!r}")
    out, lse = torch_attention(q, k_cache, v_cache, layout, want_lse or extra is not None)
    if extra is None:
        return out, lse
    return _with_own_block(q, out, lse, extra, layout, want_lse)


def _with_own_block(
    q: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    extra: tuple[torch.Tensor, torch.Tensor],
    layout: PagedLayout,
    want_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The PyTorch path's ``extra``: merge the pool part (out, lse) with each block's own keys."""
    assert lse is not None
    r, g = layout.num_seqs, layout.q_lens[0]
    if any(n != g for n in layout.q_lens):
        raise ValueError("extra keys on the PyTorch path need equal query counts per sequence")
    k, v = (x.view(r, g, *x.shape[1:]) for x in extra)
    out_b, lse_b = block_attention(q.view(r, g, *q.shape[1:]), k, v)
    lse_a = lse.view(lse_b.shape).to(lse_b.dtype)
    merged = merge_attention(out.view(out_b.shape), lse_a, out_b, lse_b).reshape(q.shape).to(q.dtype)
    return merged, torch.logaddexp(lse_a, lse_b).reshape(lse.shape).float() if want_lse else None


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bidirectional attention inside each of R blocks: q [R, g, Hq, D], k/v [R, g, Hkv, D] ->
    out [R, g, Hq, D] and log-sum-exp [R, g, Hq], both in float32 (float64 for float64)."""
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    rep = q.shape[2] // k.shape[2]
    qq = q.transpose(1, 2).to(cdt)  # [R, Hq, g, D]
    kk = k.transpose(1, 2).to(cdt).repeat_interleave(rep, dim=1)
    vv = v.transpose(1, 2).to(cdt).repeat_interleave(rep, dim=1)
    s = (qq @ kk.transpose(-1, -2)) * q.shape[-1] ** -0.5
    lse = torch.logsumexp(s, dim=-1)
    out = torch.softmax(s, dim=-1) @ vv
    return out.transpose(1, 2), lse.transpose(1, 2)


def merge_attention(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Softmax attention over the union of two disjoint key sets from each set's output and
    log-sum-exp: out [..., H, D], lse [..., H] (lse_b finite)."""
    lse = torch.logaddexp(lse_a, lse_b)
    wa = torch.exp(lse_a - lse)[..., None]
    wb = torch.exp(lse_b - lse)[..., None]
    return out_a.to(wa.dtype) * wa + out_b.to(wb.dtype) * wb


@dataclass(frozen=True)
class PagedAttention:
    """Writes the new tokens' k/v into the pool, then attends over each sequence's cached keys.

    The packed linear layers cost scale with the number of new tokens; attention reads every
    sequence's keys where they lie in the pool (or, for impl "gather", copies them per group).
    """

    pool: KVPool
    slot_mapping: torch.Tensor  # [T] destination slot of each new token
    layout: PagedLayout

    @functools.cached_property
    def groups(self) -> tuple[AttentionGroup, ...]:
        """The gather path's padded groups (built once per forward, only for impl "gather")."""
        return build_groups(self.layout)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]
        k_cache.index_copy_(0, self.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, self.slot_mapping, v.to(v_cache.dtype))
        return self.attend_stored(layer, q)

    def attend_stored(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """``attend`` for new tokens whose k / v are already in the pool at ``slot_mapping``
        (written by the fused q/k kernel of layer_ops)."""
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]
        impl = resolve_impl(self.pool.impl, q.dtype, k_cache, q.shape[1])
        if impl == "gather":
            return gather_attend(self.groups, q, k_cache, v_cache)
        return paged_attend(q, k_cache, v_cache, self.layout, impl)[0]


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
