"""The drafter's decoder layer: Qwen3-style attention whose keys are the request's context (K/V
injected from the target's features, in the pool) plus the block's own tokens, then SwiGLU.

Two serving paths, as in the target: PyTorch ops, and (``forward_kernels``) the fused element-wise
kernels of layer_ops, selected by ``DSparkDrafter.use_kernels``. Training runs the PyTorch path.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import nn

from dspark_server.models import layer_ops
from dspark_server.models.drafter_attention import Attend
from dspark_server.models.drafter_config import DraftConfig
from dspark_server.models.layers import (
    RMSNorm,
    SwiGLU,
    apply_rotary,
    fuse_linears,
    qk_norm_weight,
    residual_layer_kernels,
)


class DraftAttention(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        h, d, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self._qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # fuse()
        self._qk_norm_weight: torch.Tensor | None = None

    def fuse(self) -> None:
        """Serving: q, k, v as one GEMM (k, v as the tail of it for the context), and the q/k
        norm weights laid out for the fused q/k kernel."""
        self._qkv = fuse_linears(self.q_proj, self.k_proj, self.v_proj)
        self._qk_norm_weight = qk_norm_weight(self.q_norm, self.k_norm, self.num_heads, self.num_kv_heads)

    def _heads(self, q_heads: int) -> tuple[int, int, int]:
        return q_heads, self.num_kv_heads, self.head_dim

    def kv_kernels(
        self,
        lib: ctypes.CDLL,
        x: torch.Tensor,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
        slots: torch.Tensor,
        caches: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        """``kv`` with the kernels, written straight into caches [S, Hkv, D] at ``slots``."""
        assert self._qkv is not None and self._qk_norm_weight is not None, "call fuse() first"
        w, b = self._qkv
        start = self.num_heads * self.head_dim
        kv = F.linear(x, w[start:], b[start:] if b is not None else None)
        k_weight = self._qk_norm_weight[self.num_heads :]
        heads, eps = self._heads(0), self.k_norm.eps
        layer_ops.qk_norm_rope_store(lib, kv, heads, positions, inv_freq, k_weight, eps, slots, *caches)

    def forward_kernels(
        self,
        lib: ctypes.CDLL,
        x: torch.Tensor,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
        attend: Attend,
    ) -> torch.Tensor:
        """``forward`` with the kernels: the block's own k / v land in fresh [T, Hkv, D] tensors."""
        assert self._qkv is not None, "call fuse() first"
        t = x.shape[0]
        qkv = F.linear(x, *self._qkv)
        k, v = (torch.empty(t, self.num_kv_heads, self.head_dim, dtype=x.dtype) for _ in range(2))
        rows, heads, eps = torch.arange(t), self._heads(self.num_heads), self.q_norm.eps
        qk_w = self._qk_norm_weight
        q = layer_ops.qk_norm_rope_store(lib, qkv, heads, positions, inv_freq, qk_w, eps, rows, k, v)
        return self.o_proj(attend(q, k, v).reshape(t, self.num_heads * self.head_dim))

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> rotated, normed k [T, Hkv, D] and v [T, Hkv, D]."""
        t = x.shape[0]
        k = self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim))
        return apply_rotary(k, cos, sin), self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        t = x.shape[0]
        q = apply_rotary(self.q_norm(self.q_proj(x).view(t, self.num_heads, self.head_dim)), cos, sin)
        k, v = self.kv(x, cos, sin)
        return self.o_proj(attend(q, k, v).reshape(t, self.num_heads * self.head_dim))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.self_attn = DraftAttention(cfg)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def fuse(self) -> None:
        self.self_attn.fuse()
        self.mlp.fuse()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attend)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_kernels(
        self,
        lib: ctypes.CDLL,
        x: torch.Tensor,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
        attend: Attend,
    ) -> torch.Tensor:
        def attention(h: torch.Tensor) -> torch.Tensor:
            return self.self_attn.forward_kernels(lib, h, positions, inv_freq, attend)

        norms = self.input_layernorm, self.post_attention_layernorm
        return residual_layer_kernels(lib, x, norms[0], attention, norms[1], self.mlp)
