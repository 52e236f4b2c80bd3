"""Paged attention through the C++ kernel library (kernels/paged_attention.cpp, kernel_library.py)."""

from __future__ import annotations

import ctypes

import torch

from dspark_server.models.kernel_library import cache_dtype_code
from dspark_server.models.paged_layout import PagedLayout

_HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)


def kernel_supports(q: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether the kernel handles these dtypes and head size (else use the PyTorch path)."""
    return (
        cache_dtype_code(q.dtype, cache.dtype) is not None
        and q.shape[-1] in _HEAD_DIMS
        and q.shape[1] % cache.shape[1] == 0
        and q.device.type == "cpu"
    )


def kernel_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: PagedLayout,
    want_lse: bool = False,
    extra: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q [T, Hq, D], caches [S, Hkv, D] (q's dtype, or bfloat16 under float32 q) -> out [T, Hq, D]
    in q's dtype (and log-sum-exp [T, Hq] float32).

    ``extra`` = (k, v) [T, Hkv, D]: every query of sequence r also sees the rows of its own query
    rows in k / v, unmasked (the drafter's block attending to itself bidirectionally)."""
    if not kernel_supports(q, k_cache):
        raise ValueError(f"kernel does not support q {q.dtype} {tuple(q.shape)}, cache {k_cache.dtype}")
    q = q.contiguous()
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("KV caches must be contiguous")
    kx = vx = None
    if extra is not None:
        kx, vx = (x.to(q.dtype).contiguous() for x in extra)
        if kx.shape != (q.shape[0], *k_cache.shape[1:]) or vx.shape != kx.shape:
            raise ValueError(f"extra keys must be [T, Hkv, D], got {tuple(kx.shape)}")
    t, hq, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(t, hq, dtype=torch.float32) if want_lse else None
    code = cache_dtype_code(q.dtype, k_cache.dtype)
    assert code is not None
    rc = lib.dspark_paged_attention(
        code,
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        layout.slots.data_ptr(),
        layout.slots.shape[1],
        layout.q_start.data_ptr(),
        layout.q_len.data_ptr(),
        layout.kv_limit.data_ptr(),
        kx.data_ptr() if kx is not None else None,
        vx.data_ptr() if vx is not None else None,
        layout.num_seqs,
        hq,
        k_cache.shape[1],
        d,
        d**-0.5,
        out.data_ptr(),
        lse.data_ptr() if lse is not None else None,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"paged attention kernel failed with code {rc}")
    return out, lse
