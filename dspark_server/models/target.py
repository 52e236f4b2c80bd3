"""Qwen3 / Llama decoder over a packed ragged batch.

Parameter names mirror Hugging Face's ``Qwen3ForCausalLM`` / ``LlamaForCausalLM`` so that a
checkpoint's state dict loads without renaming.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from dspark_server.config import ModelConfig
from dspark_server.models import layer_ops
from dspark_server.models.attention import AttentionBackend, KVPool, PagedAttention
from dspark_server.models.fused_forward import (
    DecoderShape,
    DecoderWeights,
    FusedForward,
    serving_layer_weights,
)
from dspark_server.models.layers import (
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
    apply_rotary,
    fuse_linears,
    qk_norm_weight,
    residual_layer_kernels,
    serving_layout_,
)


@dataclass(frozen=True)
class TargetOutput:
    logits: torch.Tensor  # [N, V] for the requested rows (all tokens when no rows were given)
    hidden: torch.Tensor | None  # [T, len(capture_layers) * hidden] for all new tokens, or None


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        h, d, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)
        self.qk_norm = cfg.uses_qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

        self._qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._qk_norm_weight: torch.Tensor | None = None  # [Hq + Hkv, D], for the fused path

    def fuse(self) -> None:
        """Inference: q, k and v projections as one GEMM (call once the weights are loaded), and
        q and k normalised and rotated as one tensor."""
        self._qkv = fuse_linears(self.q_proj, self.k_proj, self.v_proj)
        if self.qk_norm:  # both norms are built with the config's one rms_norm_eps
            self._qk_norm_weight = qk_norm_weight(self.q_norm, self.k_norm, self.num_heads, self.num_kv_heads)

    def _fused_qkv(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        qkv: tuple[torch.Tensor, torch.Tensor | None],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The serving path: one GEMM, then q and k (heads side by side) normalised and rotated
        together — the same arithmetic as the per-tensor path, in a third of the kernel calls."""
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        out = F.linear(x, *qkv).view(x.shape[0], hq + 2 * hkv, d)
        qk, v = out[:, : hq + hkv], out[:, hq + hkv :]
        if self._qk_norm_weight is not None:
            normed = F.rms_norm(qk.float(), (d,), eps=self.q_norm.eps).to(qk.dtype)
            qk = self._qk_norm_weight * normed
        q, k = apply_rotary(qk, cos, sin).split([hq, hkv], dim=1)
        return q, k, v

    def forward_kernels(
        self,
        lib: ctypes.CDLL,
        x: torch.Tensor,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
        layer: int,
        attn: PagedAttention,
    ) -> torch.Tensor:
        """The serving path with the fused kernels: one GEMM, one call that normalises and rotates
        q and k and stores k / v in the pool, attention over the pool, the output GEMM."""
        assert self._qkv is not None
        qkv = F.linear(x, *self._qkv)
        k_cache, v_cache = attn.pool.k[layer], attn.pool.v[layer]
        heads = (self.num_heads, self.num_kv_heads, self.head_dim)
        eps = self.q_norm.eps if self.qk_norm else 0.0
        slots = attn.slot_mapping
        q = layer_ops.qk_norm_rope_store(
            lib, qkv, heads, positions, inv_freq, self._qk_norm_weight, eps, slots, k_cache, v_cache
        )
        out = attn.attend_stored(layer, q)
        return self.o_proj(out.view(x.shape[0], self.num_heads * self.head_dim))

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, attn: AttentionBackend
    ) -> torch.Tensor:
        t = x.shape[0]
        if self._qkv is not None and not torch.is_grad_enabled():
            q, k, v = self._fused_qkv(x, cos, sin, self._qkv)
            out = attn.attend(layer, q, k, v)
            return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attn.attend(layer, q, k, v)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = SelfAttention(cfg)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, attn: AttentionBackend
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layer, attn)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_kernels(
        self,
        lib: ctypes.CDLL,
        x: torch.Tensor,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
        layer: int,
        attn: PagedAttention,
    ) -> torch.Tensor:
        """``forward`` with the element-wise steps as fused kernel calls."""

        def attention(h: torch.Tensor) -> torch.Tensor:
            return self.self_attn.forward_kernels(lib, h, positions, inv_freq, layer, attn)

        norms = self.input_layernorm, self.post_attention_layernorm
        return residual_layer_kernels(lib, x, norms[0], attention, norms[1], self.mlp)


class DecoderStack(nn.Module):
    """The ``model.`` prefix of a Hugging Face causal LM."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)


class TargetModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderStack(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._kernels: ctypes.CDLL | None = None  # use_kernels
        self._fused: FusedForward | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        logits_rows: torch.Tensor | None = None,
        capture_layers: tuple[int, ...] = (),
    ) -> TargetOutput:
        """Run the decoder over T packed new tokens.

        ``logits_rows`` selects the rows that need logits (e.g. only the last token of a prefill
        chunk); ``capture_layers`` lists decoder layers whose outputs are returned concatenated
        (layer i's output is Hugging Face's ``hidden_states[i + 1]``).
        """
        fused = self._fused
        if fused is not None and not torch.is_grad_enabled() and fused.applies(attn):
            assert isinstance(attn, PagedAttention)
            logits, hidden = fused(input_ids, positions, attn, logits_rows, capture_layers)
            return TargetOutput(logits=logits, hidden=hidden)
        x = self.model.embed_tokens(input_ids)
        lib = self._kernels if self._kernels_apply(x, attn) else None
        layers = cast("list[DecoderLayer]", self.model.layers)
        captured: list[torch.Tensor] = []
        wanted = set(capture_layers)
        if lib is not None:
            inv_freq = self.model.rotary.inv_freq.float()
        else:
            cos, sin = self.model.rotary.cos_sin(positions, x.dtype)
        for i, layer in enumerate(layers):
            if lib is not None and isinstance(attn, PagedAttention):
                x = layer.forward_kernels(lib, x, positions, inv_freq, i, attn)
            else:
                x = layer(x, cos, sin, i, attn)
            if i in wanted:
                captured.append(x)
        if wanted:
            order = {layer_id: n for n, layer_id in enumerate(sorted(wanted))}
            captured = [captured[order[layer_id]] for layer_id in capture_layers]
        x = x if logits_rows is None else x[logits_rows]
        norm = self.model.norm
        x = layer_ops.rms_norm(lib, x, norm.weight, norm.eps)[0] if lib is not None else norm(x)
        hidden = torch.cat(captured, dim=-1) if captured else None
        return TargetOutput(logits=self.lm_head(x), hidden=hidden)

    def use_kernels(
        self, lib: ctypes.CDLL | None, fused: bool = True, weight_dtype: torch.dtype = torch.float32
    ) -> None:
        """Serve with the fused element-wise kernels of ``lib`` (the kernel library), or with the
        PyTorch ops (None). Applies to inference forwards over a paged KV pool of the model's dtype.
        With ``fused`` (and projections fused), a float32 forward is one call into the library
        (models/fused_forward.py)."""
        self._kernels = lib
        layers = serving_layer_weights(cast("list[DecoderLayer]", self.model.layers)) if fused else None
        if layers is None:
            self._fused = None
            return
        stack = self.model
        weights = DecoderWeights(
            stack.embed_tokens.weight,
            layers,
            stack.norm.weight.data,
            self.lm_head.weight.data,
            stack.rotary.inv_freq,
        )
        self._fused = FusedForward.build(lib, DecoderShape.of(self.config), weights, weight_dtype)

    def serves_pool(self, pool: KVPool) -> bool:
        """Whether inference forwards can run over ``pool``: one of the activations' dtype always;
        a bfloat16 KV cache under float32 activations only through the fused forward."""
        if pool.k.dtype == self.lm_head.weight.dtype:
            return True
        return self._fused is not None and self._fused.reads(pool)

    def _kernels_apply(self, x: torch.Tensor, attn: AttentionBackend) -> bool:
        return (
            self._kernels is not None
            and not torch.is_grad_enabled()
            and isinstance(attn, PagedAttention)
            and attn.pool.k.dtype == x.dtype
            and layer_ops.supports(x)
            and cast("DecoderLayer", self.model.layers[0]).self_attn._qkv is not None
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def fuse_projections(self) -> None:
        """For serving: one GEMM for q/k/v and one for gate/up in every layer (inference only;
        training, with gradients on, keeps the separate projections), every weight in its serving layout."""
        for layer in cast("list[DecoderLayer]", self.model.layers):
            layer.self_attn.fuse()
            layer.mlp.fuse()
            serving_layout_(layer.self_attn.o_proj)
            serving_layout_(layer.mlp.down_proj)
        serving_layout_(self.lm_head)  # tied: the embedding reads the same (float32: column-major) table

    def project_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head applied to last-layer hidden states (shared with the drafter)."""
        return self.lm_head(self.model.norm(hidden))
