"""Transformer building blocks shared by the target model and the drafter."""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dspark_server.config import RopeScaling
from dspark_server.models import layer_ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # the same products in one kernel call (x * rstd, then * weight)
            return F.rms_norm(x, (x.shape[-1],), self.weight, eps=self.eps)
        # Hugging Face's order: normalise in float32, cast back, then scale by the weight
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


def serving_layout(weight: torch.Tensor) -> torch.Tensor:
    """The same [N, K] weight in the memory layout its small-M GEMMs read fastest: float32
    column-major (its transpose contiguous), so that F.linear hands MKL a plain [M, K] x [K, N]
    product: 2.1x for the demo's LM head at M = 8, 1.3-1.4x for the twin's matrices, about equal
    at M = 1 and in prefill. Other dtypes stay row-major: oneDNN's bfloat16 kernels read a
    column-major 2048 x 9216 matrix 2x slower at M = 1 (benchmarks/linear_layout.py)."""
    return weight.t().contiguous().t() if weight.dtype == torch.float32 else weight


def serving_layout_(linear: nn.Linear) -> None:
    """``serving_layout`` in place of a layer's weight (values, names and state dict unchanged)."""
    linear.weight.data = serving_layout(linear.weight.data)


def fuse_linears(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) stacking the layers' output rows, for a single GEMM in place of
    several small ones, stored in the ``serving_layout``. The layers' parameters become views of it, so
    the state dict keeps its names and no weight is stored twice."""
    weight = serving_layout(torch.cat([lin.weight.data for lin in linears]))
    has_bias = linears[0].bias is not None
    bias = torch.cat([lin.bias.data for lin in linears if lin.bias is not None]) if has_bias else None
    row = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight.data = weight[row : row + n]
        if bias is not None and lin.bias is not None:
            lin.bias.data = bias[row : row + n]
        row += n
    return weight, bias


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the Hugging Face (rotate-half) layout."""

    inv_freq: torch.Tensor  # a buffer (register_buffer)

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None = None) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        if scaling is not None:
            inv_freq = _llama3_scale(inv_freq, scaling)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin tables of shape [T, head_dim] for integer positions [T]."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] with cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

        self._gate_up: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def fuse(self) -> None:
        """Inference: gate and up projections as one GEMM (call once the weights are loaded)."""
        self._gate_up = fuse_linears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._gate_up is not None and not torch.is_grad_enabled():
            gate, up = F.linear(x, *self._gate_up).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def forward_kernels(self, lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor:
        """``forward`` (fused) with silu(gate) * up as one kernel call."""
        assert self._gate_up is not None, "call fuse() first"
        return self.down_proj(layer_ops.silu_mul(lib, F.linear(x, *self._gate_up)))


def qk_norm_weight(q_norm: RMSNorm, k_norm: RMSNorm, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """[Hq + Hkv, D]: the q norm's weight for every q head, then the k norm's for every k head
    (the fused q/k kernel's layout)."""
    return torch.cat([q_norm.weight.data.expand(num_heads, -1), k_norm.weight.data.expand(num_kv_heads, -1)])


def residual_layer_kernels(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    input_norm: RMSNorm,
    attention: Callable[[torch.Tensor], torch.Tensor],
    post_norm: RMSNorm,
    mlp: SwiGLU,
) -> torch.Tensor:
    """A pre-norm decoder layer, x + attn(norm(x)) then + mlp(norm(.)), with its norms, residual
    add and SwiGLU product as fused kernel calls (same arithmetic and rounding as PyTorch's)."""
    h = layer_ops.rms_norm(lib, x, input_norm.weight, input_norm.eps)[0]
    h, x = layer_ops.rms_norm(lib, x, post_norm.weight, post_norm.eps, delta=attention(h))
    return x + mlp.forward_kernels(lib, h)
