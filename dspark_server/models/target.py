"""Qwen3 / Llama decoder over a packed ragged batch.

Parameter names mirror Hugging Face's ``Qwen3ForCausalLM`` / ``LlamaForCausalLM`` so that a
checkpoint's state dict loads without renaming.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from dspark_server.config import ModelConfig
from dspark_server.models.attention import AttentionBackend
from dspark_server.models.layers import RMSNorm, RotaryEmbedding, SwiGLU, apply_rotary, fuse_linears


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
            self._qk_norm_weight = torch.cat(
                [
                    self.q_norm.weight.data.expand(self.num_heads, -1),
                    self.k_norm.weight.data.expand(self.num_kv_heads, -1),
                ]
            )

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
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary.cos_sin(positions, x.dtype)
        captured: list[torch.Tensor] = []
        wanted = set(capture_layers)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, i, attn)
            if i in wanted:
                captured.append(x)
        if wanted:
            order = {layer_id: n for n, layer_id in enumerate(sorted(wanted))}
            captured = [captured[order[layer_id]] for layer_id in capture_layers]
        x = self.model.norm(x if logits_rows is None else x[logits_rows])
        hidden = torch.cat(captured, dim=-1) if captured else None
        return TargetOutput(logits=self.lm_head(x), hidden=hidden)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def fuse_projections(self) -> None:
        """For serving: one GEMM for q/k/v and one for gate/up in every layer (inference only;
        training, with gradients on, keeps the separate projections)."""
        for layer in cast("list[DecoderLayer]", self.model.layers):
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def project_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head applied to last-layer hidden states (shared with the drafter)."""
        return self.lm_head(self.model.norm(hidden))
