"""The target's float32 serving forward as one call into the kernel library
(kernels/decoder_forward.cpp).

The PyTorch serving path (target.py's ``forward_kernels``) makes about fifteen calls per layer
from Python; at a handful of tokens each call costs more in dispatch than in arithmetic, so a
forward for one decoding request took about twice its weight reads. ``FusedForward`` runs the
same steps — the same element-wise and attention kernels, the same BLAS sgemm (PyTorch's own,
``kernel_library.blas_sgemm``) — as one C++ function, with the layer's weights passed by address.
It applies to float32 models without projection biases whose attention runs the paged kernel;
``FusedForward.build`` returns None otherwise and the PyTorch path runs. The drafter's parallel
block pass is the same forward in block mode (``FusedForward.block``).

Float32 GEMMs of up to a few hundred rows read packed copies of the weights (f32_weights.py), larger
ones the serving layout through the sgemm. ``weight_dtype=torch.bfloat16`` serves the GEMMs from
weight-only bf16 copies instead (bf16_weights.py; half the bytes a forward reads, fp32
accumulation) on CPUs with AVX512-BF16; the model keeps its float32 weights, and activations, the
KV cache and the logits stay float32.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from dspark_server.config import ModelConfig
from dspark_server.models import f32_weights
from dspark_server.models.attention import KVPool, PagedAttention, resolve_impl
from dspark_server.models.drafter_config import DraftConfig
from dspark_server.models.kernel_library import blas_sgemm
from dspark_server.models.paged_layout import PagedLayout
from dspark_server.models.weight_formats import WeightFormat, chosen_format, format_dtype, gemm_addresses

SYMBOL = "dspark_decoder_forward_f32"


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's serving weights: matrices [N, K] in the serving layout (column-major),
    q/k norm weights [Hq + Hkv, D] (None: no q/k norm)."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qk_norm: torch.Tensor | None
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class _Attention(Protocol):
    @property
    def _qkv(self) -> tuple[torch.Tensor, torch.Tensor | None] | None: ...
    @property
    def _qk_norm_weight(self) -> torch.Tensor | None: ...
    @property
    def o_proj(self) -> nn.Linear: ...


class _Mlp(Protocol):
    @property
    def _gate_up(self) -> tuple[torch.Tensor, torch.Tensor | None] | None: ...
    @property
    def down_proj(self) -> nn.Linear: ...


class _Norm(Protocol):
    @property
    def weight(self) -> torch.Tensor: ...


class ServingLayer(Protocol):
    """A pre-norm decoder layer with Hugging Face's names, projections fused for serving (the
    target's DecoderLayer and the drafter's DraftLayer)."""

    @property
    def input_layernorm(self) -> _Norm: ...
    @property
    def self_attn(self) -> _Attention: ...
    @property
    def post_attention_layernorm(self) -> _Norm: ...
    @property
    def mlp(self) -> _Mlp: ...


def serving_layer_weights(layers: Iterable[ServingLayer]) -> list[LayerWeights] | None:
    """Every layer's serving weights; None before the projections are fused or with attention
    biases (the fused forward has none)."""
    out: list[LayerWeights] = []
    for layer in layers:
        a, mlp = layer.self_attn, layer.mlp
        if a._qkv is None or a._qkv[1] is not None or a.o_proj.bias is not None:
            return None
        if mlp._gate_up is None or mlp._gate_up[1] is not None:
            return None
        out.append(
            LayerWeights(
                layer.input_layernorm.weight.data,
                a._qkv[0],
                a._qk_norm_weight,
                a.o_proj.weight.data,
                layer.post_attention_layernorm.weight.data,
                mlp._gate_up[0],
                mlp.down_proj.weight.data,
            )
        )
    return out


@dataclass(frozen=True)
class DecoderShape:
    hidden: int
    vocab: int
    heads: tuple[int, int, int]  # query heads, key/value heads, head size
    intermediate: int
    eps: float  # the layers' RMSNorm epsilon (their q/k norms are built with the same one)

    @classmethod
    def of(cls, c: ModelConfig | DraftConfig) -> DecoderShape:
        heads = (c.num_attention_heads, c.num_key_value_heads, c.head_dim)
        return cls(c.hidden_size, c.vocab_size, heads, c.intermediate_size, c.rms_norm_eps)


@dataclass(frozen=True)
class DecoderWeights:
    embed: torch.Tensor  # [V, H]
    layers: Sequence[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor  # [V, H], serving layout
    inv_freq: torch.Tensor  # rotary frequencies [D / 2]


class FusedForward:
    """The addresses one fused forward needs, gathered once after the weights are in their serving
    layout. It holds every tensor they point into, so a weight the model replaces later (a
    ``.to()``, a new ``.data``) cannot leave an address dangling; such a model must call
    ``use_kernels`` again to serve its new weights."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        sgemm: int,
        shape: DecoderShape,
        w: DecoderWeights,
        fmt: WeightFormat = WeightFormat.FLOAT32,
        packed_f32: bool = False,
    ) -> None:
        """``fmt``: how the GEMMs keep their weights (weight_formats.py); ``packed_f32``: under
        float32, keep copies packed for linear_f32.cpp's kernel beside the serving layout."""
        self.lib, self.sgemm, self.format = lib, sgemm, fmt
        self.hidden, self.vocab, self.heads = shape.hidden, shape.vocab, shape.heads
        self.inter, self.eps = shape.intermediate, shape.eps
        self.weight_dtype = format_dtype(fmt)
        self.inv_freq = w.inv_freq.float().contiguous()
        self.embed = row_major(w.embed)  # rows are gathered: a column-major table is copied, once
        self.final_norm = w.final_norm.detach()
        held: list[torch.Tensor] = []

        def gemm_weight(m: torch.Tensor) -> tuple[int, int]:
            return gemm_addresses(_transposed(m), fmt, packed_f32, held)

        self.lm_wt, self.lm_packed = gemm_weight(w.lm_head)
        ptrs: list[int] = []
        for lw in w.layers:
            qkv, o_proj, gate_up, down = (gemm_weight(m) for m in (lw.qkv, lw.o_proj, lw.gate_up, lw.down))
            qk = lw.qk_norm.data_ptr() if lw.qk_norm is not None else 0
            ptrs += [lw.input_norm.data_ptr(), *qkv, qk, *o_proj, lw.post_norm.data_ptr(), *gate_up, *down]
        self.weights = torch.tensor(ptrs, dtype=torch.int64)
        self._held = (w, self.embed, self.final_norm, self.inv_freq, held)  # see the class doc
        self.num_layers = len(w.layers)
        self._caches: tuple[KVPool, torch.Tensor] | None = None
        self._captures: dict[tuple[int, ...], torch.Tensor] = {}
        self._reads: tuple[KVPool, str, bool] | None = None  # the last pool asked about

    @classmethod
    def build(
        cls,
        lib: ctypes.CDLL | None,
        shape: DecoderShape,
        w: DecoderWeights,
        weight_dtype: torch.dtype = torch.float32,
    ) -> FusedForward | None:
        """The fused forward for these weights (without projection biases: the caller checks),
        or None where it does not apply (no library, not float32, a weight not in the serving
        layout, no BLAS found). ``weight_dtype`` bfloat16 or int8: weight-only bf16 or int8 GEMMs
        where the CPU and the shapes allow (``weight_formats.chosen_format``), else float32 ones."""
        if lib is None or not hasattr(lib, SYMBOL):
            return None
        mats = [w.lm_head] + [m for lw in w.layers for m in (lw.qkv, lw.o_proj, lw.gate_up, lw.down)]
        if not all(
            m.dtype == torch.float32 and m.device.type == "cpu" and _is_serving_layout(m) for m in mats
        ):
            return None
        sgemm = blas_sgemm()
        if sgemm is None:
            return None
        fmt = chosen_format(lib, weight_dtype, [m.t() for m in mats])
        return cls(lib, sgemm, shape, w, fmt, fmt == WeightFormat.FLOAT32 and f32_weights.kernel_serves(lib))

    def applies(self, attn: object) -> bool:
        """Whether this forward can run over ``attn`` (a pool the paged kernel reads)."""
        return isinstance(attn, PagedAttention) and self.reads(attn.pool)

    def reads(self, pool: KVPool) -> bool:
        """Whether the paged kernel reads this pool (float32, or a bfloat16 KV cache, with impl
        auto / kernel); asked at every forward, answered once per pool and impl."""
        known = self._reads
        if known is not None and known[0] is pool and known[1] == pool.impl:
            return known[2]
        fits = pool.k.dtype in (torch.float32, torch.bfloat16)
        fits = fits and resolve_impl(pool.impl, torch.float32, pool.k[0], self.heads[0]) == "kernel"
        self._reads = (pool, pool.impl, fits)
        return fits

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: PagedAttention,
        logits_rows: torch.Tensor | None,
        capture_layers: tuple[int, ...],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits of ``logits_rows`` (all rows if None), the ``capture_layers`` outputs side by side)."""
        logits, hidden, _ = self.run(
            input_ids, positions, attn.pool, attn.layout, attn.slot_mapping, logits_rows, capture_layers
        )
        return logits, hidden

    def block(
        self, input_ids: torch.Tensor, positions: torch.Tensor, pool: KVPool, layout: PagedLayout
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafter's parallel block pass: every sequence's block rows attend to its context in
        ``pool`` (``layout``: PagedLayout.blocks) and to each other, unmasked; nothing is stored
        in the pool. -> (logits [T, V], final-norm output [T, H]) for every row."""
        logits, _, normed = self.run(input_ids, positions, pool, layout, None, None, (), block=True)
        assert normed is not None
        return logits, normed

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        pool: KVPool,
        layout: PagedLayout,
        slot_mapping: torch.Tensor | None,
        logits_rows: torch.Tensor | None,
        capture_layers: tuple[int, ...],
        block: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(logits, captured layers, final-norm output in block mode) of one fused call."""
        t = int(input_ids.shape[0])
        rows = logits_rows if logits_rows is not None else torch.arange(t)
        rows = rows.to(torch.int64).contiguous()
        logits = torch.empty(rows.shape[0], self.vocab)
        capture = self._capture_index(capture_layers)
        hidden = torch.empty(t, len(capture_layers) * self.hidden) if capture_layers else None
        normed = torch.empty(rows.shape[0], self.hidden) if block else None
        if slot_mapping is None and not block:
            raise ValueError("a forward that stores its keys needs their slots")
        caches = self._cache_addresses(pool)
        ids = input_ids.to(torch.int64).contiguous()
        pos = positions.to(torch.int64).contiguous()
        hq, hkv, d = self.heads
        rc = self.lib.dspark_decoder_forward_f32(
            self.sgemm,
            t,
            ids.data_ptr(),
            pos.data_ptr(),
            slot_mapping.data_ptr() if slot_mapping is not None else None,
            layout.slots.data_ptr(),
            layout.slots.shape[1],
            layout.q_start.data_ptr(),
            layout.q_len.data_ptr(),
            layout.kv_limit.data_ptr(),
            layout.num_seqs,
            self.embed.data_ptr(),
            self.hidden,
            self.num_layers,
            hq,
            hkv,
            d,
            self.inter,
            self.eps,
            self.eps,  # the q/k norms' (unused without q/k norm weights)
            self.inv_freq.data_ptr(),
            self.weights.data_ptr(),
            caches.data_ptr(),
            self.final_norm.data_ptr(),
            self.lm_wt,
            self.lm_packed,
            self.vocab,
            rows.data_ptr(),
            rows.shape[0],
            logits.data_ptr(),
            capture.data_ptr(),
            len(capture_layers),
            hidden.data_ptr() if hidden is not None else None,
            int(block),
            normed.data_ptr() if normed is not None else None,
            torch.get_num_threads(),
            int(self.format),
            int(pool.k.dtype == torch.bfloat16),
        )
        if rc != 0:
            raise RuntimeError(f"fused decoder forward failed with code {rc}")
        return logits, hidden, normed

    def _capture_index(self, capture_layers: tuple[int, ...]) -> torch.Tensor:
        """[num_layers] int64: layer i's column block in the captured output, or -1 (built once
        per tuple: a plain step in a speculative mode captures on every call)."""
        index = self._captures.get(capture_layers)
        if index is None:
            if any(not 0 <= i < self.num_layers for i in capture_layers):
                raise IndexError(f"capture layers {capture_layers} out of range for {self.num_layers} layers")
            order = {layer_id: n for n, layer_id in enumerate(capture_layers)}
            index = torch.tensor([order.get(i, -1) for i in range(self.num_layers)], dtype=torch.int64)
            self._captures[capture_layers] = index
        return index

    def _cache_addresses(self, pool: KVPool) -> torch.Tensor:
        if self._caches is None or self._caches[0] is not pool:
            self._caches = (pool, cache_addresses(pool, self.num_layers))
        return self._caches[1]


def cache_addresses(pool: KVPool, num_layers: int) -> torch.Tensor:
    """[2 * layers] int64: each layer's K and V cache address, in the order the kernels read."""
    ptrs = [p for i in range(num_layers) for p in (pool.k[i].data_ptr(), pool.v[i].data_ptr())]
    return torch.tensor(ptrs, dtype=torch.int64)


_ROW_MAJOR: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}


def row_major(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` itself if contiguous, else a contiguous copy shared by every caller holding the
    same tensor (the target and its drafter gather embedding rows from one tied table); the copy
    lives as long as the tensor."""
    if weight.is_contiguous():
        return weight.detach()
    for key in [k for k, (ref, _) in _ROW_MAJOR.items() if ref() is None]:
        del _ROW_MAJOR[key]
    hit = _ROW_MAJOR.get(id(weight))
    if hit is not None and hit[0]() is weight and hit[1].shape == weight.shape:
        return hit[1]
    copy = weight.detach().contiguous()
    _ROW_MAJOR[id(weight)] = (weakref.ref(weight), copy)
    return copy


def _is_serving_layout(w: torch.Tensor) -> bool:
    """A float32 [N, K] weight stored column-major (its transpose contiguous)."""
    return w.dim() == 2 and w.t().is_contiguous()


def _transposed(w: torch.Tensor) -> torch.Tensor:
    """The contiguous [K, N] view of a column-major [N, K] weight (the same memory)."""
    wt = w.detach().t()
    assert wt.is_contiguous()
    return wt
