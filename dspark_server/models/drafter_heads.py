"""The drafter's sequential heads (Markov / gated Markov / RNN) and its confidence head.

Module and parameter names follow DeepSpec (``deepspec/modeling/dspark/markov_head.py`` and
``AcceptRatePredictor`` in ``common.py``) so a DeepSpec ``model.safetensors`` loads unchanged:

- ``markov_head.markov_w1.weight`` [V, r]   W1, embedding of the previous token
- ``markov_head.markov_w2.weight`` [V, r]   W2 (Linear r -> V, no bias)
- ``markov_head.gate_proj.{weight [r, H + r], bias [r]}``       gated head only, input [h; W1[x]]
- ``markov_head.joint_proj.{weight [3r, 2r + H], bias [3r]}``   RNN head only, input [s; W1[x]; h]
- ``confidence_head.proj.{weight [1, H (+ r)], bias [1]}``      input [h; W1[x_{k-1}]]

Every head maps (previous token, backbone hidden state h_k, state) to an additive logit bias B_k
through the rank-r bottleneck; nothing here materialises a V x V matrix.
"""

from __future__ import annotations

import ctypes
from typing import Literal, NamedTuple

import numpy as np
import torch
from torch import nn

from dspark_server.models import bf16_weights, f32_weights
from dspark_server.models.drafter_config import DraftConfig
from dspark_server.models.kernel_library import blas_sgemm

W2Layout = Literal["f32", "f32_packed", "bf16"]


class _BlockArgs(NamedTuple):
    """What the Markov block kernels read: the BLAS sgemm's address, contiguous base logits
    [R, g, V], int64 anchors [R] and W1 [V, r]."""

    sgemm: int
    base: torch.Tensor
    anchors: torch.Tensor
    w1: torch.Tensor


class MarkovHead(nn.Module):
    """B_k = W2 W1[x_{k-1}]: a rank-r first-order transition; h_k is ignored. Stateless."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        # W2^T per layout (float32, its packed float32 panels, packed bf16) with the (address,
        # version) of W2 it was made from: greedy blocks at few requests read the bf16 one under
        # weight-only bf16, other blocks the float32 ones, and a step of each kind in turn must
        # not rebuild any (~1.1 ms a time)
        self._w2t: dict[W2Layout, tuple[tuple[int, int], torch.Tensor]] = {}
        self.bf16_rows = 0  # greedy_block: up to this many requests, W2^T in bf16 (serve_bf16)
        self.packed_f32 = False  # the float32 block kernels read W2^T's packed copy (serve_packed_f32)

    def serve_bf16(self, rows: int) -> None:
        """Weight-only bf16 serving: ``greedy_block`` reads W2^T in bfloat16 for blocks of up to
        ``rows`` requests (0: float32 always)."""
        self.bf16_rows = rows
        self._w2t = {}

    def serve_packed_f32(self, on: bool) -> None:
        """Whether the float32 block kernels read a packed copy of W2^T (models/f32_weights.py;
        where W2^T's shape fits), decided once with the library the drafter serves with."""
        self.packed_f32 = on
        self._w2t = {}

    def prev_embed(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        """W1[x] for token ids of any shape -> [..., r]."""
        return self.markov_w1(prev_tokens.long())

    def init_state(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """State before step 1 for hidden [R, H] (None for stateless heads)."""
        return None

    def latent(
        self, prev_emb: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rank-r vector W2 is applied to, and the next state."""
        return prev_emb, state

    def step(
        self, prev_tokens: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """prev_tokens [R], hidden [R, H] -> (bias [R, V], next state)."""
        z, state = self.latent(self.prev_embed(prev_tokens), hidden.to(self.markov_w1.weight.dtype), state)
        return self.markov_w2(z), state

    def step_logits(
        self,
        base_logits: torch.Tensor,
        prev_tokens: torch.Tensor,
        hidden: torch.Tensor,
        state: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """base [R, V] + bias in one fused GEMM (no separate [R, V] add) -> (logits, next state)."""
        z, state = self.latent(self.prev_embed(prev_tokens), hidden.to(self.markov_w1.weight.dtype), state)
        w2 = self.markov_w2.weight
        if base_logits.dtype == w2.dtype and base_logits.dim() == 2:
            return torch.addmm(base_logits, z, w2.t()), state
        return base_logits + self.markov_w2(z).to(base_logits.dtype), state

    def _block_kernel(
        self, lib: ctypes.CDLL | None, symbol: str, base_logits: torch.Tensor, anchors: torch.Tensor
    ) -> _BlockArgs | None:
        """The inputs both block kernels take, or None where ``symbol`` does not apply (no library
        or BLAS, a head with a latent other than W1[x], not float32 [R, g, V] base logits)."""
        w1 = self.markov_w1.weight
        if lib is None or type(self).latent is not MarkovHead.latent or not hasattr(lib, symbol):
            return None
        if not (base_logits.dtype == w1.dtype == self.markov_w2.weight.dtype == torch.float32):
            return None
        sgemm = blas_sgemm()
        if sgemm is None or base_logits.dim() != 3:
            return None
        return _BlockArgs(
            sgemm, base_logits.contiguous(), anchors.to(torch.int64).contiguous(), w1.detach().contiguous()
        )

    def greedy_block(
        self, lib: ctypes.CDLL | None, base_logits: torch.Tensor, anchors: torch.Tensor
    ) -> torch.Tensor | None:
        """x_k = argmax(U_k + B_k(x_{k-1})) for k = 1..g as one kernel call (kernels/markov_greedy.cpp):
        base_logits [R, g, V] float32, anchors [R] -> tokens [R, g]. None where the kernel does not
        apply (``_block_kernel``)."""
        k = self._block_kernel(lib, "dspark_markov_greedy_f32", base_logits, anchors)
        if k is None:
            return None
        assert lib is not None
        r, g, v = k.base.shape
        tokens = torch.empty(r, g, dtype=torch.int64)
        args = (r, g, v, self.rank, k.base.data_ptr(), k.anchors.data_ptr(), k.w1.data_ptr())
        threads = torch.get_num_threads()
        if r <= self.bf16_rows:
            w2b = self._w2_transposed("bf16")
            rc = lib.dspark_markov_greedy_bf16w(*args, w2b.data_ptr(), tokens.data_ptr(), threads)
        else:
            w2t, w2p = self._w2_float32()
            rc = lib.dspark_markov_greedy_f32(k.sgemm, *args, w2t, w2p, tokens.data_ptr(), threads)
        if rc != 0:
            raise RuntimeError(f"greedy Markov head kernel failed with code {rc}")
        return tokens

    def sample_block(
        self,
        lib: ctypes.CDLL | None,
        base_logits: torch.Tensor,
        anchors: torch.Tensor,
        temperature: torch.Tensor,
        uniforms: torch.Tensor,
        keyed: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """x_k ~ softmax((U_k + B_k(x_{k-1})) / T) by inverse CDF with uniforms[:, k], k = 1..g, as
        one kernel call (kernels/markov_sample.cpp): base_logits [R, g, V] float32, anchors [R],
        temperature [R] (> 0), uniforms [R, g] -> (tokens [R, g], q [R, g, V] each token was drawn
        from). ``keyed`` (flags [R] uint8, keys [R, g] uint64): seeded rows draw x_k by their keyed
        noise instead (engine/noise.py). None where the kernel does not apply (``_block_kernel``)."""
        k = self._block_kernel(lib, "dspark_markov_sample_f32", base_logits, anchors)
        if k is None:
            return None
        assert lib is not None
        r, g, v = k.base.shape
        temps = temperature.float().contiguous()
        u = uniforms.double().contiguous()
        tokens = torch.empty(r, g, dtype=torch.int64)
        probs = torch.empty(r, g, v, dtype=torch.float32)
        args = (
            r,
            g,
            v,
            self.rank,
            k.base.data_ptr(),
            k.anchors.data_ptr(),
            k.w1.data_ptr(),
            *self._w2_float32(),
        )
        flags, keys = (None, None) if keyed is None else (np.ascontiguousarray(a) for a in keyed)
        seeded = (None, None) if flags is None or keys is None else (flags.ctypes.data, keys.ctypes.data)
        outs = (temps.data_ptr(), u.data_ptr(), *seeded, tokens.data_ptr(), probs.data_ptr())
        rc = lib.dspark_markov_sample_f32(k.sgemm, *args, *outs, torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"sampled Markov head kernel failed with code {rc}")
        return tokens, probs

    def _w2_transposed(self, layout: W2Layout = "f32") -> torch.Tensor:
        """W2 [V, r] as a contiguous [r, V] copy (what the sgemm reads), or that copy packed for
        linear_f32.cpp or, in bf16, for linear_bf16.cpp; rebuilt if W2 changed."""
        w2 = self.markov_w2.weight
        key = (w2.data_ptr(), w2._version)
        cached = self._w2t.get(layout)
        if cached is None or cached[0] != key:
            wt = w2.detach().t().contiguous()
            if layout == "f32_packed":
                wt = f32_weights.packed(wt)
            elif layout == "bf16":
                wt = bf16_weights.packed(wt)
            cached = self._w2t[layout] = (key, wt)
        return cached[1]

    def _w2_float32(self) -> tuple[int, int]:
        """The addresses of W2^T and of its packed copy (0 where the float32 kernel does not serve)."""
        w2t = self._w2_transposed("f32")
        if not (self.packed_f32 and f32_weights.fits(w2t)):
            return w2t.data_ptr(), 0
        return w2t.data_ptr(), self._w2_transposed("f32_packed").data_ptr()

    def block_bias(self, prev_tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Teacher-forced biases for whole blocks: prev [..., g], hidden [..., g, H] -> [..., g, V]."""
        state = self.init_state(hidden[..., 0, :])
        emb = self.prev_embed(prev_tokens)
        hidden = hidden.to(emb.dtype)
        if state is None:  # stateless: all positions at once
            z, _ = self.latent(emb, hidden, None)
            return self.markov_w2(z)
        zs = []
        for k in range(prev_tokens.shape[-1]):
            z, state = self.latent(emb[..., k, :], hidden[..., k, :], state)
            zs.append(z)
        return self.markov_w2(torch.stack(zs, dim=-2))


class GatedMarkovHead(MarkovHead):
    """B_k = W2 (sigmoid(G [h_k; W1[x_{k-1}]] + b) * W1[x_{k-1}]). Stateless."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int) -> None:
        super().__init__(vocab_size, rank)
        self.gate_proj = nn.Linear(hidden_size + rank, rank)

    def latent(
        self, prev_emb: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, prev_emb], dim=-1)))
        return gate * prev_emb, state


class RNNHead(MarkovHead):
    """z = [s_{k-1}; W1[x_{k-1}]; h_k]; (g, c, o) = J z + b;
    s_k = sigmoid(g) * s_{k-1} + (1 - sigmoid(g)) * tanh(c); B_k = W2 tanh(o); s_0 = 0."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int) -> None:
        super().__init__(vocab_size, rank)
        self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def init_state(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.new_zeros(*hidden.shape[:-1], self.rank, dtype=self.markov_w1.weight.dtype)

    def latent(
        self, prev_emb: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert state is not None, "RNNHead needs the state from init_state"
        g, c, o = self.joint_proj(torch.cat([state, prev_emb, hidden], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(g)
        new_state = gate * state + (1.0 - gate) * torch.tanh(c)
        return torch.tanh(o), new_state


class ConfidenceHead(nn.Module):
    """Raw logit w^T [h_k; W1[x_{k-1}]] + b (DeepSpec ``AcceptRatePredictor``); the caller applies
    the sigmoid (and the STS temperature)."""

    def __init__(self, input_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)
        self._table: tuple[tuple[int, ...], np.ndarray] | None = None  # serving_logits' per-token term

    def forward(self, hidden: torch.Tensor, prev_emb: torch.Tensor | None) -> torch.Tensor:
        feats = hidden if prev_emb is None else torch.cat([hidden, prev_emb.to(hidden.dtype)], dim=-1)
        return self.proj(feats.to(self.proj.weight.dtype)).squeeze(-1).float()

    def serving_logits(
        self, hidden: torch.Tensor, prev_tokens: torch.Tensor, markov_w1: torch.Tensor | None
    ) -> torch.Tensor:
        """``forward`` for inference on float32 CPU tensors, from the tokens x_{k-1} themselves:
        w^T [h; W1[x]] + b = w_h^T h + (W1 w_e + b)[x], whose per-token term is computed once per
        weight version. A few NumPy calls instead of an embedding, a concatenation and a linear
        layer (equal up to float32 summation order)."""
        w = self.proj.weight.detach()
        b = self.proj.bias
        h = hidden.shape[-1]
        out = hidden.detach().contiguous().numpy() @ w[0, :h].numpy()
        if markov_w1 is None:
            return torch.from_numpy(out + (float(b) if b is not None else 0.0)).float()
        key = (
            w.data_ptr(),
            w._version,
            markov_w1.data_ptr(),
            markov_w1._version,
            -1 if b is None else b._version,
        )
        if self._table is None or self._table[0] != key:
            table = markov_w1.detach().numpy() @ w[0, h:].numpy()
            self._table = (key, table + (float(b) if b is not None else 0.0))
        return torch.from_numpy(out + self._table[1][prev_tokens.numpy()]).float()


def build_markov_head(cfg: DraftConfig) -> MarkovHead | None:
    if cfg.markov_rank == 0:
        return None
    if cfg.markov_head_type == "vanilla":
        return MarkovHead(cfg.vocab_size, cfg.markov_rank)
    if cfg.markov_head_type == "gated":
        return GatedMarkovHead(cfg.vocab_size, cfg.markov_rank, cfg.hidden_size)
    if cfg.markov_head_type == "rnn":
        return RNNHead(cfg.vocab_size, cfg.markov_rank, cfg.hidden_size)
    raise ValueError(f"unknown markov_head_type {cfg.markov_head_type!r}")


def build_confidence_head(cfg: DraftConfig) -> ConfidenceHead | None:
    return ConfidenceHead(cfg.confidence_input_dim) if cfg.enable_confidence_head else None
