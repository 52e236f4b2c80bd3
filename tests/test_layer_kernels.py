"""The fused layer kernels (kernels/layer_ops.cpp) against the PyTorch ops they replace.

float32 must agree to float32 rounding; bfloat16 must round where PyTorch rounds: nearly every
element bit-identical and none more than one bfloat16 step apart (a kernel that skipped one of
PyTorch's roundings would differ in a large share of elements).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dspark_server.config import ModelConfig
from dspark_server.models import layer_ops
from dspark_server.models.kernel_library import load_library
from dspark_server.models.layers import RMSNorm, RotaryEmbedding
from dspark_server.models.target import SelfAttention

LIB = load_library()
pytestmark = pytest.mark.skipif(LIB is None, reason="the C++ kernel library could not be built")
DTYPES = [torch.float32, torch.bfloat16]


def assert_rounds_like(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal within float32 rounding (float32), or within one bfloat16 step and bit-identical in
    at least 98% of elements (bfloat16: the float32 sums inside may round the last bit apart)."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        return
    g, r = got.float(), ref.float()
    step = r.abs().clamp_min(1e-30) * 2.0**-7
    assert bool(((g - r).abs() <= step * 1.01).all()), float((g - r).abs().max())
    assert float((g == r).float().mean()) >= 0.98


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_module(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(192, eps=1e-6).to(dtype)
    norm.weight.data = (1 + torch.randn(192, generator=g) * 0.3).to(dtype)
    x = (torch.randn(37, 192, generator=g) * 3).to(dtype)
    out, total = layer_ops.rms_norm(LIB, x, norm.weight.data, norm.eps)
    assert total is x
    with torch.no_grad():
        assert_rounds_like(out, norm(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_add_then_norm(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    norm = RMSNorm(256, eps=1e-5).to(dtype)
    x, delta = ((torch.randn(300, 256, generator=g) * s).to(dtype) for s in (4.0, 0.5))  # 300 rows: threaded
    out, total = layer_ops.rms_norm(LIB, x, norm.weight.data, norm.eps, delta=delta)
    assert torch.equal(total, x + delta)
    with torch.no_grad():
        assert_rounds_like(out, norm(x + delta))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    gate_up = (torch.randn(70, 2 * 96, generator=g) * 3).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    assert_rounds_like(layer_ops.silu_mul(LIB, gate_up), F.silu(gate) * up)


def _attention(qk_norm: bool, dtype: torch.dtype) -> tuple[SelfAttention, RotaryEmbedding]:
    cfg = ModelConfig(
        architecture="qwen3" if qk_norm else "llama",
        vocab_size=50,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(3)
    attn = SelfAttention(cfg)
    if qk_norm:
        for norm in (attn.q_norm, attn.k_norm):
            norm.weight.data = 1 + torch.randn(32) * 0.3
    attn = attn.to(dtype)
    attn.fuse()
    return attn, RotaryEmbedding(32, 10000.0)


@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_store_matches_projection_path(qk_norm: bool, dtype: torch.dtype) -> None:
    attn, rotary = _attention(qk_norm, dtype)
    assert attn._qkv is not None
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, 64, generator=g).to(dtype)
    positions = torch.tensor([0, 1, 2, 17, 18, 300, 301, 302, 2047])
    slots = torch.tensor([5, 6, 7, 20, 21, 40, 41, 42, 60])
    with torch.no_grad():
        cos, sin = rotary.cos_sin(positions, dtype)
        q_ref, k_ref, v_ref = attn._fused_qkv(x, cos, sin, attn._qkv)
        qkv = F.linear(x, *attn._qkv)
    k_cache, v_cache = (torch.zeros(64, 2, 32, dtype=dtype) for _ in range(2))
    eps = attn.q_norm.eps if qk_norm else 0.0
    q = layer_ops.qk_norm_rope_store(
        LIB, qkv, (4, 2, 32), positions, rotary.inv_freq, attn._qk_norm_weight, eps, slots, k_cache, v_cache
    )
    assert_rounds_like(q, q_ref)
    assert_rounds_like(k_cache[slots], k_ref)
    assert torch.equal(v_cache[slots], v_ref)
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


@pytest.mark.parametrize("qk_norm", [True, False])
def test_qk_norm_rope_store_into_a_bfloat16_cache_rounds_keys_and_values_once(qk_norm: bool) -> None:
    """Float32 activations, bfloat16 caches (--kv-cache-dtype bfloat16): q is the float32 call's,
    bit for bit, and the stored keys and values are the float32 call's rounded to bfloat16."""
    attn, rotary = _attention(qk_norm, torch.float32)
    assert attn._qkv is not None
    g = torch.Generator().manual_seed(5)
    x = torch.randn(9, 64, generator=g)
    positions = torch.tensor([0, 1, 2, 17, 18, 300, 301, 302, 2047])
    slots = torch.tensor([5, 6, 7, 20, 21, 40, 41, 42, 60])
    with torch.no_grad():
        qkv = F.linear(x, *attn._qkv)
    eps = attn.q_norm.eps if qk_norm else 0.0
    args = ((4, 2, 32), positions, rotary.inv_freq, attn._qk_norm_weight, eps, slots)
    k32, v32 = (torch.zeros(64, 2, 32) for _ in range(2))
    q32 = layer_ops.qk_norm_rope_store(LIB, qkv, *args, k32, v32)
    kb, vb = (torch.zeros(64, 2, 32, dtype=torch.bfloat16) for _ in range(2))
    q = layer_ops.qk_norm_rope_store(LIB, qkv, *args, kb, vb)
    assert q.dtype == torch.float32 and torch.equal(q, q32)
    assert torch.equal(kb, k32.bfloat16()) and torch.equal(vb, v32.bfloat16())
    with pytest.raises(ValueError, match="no kernel stores"):
        layer_ops.qk_norm_rope_store(LIB, qkv.bfloat16(), *args, k32, v32)
