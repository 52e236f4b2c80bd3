"""The drafter's context write as one call into the kernel library (kernels/context_write.cpp).

``DSparkDrafter.write_context`` turns newly committed target positions' captured features into
every draft layer's context K/V: ``fc``, the hidden norm, then per layer the k|v columns of the
fused q|k|v weight, the k norm, the rotary embedding and the store into the pool. On the PyTorch
and element-wise-kernel paths that is a GEMM through PyTorch plus two calls per layer, and it
runs after every verification step for the few accepted tokens; at one request it cost about as
much as the verification's arithmetic on the demo pair, and on the K=8 twin its float32 weight
reads (fc and k|v: 82 MB) took 5 ms of a 32 ms step. ``FusedContextWrite`` runs the same steps in
C++ with the fused forwards' GEMMs (float32, with packed copies of fc and k|v for the kernel of a
few rows, or weight-only bf16 or int8 copies: models/weight_formats.py).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dspark_server.models import f32_weights
from dspark_server.models.attention import KVPool
from dspark_server.models.fused_forward import LayerWeights, cache_addresses
from dspark_server.models.kernel_library import blas_sgemm
from dspark_server.models.weight_formats import WeightFormat, chosen_format, gemm_addresses

SYMBOL = "dspark_context_write_f32"


@dataclass(frozen=True)
class ContextShape:
    hidden: int
    heads: tuple[int, int, int]  # query heads, key/value heads, head size
    eps: float  # the hidden norm's and the k norm's (the drafter builds its norms with one)

    @property
    def kv_start(self) -> int:
        """The first k row of the fused q|k|v weight."""
        return self.heads[0] * self.heads[2]

    @property
    def kv_width(self) -> int:
        return 2 * self.heads[1] * self.heads[2]


class FusedContextWrite:
    """The addresses of one drafter's context write, gathered once (the weights it points into
    are held, as ``FusedForward`` holds its)."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        sgemm: int,
        shape: ContextShape,
        fc: torch.Tensor,
        hidden_norm: torch.Tensor,
        layers: Sequence[LayerWeights],
        inv_freq: torch.Tensor,
        fmt: WeightFormat,
        packed_f32: bool = False,
    ) -> None:
        self.lib, self.sgemm, self.format, self.shape = lib, sgemm, fmt, shape
        self.context_dim = int(fc.shape[1])
        self.num_layers = len(layers)
        self.inv_freq = inv_freq.float().contiguous()
        self.hidden_norm = hidden_norm.detach().float().contiguous()
        held: list[torch.Tensor] = [self.inv_freq, self.hidden_norm]
        start, width = shape.kv_start, shape.kv_width
        self.fc, self.fc_packed = gemm_addresses(
            fc.detach().t().contiguous(), fmt, packed_f32, held
        )  # [C, H]
        table: list[int] = []
        for layer in layers:
            assert layer.qk_norm is not None  # build checks
            wt = layer.qkv.detach().t()  # [K, N], contiguous: the serving layout's transpose
            assert wt.is_contiguous(), "the fused q|k|v weight must be in the serving layout"
            k_norm = layer.qk_norm[shape.heads[0] :].detach().float().contiguous()
            held += [wt, k_norm]
            # float32: the k|v columns in place (row stride N), packed copies of just those columns;
            # bf16, int8: copies of just those columns
            kv, kv_packed = gemm_addresses(wt[:, start : start + width], fmt, packed_f32, held)
            in_place = fmt == WeightFormat.FLOAT32
            table += [kv, int(wt.shape[1]) if in_place else width, kv_packed, k_norm.data_ptr()]
        self.layer_table = torch.tensor(table, dtype=torch.int64)
        self._held = held
        self._caches: tuple[KVPool, torch.Tensor] | None = None

    @classmethod
    def build(
        cls,
        lib: ctypes.CDLL | None,
        shape: ContextShape,
        fc: torch.Tensor,
        hidden_norm: torch.Tensor,
        layers: Sequence[LayerWeights],
        inv_freq: torch.Tensor,
        weight_dtype: torch.dtype = torch.float32,
    ) -> FusedContextWrite | None:
        """None where it does not apply: no library or BLAS, weights not float32 or not in the
        serving layout, a layer without a k norm."""
        if lib is None or not hasattr(lib, SYMBOL) or any(lw.qk_norm is None for lw in layers):
            return None
        mats = [fc] + [layer.qkv for layer in layers]
        if not all(m.dtype == torch.float32 and m.device.type == "cpu" for m in mats):
            return None
        if not all(lw.qkv.t().is_contiguous() for lw in layers):
            return None
        sgemm = blas_sgemm()
        if sgemm is None:
            return None
        start, width = shape.kv_start, shape.kv_width
        mats = [fc.t(), *(layer.qkv.t()[:, start : start + width] for layer in layers)]
        fmt = chosen_format(lib, weight_dtype, mats)
        packed_f32 = fmt == WeightFormat.FLOAT32 and f32_weights.kernel_serves(lib)
        return cls(lib, sgemm, shape, fc, hidden_norm, layers, inv_freq, fmt, packed_f32)

    def reads(self, pool: KVPool) -> bool:
        """Whether this write can store into ``pool`` (float32, or a bfloat16 KV cache)."""
        return pool.k.dtype in (torch.float32, torch.bfloat16) and int(pool.k.shape[0]) == self.num_layers

    def __call__(
        self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, pool: KVPool
    ) -> None:
        """Write the context K/V of positions [T] (features [T, C]) at slots [T] of ``pool``."""
        t = int(features.shape[0])
        if t == 0:
            return
        feats = features.float().contiguous()
        pos = positions.to(torch.int64).contiguous()
        dst = slots.to(torch.int64).contiguous()
        s = self.shape
        rc = self.lib.dspark_context_write_f32(
            self.sgemm,
            int(self.format),
            t,
            feats.data_ptr(),
            self.context_dim,
            self.fc,
            self.fc_packed,
            self.hidden_norm.data_ptr(),
            s.hidden,
            s.eps,
            self.num_layers,
            s.heads[1],
            s.heads[2],
            s.eps,
            self.inv_freq.data_ptr(),
            self.layer_table.data_ptr(),
            pos.data_ptr(),
            dst.data_ptr(),
            self._cache_addresses(pool).data_ptr(),
            torch.get_num_threads(),
            int(pool.k.dtype == torch.bfloat16),
        )
        if rc != 0:
            raise RuntimeError(f"fused context write failed with code {rc}")

    def _cache_addresses(self, pool: KVPool) -> torch.Tensor:
        if self._caches is None or self._caches[0] is not pool:
            self._caches = (pool, cache_addresses(pool, self.num_layers))
        return self._caches[1]
