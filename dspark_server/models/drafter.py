"""DSpark drafter: a few Qwen3-style layers over [anchor, mask * (gamma - 1)] conditioned on the target.

Parameter names equal DeepSpec's ``Qwen3DSparkModel`` (``layers.{i}.self_attn.{q,k,v,o}_proj``,
``layers.{i}.self_attn.{q,k}_norm``, ``layers.{i}.mlp.{gate,up,down}_proj``,
``layers.{i}.{input,post_attention}_layernorm``, ``norm``, ``fc``, ``hidden_norm``, ``markov_head.*``,
``confidence_head.*``). The token embedding and LM head are the target's: shared, frozen, and not
registered as submodules (``drafter_checkpoint`` writes copies under DeepSpec's names).

Context injection (per draft layer l, for committed target position p < anchor position a):
    c_p = hidden_norm(fc(concat of target layer outputs at p))        # [H], computed once
    K_l(p) = rope(k_norm(k_proj_l(c_p)), p),  V_l(p) = v_proj_l(c_p)  # no input_layernorm
The block's gamma tokens sit at positions a..a+gamma-1, attend to K/V of context positions < a
and bidirectionally to each other. Output h = norm(x); base logits U = lm_head(h) (the target's
head WITHOUT the target's final norm). Block position k (0-based) predicts token a + k + 1.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from dspark_server.models import bf16_weights, f32_weights, layer_ops
from dspark_server.models.attention import KVPool, resolve_impl
from dspark_server.models.drafter_attention import gather_attends, paged_block_attend
from dspark_server.models.drafter_config import DraftConfig
from dspark_server.models.drafter_heads import MarkovHead, build_confidence_head, build_markov_head
from dspark_server.models.drafter_layers import DraftLayer
from dspark_server.models.fused_context import ContextShape, FusedContextWrite
from dspark_server.models.fused_forward import (
    DecoderShape,
    DecoderWeights,
    FusedForward,
    serving_layer_weights,
)
from dspark_server.models.layers import RMSNorm, RotaryEmbedding, serving_layout_
from dspark_server.models.paged_layout import PagedLayout
from dspark_server.models.row_ops import row_argmax
from dspark_server.models.target import TargetModel
from dspark_server.models.weight_formats import bf16_supported

GREEDY_BF16_ROWS = 2  # the greedy Markov kernel's per-request path; more requests run one sgemm


@dataclass(frozen=True)
class SharedModules:
    """The target's embedding and LM head, held by reference (not submodules of the drafter)."""

    embed_tokens: nn.Embedding
    lm_head: nn.Linear


@dataclass(frozen=True)
class DraftContext:
    """Where each request's context K/V live in the drafter pool.

    slots [R, Cmax]: pool slot of context position j of request r (padding points at slot 0).
    lens [R]: number of valid context positions (normally == the anchor position).
    """

    slots: torch.Tensor
    lens: torch.Tensor

    @classmethod
    def from_slot_lists(cls, slots: Sequence[torch.Tensor]) -> DraftContext:
        """E.g. ``[allocator.slots(table, 0, anchor_pos) for each request]``."""
        lens = torch.tensor([len(s) for s in slots], dtype=torch.long)
        if int(lens.max()) == 0:
            return cls(torch.zeros(len(slots), 0, dtype=torch.long), lens)
        return cls(pad_sequence([s.long() for s in slots], batch_first=True), lens)


@dataclass(frozen=True)
class DraftBlock:
    hidden: torch.Tensor  # [R, gamma, H] backbone outputs h_1..h_gamma (after the drafter's norm)
    logits: torch.Tensor  # [R, gamma, V] base logits U_1..U_gamma


@dataclass(frozen=True)
class DraftTrainOutput:
    logits: torch.Tensor  # [B, A, gamma, V] U_k + B_k with teacher-forced x_{k-1}
    confidence_logits: torch.Tensor | None  # [B, A, gamma] raw (pre-sigmoid), float32
    hidden: torch.Tensor  # [B, A, gamma, H]
    prev_tokens: torch.Tensor  # [B, A, gamma] x_{k-1}: anchor token, then data tokens


class DSparkDrafter(nn.Module):
    def __init__(self, cfg: DraftConfig, target: TargetModel) -> None:
        super().__init__()
        tcfg = target.config
        if (cfg.hidden_size, cfg.vocab_size) != (tcfg.hidden_size, tcfg.vocab_size):
            raise ValueError(
                f"drafter hidden/vocab {(cfg.hidden_size, cfg.vocab_size)} must equal the "
                f"target's {(tcfg.hidden_size, tcfg.vocab_size)} (shared embedding/LM head)"
            )
        if cfg.num_target_layers != tcfg.num_hidden_layers:
            raise ValueError(
                f"drafter was built for a {cfg.num_target_layers}-layer target, "
                f"this target has {tcfg.num_hidden_layers} layers"
            )
        if cfg.target_layer_ids[0] < 0:
            raise ValueError(
                "target_layer_ids containing -1 (embedding output) are not supported: "
                "TargetModel.forward cannot capture the embedding output"
            )
        self.config = cfg
        self.shared = SharedModules(target.model.embed_tokens, target.lm_head)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc = nn.Linear(cfg.context_dim, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.markov_head = build_markov_head(cfg)
        self.confidence_head = build_confidence_head(cfg)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self._kernels: ctypes.CDLL | None = None  # use_kernels
        self._fused: FusedForward | None = None
        self._fused_context: FusedContextWrite | None = None

    def fuse_projections(self) -> None:
        """Serving: fused q/k/v and gate/up GEMMs in every layer (names and values unchanged)."""
        for layer in cast("list[DraftLayer]", self.layers):
            layer.fuse()
            serving_layout_(layer.self_attn.o_proj)
            serving_layout_(layer.mlp.down_proj)

    def use_kernels(
        self, lib: ctypes.CDLL | None, fused: bool = True, weight_dtype: torch.dtype = torch.float32
    ) -> None:
        """Serve with the fused element-wise kernels of ``lib`` (after ``fuse_projections``), or
        with the PyTorch ops (None). With ``fused``, a float32 block pass is one call into the
        library (the target's fused forward in block mode, models/fused_forward.py). ``weight_dtype``
        int8: weight-only int8 GEMMs (models/weight_formats.py), the Markov head's in bf16."""
        self._kernels = lib
        if isinstance(self.markov_head, MarkovHead):  # its greedy block: W2 in bf16 at 1-2 requests
            w2 = self.markov_head.markov_w2.weight
            low = weight_dtype in (torch.bfloat16, torch.int8)
            bf16 = low and bf16_supported(lib) and bf16_weights.fits(w2.t())
            self.markov_head.serve_bf16(GREEDY_BF16_ROWS if bf16 else 0)
            self.markov_head.serve_packed_f32(f32_weights.kernel_serves(lib))
        layers = serving_layer_weights(cast("list[DraftLayer]", self.layers)) if fused else None
        if layers is None:
            self._fused = self._fused_context = None
            return
        shared = self.shared
        weights = DecoderWeights(
            shared.embed_tokens.weight,
            layers,
            self.norm.weight.data,
            shared.lm_head.weight.data,
            self.rotary_emb.inv_freq,
        )
        decoder = DecoderShape.of(self.config)
        self._fused = FusedForward.build(lib, decoder, weights, weight_dtype)
        shape = ContextShape(decoder.hidden, decoder.heads, self.hidden_norm.eps)
        self._fused_context = FusedContextWrite.build(  # fc has no bias (DeepSpec's layout)
            lib,
            shape,
            self.fc.weight.data,
            self.hidden_norm.weight.data,
            layers,
            self.rotary_emb.inv_freq,
            weight_dtype,
        )

    @property
    def serving_weight_dtype(self) -> torch.dtype:
        """The dtype its block pass's GEMMs read (float32 off the fused path)."""
        return self._fused.weight_dtype if self._fused is not None else torch.float32

    def _kernels_for(self, x: torch.Tensor, pool: KVPool) -> ctypes.CDLL | None:
        fused = cast("DraftLayer", self.layers[0]).self_attn._qkv is not None
        usable = fused and not torch.is_grad_enabled() and layer_ops.supports(x) and pool.k.dtype == x.dtype
        return self._kernels if usable else None

    @property
    def gamma(self) -> int:
        return self.config.gamma

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """Pass as ``TargetModel.forward(capture_layers=...)`` to get this drafter's features."""
        return self.config.target_layer_ids

    def new_kv_pool(
        self, num_slots: int, dtype: torch.dtype | None = None, impl: str | None = None
    ) -> KVPool:
        """A context K/V pool with the same slot numbering as the target's pool (``impl``: how
        ``backbone`` reads it, as for the target's pool)."""
        dtype = dtype or self.fc.weight.dtype
        cfg = self.config
        return KVPool(len(self.layers), num_slots, cfg.num_key_value_heads, cfg.head_dim, dtype, impl=impl)

    def serves_pool(self, pool: KVPool) -> bool:
        """Whether inference can use ``pool`` as its context cache: one of the weights' dtype
        always; a bfloat16 cache under float32 only where both fused calls (the block pass and the
        context write) read it."""
        if pool.k.dtype == self.fc.weight.dtype:
            return True
        fused, context = self._fused, self._fused_context
        return fused is not None and context is not None and fused.reads(pool) and context.reads(pool)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.shared.embed_tokens(ids).to(self.fc.weight.dtype)

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [..., n_layers * H] -> injected context [..., H]."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.shared.lm_head.weight
        return F.linear(hidden.to(w.dtype), w)

    # ------------------------------------------------------------------ serving

    @torch.no_grad()
    def write_context(
        self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, pool: KVPool
    ) -> None:
        """Write every draft layer's context K/V for T newly committed target positions.

        features [T, n_layers * H] (``TargetOutput.hidden`` rows), positions [T], slots [T]: the
        slots of those positions in the shared page table.
        """
        fused = self._fused_context
        if fused is not None and not torch.is_grad_enabled() and fused.reads(pool):
            fused(features, positions, slots, pool)
            return
        layers = cast("list[DraftLayer]", self.layers)
        x = self.fc(features.to(self.fc.weight.dtype))
        lib = self._kernels_for(x, pool)
        if lib is not None:
            norm, inv_freq = self.hidden_norm, self.rotary_emb.inv_freq.float()
            ctx = layer_ops.rms_norm(lib, x, norm.weight, norm.eps)[0]
            for i, layer in enumerate(layers):
                layer.self_attn.kv_kernels(lib, ctx, positions, inv_freq, slots, (pool.k[i], pool.v[i]))
            return
        ctx = self.hidden_norm(x)
        cos, sin = self.rotary_emb.cos_sin(positions, ctx.dtype)
        for i, layer in enumerate(layers):
            k, v = layer.self_attn.kv(ctx, cos, sin)
            pool.k[i].index_copy_(0, slots, k.to(pool.k.dtype))
            pool.v[i].index_copy_(0, slots, v.to(pool.v.dtype))

    @torch.no_grad()
    def backbone(
        self, anchor_tokens: torch.Tensor, anchor_positions: torch.Tensor, ctx: DraftContext, pool: KVPool
    ) -> DraftBlock:
        """One parallel pass for R requests: anchor_tokens [R], anchor_positions [R] (position of
        the anchor == number of committed tokens before it), ctx from ``DraftContext``."""
        r, g = anchor_tokens.shape[0], self.gamma
        block_ids = np.full((r, g), self.config.mask_token_id, dtype=np.int64)  # NumPy: ~1 µs a call
        block_ids[:, 0] = anchor_tokens.long().numpy()
        ids = torch.from_numpy(block_ids)
        pos = torch.from_numpy((anchor_positions.long().numpy()[:, None] + np.arange(g)).reshape(-1))
        fused = self._fused
        if fused is not None and not torch.is_grad_enabled() and fused.reads(pool):
            logits, normed = fused.block(
                ids.reshape(-1), pos, pool, PagedLayout.blocks(ctx.slots, ctx.lens, g)
            )
            return DraftBlock(hidden=normed.view(r, g, -1), logits=logits.view(r, g, -1))
        x = self.embed(ids.reshape(-1))
        hq, hkv, d = self.config.num_attention_heads, self.config.num_key_value_heads, self.config.head_dim
        if resolve_impl(pool.impl, x.dtype, pool.k[0], hq) == "gather":
            attends = gather_attends(pool, ctx.slots, ctx.lens, r, g, (hq, hkv, d), len(self.layers))
        else:
            layout = PagedLayout.blocks(ctx.slots, ctx.lens, g)
            attends = [paged_block_attend(pool, i, layout) for i in range(len(self.layers))]
        layers = cast("list[DraftLayer]", self.layers)
        lib = self._kernels_for(x, pool)
        if lib is not None:
            inv_freq = self.rotary_emb.inv_freq.float()
            for layer, attend in zip(layers, attends, strict=True):
                x = layer.forward_kernels(lib, x, pos, inv_freq, attend)
            h = layer_ops.rms_norm(lib, x, self.norm.weight, self.norm.eps)[0].view(r, g, -1)
        else:
            cos, sin = self.rotary_emb.cos_sin(pos, x.dtype)
            for layer, attend in zip(layers, attends, strict=True):
                x = layer(x, cos, sin, attend)
            h = self.norm(x).view(r, g, -1)
        return DraftBlock(hidden=h, logits=self.base_logits(h))

    def init_head_state(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Head state before step 1; hidden [R, H] (e.g. ``block.hidden[:, 0]``). None if stateless."""
        return None if self.markov_head is None else self.markov_head.init_state(hidden)

    def head_step(
        self, prev_tokens: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """prev_tokens [R] (x_{k-1}; the anchor for k = 1), hidden [R, H] (h_k), state ->
        (additive logits B_k [R, V], next state). Zeros for a parallel-only drafter."""
        if self.markov_head is None:
            return hidden.new_zeros(hidden.shape[0], self.config.vocab_size), state
        return self.markov_head.step(prev_tokens, hidden, state)

    def step_logits(
        self,
        base_logits: torch.Tensor,
        prev_tokens: torch.Tensor,
        hidden: torch.Tensor,
        state: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """U_k + B_k: base_logits [R, V] -> (draft logits [R, V], next state)."""
        if self.markov_head is None:
            return base_logits, state
        return self.markov_head.step_logits(base_logits, prev_tokens, hidden, state)

    def greedy_tokens(self, base_logits: torch.Tensor, anchor_tokens: torch.Tensor) -> torch.Tensor | None:
        """The greedy draft x_1..x_g [R, g] from the block's base logits [R, g, V] as one kernel
        call (the Markov head's ``greedy_block``), or None where it does not apply (then the
        caller runs ``step_logits`` position by position)."""
        if self.markov_head is None or self._kernels is None:
            return None
        return self.markov_head.greedy_block(self._kernels, base_logits, anchor_tokens)

    def sampled_tokens(
        self,
        base_logits: torch.Tensor,
        anchor_tokens: torch.Tensor,
        temperature: torch.Tensor,
        uniforms: torch.Tensor,
        keyed: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The sampled draft (tokens [R, g], q [R, g, V]) for rows shaped by temperature alone, as
        one kernel call (the Markov head's ``sample_block``; ``keyed``: seeded rows' flags and
        noise keys), or None where it does not apply."""
        if self.markov_head is None or self._kernels is None:
            return None
        return self.markov_head.sample_block(
            self._kernels, base_logits, anchor_tokens, temperature, uniforms, keyed
        )

    def confidence_logits(self, hidden: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor | None:
        """Raw confidence logits [...] (float32) from hidden [..., H] and x_{k-1} [...]."""
        if self.confidence_head is None:
            return None
        if hidden.device.type == "cpu" and hidden.dtype == torch.float32 and not torch.is_grad_enabled():
            w1 = None
            if self.config.confidence_head_with_markov:
                assert self.markov_head is not None
                w1 = self.markov_head.markov_w1.weight
            if w1 is None or w1.dtype == torch.float32:
                return self.confidence_head.serving_logits(hidden, prev_tokens.long(), w1)
        emb = None
        if self.config.confidence_head_with_markov:
            assert self.markov_head is not None
            emb = self.markov_head.prev_embed(prev_tokens)
        return self.confidence_head(hidden, emb)

    @torch.no_grad()
    def greedy_draft(
        self, block: DraftBlock, anchor_tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Reference left-to-right loop at temperature 0 -> (tokens [R, g], confidence logits)."""
        state = self.init_head_state(block.hidden[:, 0])
        prev, out = anchor_tokens.long(), []
        for k in range(self.gamma):
            logits, state = self.step_logits(block.logits[:, k], prev, block.hidden[:, k], state)
            prev = row_argmax(logits)
            out.append(prev)
        tokens = torch.stack(out, dim=1)
        prevs = torch.cat([anchor_tokens.long()[:, None], tokens[:, :-1]], dim=1)
        return tokens, self.confidence_logits(block.hidden, prevs)

    # ------------------------------------------------------------------ training

    def forward_train(
        self, features: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor
    ) -> DraftTrainOutput:
        """All blocks of a batch in one pass.

        features [B, S, n_layers * H]: target features of every position; input_ids [B, S];
        anchors [B, A]: anchor positions (block a covers positions a..a+g-1, predicts a+1..a+g).
        Each block attends to context positions < its anchor and to its own g tokens only.
        Draft logits use teacher forcing, x_{k-1} = data token (as DeepSpec). Rows whose block
        runs past S read clamped (last-token) ids and must be masked by the loss.
        """
        b, s = input_ids.shape
        a, g = anchors.shape[1], self.gamma
        anchors = anchors.long()
        pos = anchors[..., None] + torch.arange(g)  # [B, A, g]
        prev = torch.gather(input_ids, 1, pos.clamp(max=s - 1).view(b, -1)).view(b, a, g)
        ids = torch.full_like(prev, self.config.mask_token_id)
        ids[..., 0] = prev[..., 0]
        x = self.embed(ids.view(-1))
        cos, sin = self.rotary_emb.cos_sin(pos.reshape(-1), x.dtype)
        ctx = self.project_context(features).reshape(b * s, -1)
        ccos, csin = self.rotary_emb.cos_sin(torch.arange(s).repeat(b), x.dtype)
        ctx_ok = torch.arange(s)[None, None, :] < anchors[..., None]  # [B, A, S]
        ctx_ok = ctx_ok[:, None, :, None, :].expand(b, 1, a, g, s).reshape(b, 1, a * g, s)
        rep = self.config.num_attention_heads // self.config.num_key_value_heads
        for layer in cast("list[DraftLayer]", self.layers):
            kc, vc = layer.self_attn.kv(ctx, ccos, csin)  # [B*S, Hkv, D]

            def attend(
                q: torch.Tensor,
                k: torch.Tensor,
                v: torch.Tensor,
                kc: torch.Tensor = kc,
                vc: torch.Tensor = vc,
            ) -> torch.Tensor:
                return _train_block_attention(q, k, v, kc, vc, ctx_ok, b, a, g, s, rep)

            x = layer(x, cos, sin, attend)
        h = self.norm(x).view(b, a, g, -1)
        logits = self.base_logits(h)
        if self.markov_head is not None:
            logits = logits + self.markov_head.block_bias(prev, h).to(logits.dtype)
        return DraftTrainOutput(
            logits=logits, confidence_logits=self.confidence_logits(h, prev), hidden=h, prev_tokens=prev
        )


def _train_block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    ctx_ok: torch.Tensor,
    b: int,
    a: int,
    g: int,
    s: int,
    rep: int,
) -> torch.Tensor:
    """Softmax over [context keys (masked by anchor); own block keys], without the A*g x A*g
    block-to-block score matrix. q [B*A*g, Hq, D], k/v [B*A*g, Hkv, D], kc/vc [B*S, Hkv, D]."""
    hq, d = q.shape[1], q.shape[2]
    qb = q.view(b, a, g, hq, d).permute(0, 3, 1, 2, 4)  # [B, Hq, A, g, D]
    kb = k.view(b, a, g, -1, d).permute(0, 3, 1, 2, 4).repeat_interleave(rep, dim=1)
    vb = v.view(b, a, g, -1, d).permute(0, 3, 1, 2, 4).repeat_interleave(rep, dim=1)
    kcb = kc.view(b, s, -1, d).transpose(1, 2).repeat_interleave(rep, dim=1)  # [B, Hq, S, D]
    vcb = vc.view(b, s, -1, d).transpose(1, 2).repeat_interleave(rep, dim=1)
    scale = d**-0.5
    s_ctx = (qb.reshape(b, hq, a * g, d) @ kcb.transpose(-1, -2)) * scale  # [B, Hq, A*g, S]
    s_ctx = s_ctx.masked_fill(~ctx_ok, float("-inf"))
    s_blk = (qb @ kb.transpose(-1, -2)).reshape(b, hq, a * g, g) * scale
    p = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1).float(), dim=-1).to(q.dtype)
    p_ctx, p_blk = p[..., :s], p[..., s:]
    out = p_ctx @ vcb + (p_blk.reshape(b, hq, a, g, g) @ vb).reshape(b, hq, a * g, d)
    return out.permute(0, 2, 1, 3).reshape(b * a * g, hq, d)
