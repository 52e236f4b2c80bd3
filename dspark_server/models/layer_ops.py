"""The decoder layer's element-wise steps as fused C++ calls (kernels/layer_ops.cpp).

Eager PyTorch runs RMSNorm as six kernel calls, the q/k norm and rotary embedding as about
fifteen, and SwiGLU's product as three; at one decoding request each call costs more in dispatch
than in arithmetic. These wrappers run each step as one call into the kernel library, with the
same rounding as the PyTorch path (float32 and bfloat16). They take contiguous CPU tensors and
allocate their outputs; the caller (the target's serving path) checks ``supports`` once per forward.
"""

from __future__ import annotations

import ctypes

import torch

from dspark_server.models.kernel_library import DTYPES, cache_dtype_code


def supports(x: torch.Tensor) -> bool:
    """Whether the kernels handle this activation tensor (dtype and device)."""
    return x.dtype in DTYPES and x.device.type == "cpu"


def _check(rc: int, name: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{name} kernel failed with code {rc}")


def rms_norm(
    lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rmsnorm(s), s) for s = x + delta (x alone without delta), rows of [N, H]."""
    x = x.contiguous()
    out = torch.empty_like(x)
    total = x
    if delta is not None:
        delta = delta.contiguous()
        total = torch.empty_like(x)
    rows, dim = x.shape
    rc = lib.dspark_rms_norm(
        DTYPES[x.dtype],
        x.data_ptr(),
        delta.data_ptr() if delta is not None else None,
        total.data_ptr() if delta is not None else None,
        weight.data_ptr(),
        out.data_ptr(),
        rows,
        dim,
        eps,
        torch.get_num_threads(),
    )
    _check(rc, "rms_norm")
    return out, total


def qk_norm_rope_store(
    lib: ctypes.CDLL,
    qkv: torch.Tensor,
    heads: tuple[int, int, int],
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    qk_weight: torch.Tensor | None,
    eps: float,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> torch.Tensor:
    """From the fused projection's output qkv [T, (Hq + 2 Hkv) * D] (``heads`` = Hq, Hkv, D):
    q and k normalised per head (``qk_weight`` [Hq + Hkv, D], None for no q/k norm) and rotated
    at ``positions`` (angles ``position * inv_freq``, float32); k and v are written into the
    layer's caches [S, Hkv, D] at ``slots`` [T] (qkv's dtype, or bfloat16 under float32: rounded
    as stored). Returns q [T, Hq, D]."""
    hq, hkv, d = heads
    t = qkv.shape[0]
    if not (qkv.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("qkv and the caches must be contiguous")
    code = cache_dtype_code(qkv.dtype, k_cache.dtype)
    if code is None or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"no kernel stores {qkv.dtype} activations into a {k_cache.dtype} cache")
    q = torch.empty(t, hq, d, dtype=qkv.dtype)
    rc = lib.dspark_qk_norm_rope_store(
        code,
        qkv.data_ptr(),
        t,
        hq,
        hkv,
        d,
        positions.data_ptr(),
        inv_freq.data_ptr(),
        qk_weight.data_ptr() if qk_weight is not None else None,
        eps,
        slots.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        q.data_ptr(),
        torch.get_num_threads(),
    )
    _check(rc, "qk_norm_rope_store")
    return q


def silu_mul(lib: ctypes.CDLL, gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [N, 2I] (gate first) -> [N, I]."""
    gate_up = gate_up.contiguous()
    rows, width = gate_up.shape
    out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
    rc = lib.dspark_silu_mul(
        DTYPES[gate_up.dtype], gate_up.data_ptr(), out.data_ptr(), rows, width // 2, torch.get_num_threads()
    )
    _check(rc, "silu_mul")
    return out
