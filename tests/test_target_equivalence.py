"""Our decoder must reproduce transformers' logits on prefill, decode and ragged extends."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest
import torch

from dspark_server.engine.batch import PackedBatch, SeqChunk, pack
from dspark_server.engine.kv_cache import PageAllocator, PageTable
from dspark_server.models import layer_ops
from dspark_server.models.attention import KVPool
from dspark_server.models.fused_forward import FusedForward
from dspark_server.models.kernel_library import load_library
from dspark_server.models.loader import load_target
from dspark_server.models.target import TargetModel

transformers = pytest.importorskip("transformers")

VOCAB = 97


def _save_hf(tmp_path: Path, arch: str, **extra: object) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    common: dict = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
    )
    common.update(extra)
    if arch == "qwen3":
        cfg = transformers.Qwen3Config(head_dim=16, **common)
        model = transformers.Qwen3ForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(cfg)
    model = model.float().eval()
    out = tmp_path / arch
    model.save_pretrained(out, safe_serialization=True)
    return out, model


def _layers(ours: TargetModel, layers: str, monkeypatch: pytest.MonkeyPatch) -> collections.Counter[str]:
    """Serve ``ours`` with the whole forward as one kernel call where it applies ("fused"), the
    layer-by-layer kernel calls ("kernels") or PyTorch ops ("torch"); returns a counter of the
    fused forwards and the layer kernels' calls, so a test can tell which path ran."""
    lib = load_library()
    if layers != "torch" and lib is None:
        pytest.skip("the C++ kernel library could not be built")
    ours.use_kernels(lib if layers != "torch" else None, fused=layers == "fused")
    assert (ours._fused is not None) == (layers == "fused")
    calls: collections.Counter[str] = collections.Counter()
    real = layer_ops.silu_mul

    def counted(lib: object, gate_up: torch.Tensor) -> torch.Tensor:
        calls["layer"] += 1
        return real(lib, gate_up)  # type: ignore[arg-type]

    monkeypatch.setattr(layer_ops, "silu_mul", counted)
    if ours._fused is not None:
        fused_call = FusedForward.__call__

        def counted_fused(self: FusedForward, *args: Any) -> Any:
            calls["fused"] += 1
            return fused_call(self, *args)

        monkeypatch.setattr(FusedForward, "__call__", counted_fused)
    return calls


def _expect_path(calls: collections.Counter[str], layers: str, impl: str = "auto") -> None:
    """The path that ran: fused where it applies (float32, the paged kernel), else layer kernels."""
    fused = layers == "fused" and impl == "auto"
    assert (calls["fused"] > 0) == fused
    assert (calls["layer"] > 0) == (layers == "kernels" or (layers == "fused" and not fused))


def _prefill(ids: list[int]) -> tuple[PackedBatch, KVPool]:
    """One sequence's prefill over a fresh pool sized for the 3-layer test models."""
    alloc = PageAllocator(num_pages=8, page_size=4)
    pool = KVPool(3, alloc.num_slots, 2, 16, torch.float32)
    table = PageTable()
    assert alloc.reserve(table, len(ids))
    return pack([SeqChunk(table, 0, ids)], alloc), pool


def _hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


CASES = [
    ("qwen3", {}),
    ("qwen3", {"tie_word_embeddings": True}),
    ("llama", {}),
    (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            "rope_theta": 500000.0,
        },
    ),
]


@pytest.mark.parametrize("layers", ["fused", "kernels", "torch"])
@pytest.mark.parametrize("impl", ["auto", "torch", "gather"])
@pytest.mark.parametrize(("arch", "extra"), CASES)
def test_mixed_ragged_batch_matches_transformers(
    tmp_path: Path, arch: str, extra: dict, impl: str, layers: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir, hf = _save_hf(tmp_path, arch, **extra)
    ours = load_target(model_dir)
    kernel_calls = _layers(ours, layers, monkeypatch)
    cfg = ours.config
    alloc = PageAllocator(num_pages=32, page_size=4)
    pool = KVPool(
        cfg.num_hidden_layers, alloc.num_slots, cfg.num_key_value_heads, cfg.head_dim, torch.float32, impl
    )
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (11, 23, 17, 9)]

    def run(chunks: list[SeqChunk]) -> torch.Tensor:
        for c in chunks:
            assert alloc.reserve(c.table, c.start + len(c.token_ids))
        batch = pack(chunks, alloc)
        with torch.no_grad():
            out = ours(batch.input_ids, batch.positions, batch.attention(pool))
        for c in chunks:
            c.table.length = c.start + len(c.token_ids)
        return out.logits

    tables = [PageTable() for _ in seqs]
    # Step 1: histories for sequences 1..3 (sequence 0 waits to be prefilled in the mixed step).
    hist = [0, 14, 16, 5]
    run([SeqChunk(tables[i], 0, seqs[i][: hist[i]]) for i in (1, 2, 3)])
    # Step 2, one mixed batch: full prefill, ragged 3- and 1-token extends, and a 4-token extend.
    new = [11, 3, 1, 4]
    chunks = [SeqChunk(tables[i], hist[i], seqs[i][hist[i] : hist[i] + new[i]]) for i in range(4)]
    logits = run(chunks)
    offset = 0
    for i in range(4):
        ref = _hf_logits(hf, seqs[i][: hist[i] + new[i]])[hist[i] :]
        got = logits[offset : offset + new[i]]
        offset += new[i]
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    _expect_path(kernel_calls, layers, impl)


@pytest.mark.parametrize("layers", ["fused", "kernels", "torch"])
def test_hidden_capture_matches_transformers_hidden_states(
    tmp_path: Path, layers: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir, hf = _save_hf(tmp_path, "qwen3")
    ours = load_target(model_dir)
    kernel_calls = _layers(ours, layers, monkeypatch)
    ids = list(range(5, 18))
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    batch, pool = _prefill(ids)
    with torch.no_grad():
        out = ours(
            batch.input_ids,
            batch.positions,
            batch.attention(pool),
            logits_rows=batch.last_rows(),
            capture_layers=(1, 0),  # returned in the order asked for
        )
    assert out.logits.shape == (1, VOCAB)
    assert out.hidden is not None
    torch.testing.assert_close(out.hidden[:, :64], ref[2][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.hidden[:, 64:], ref[1][0], atol=1e-4, rtol=1e-4)
    _expect_path(kernel_calls, layers)


def test_a_model_with_attention_biases_keeps_the_layer_kernels(tmp_path: Path) -> None:
    """The fused forward has no projection biases: a biased model is served layer by layer,
    and still matches transformers."""
    lib = load_library()
    if lib is None:
        pytest.skip("the C++ kernel library could not be built")
    model_dir, hf = _save_hf(tmp_path, "llama", attention_bias=True)
    ours = load_target(model_dir)
    ours.use_kernels(lib, fused=True)
    assert ours._fused is None
    ids = list(range(3, 20))
    batch, pool = _prefill(ids)
    with torch.no_grad():
        got = ours(batch.input_ids, batch.positions, batch.attention(pool)).logits
    torch.testing.assert_close(got, _hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("setting", ["", "blas"])
def test_fused_float32_gemms_read_packed_copies_where_the_shapes_fit(
    tmp_path: Path, setting: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Float32 GEMMs of a few rows run kernels/linear_f32.cpp on packed copies of the weights:
    every layer weight here (N a multiple of 8) has one, the LM head (97 columns) does not and
    the sgemm serves it, and DSPARK_F32_GEMM=blas keeps no copies. Either way the logits match
    transformers."""
    from dspark_server.models import f32_weights

    lib = load_library()
    if lib is None or not lib.dspark_has_linear_f32():
        pytest.skip("no kernel library built for AVX2 + FMA here")
    monkeypatch.setenv("DSPARK_F32_GEMM", setting)
    model_dir, hf = _save_hf(tmp_path, "qwen3")
    ours = load_target(model_dir)
    ours.use_kernels(lib, fused=True)
    fused = ours._fused
    assert fused is not None and fused.lm_packed == 0
    table = fused.weights.view(-1, 11)  # per layer: norm, qkv, packed, qk norm, o, packed, norm, ...
    packed = table[:, [2, 5, 8, 10]]
    assert bool((packed != 0).all()) if setting == "" else bool((packed == 0).all())
    assert f32_weights.kernel_serves(lib) == (setting == "")
    ids = list(range(3, 20))
    batch, pool = _prefill(ids)
    with torch.no_grad():
        got = ours(batch.input_ids, batch.positions, batch.attention(pool)).logits
    torch.testing.assert_close(got, _hf_logits(hf, ids), atol=1e-4, rtol=1e-4)
