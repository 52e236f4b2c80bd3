"""Weight-only bf16: the small-M kernel computes x @ W with x and W rounded to bf16 and fp32
accumulation, and the fused forward served from bf16 weights matches the float32 model whose
GEMM weights are those bf16 values (up to the activations' rounding at each GEMM's input)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dspark_server.engine.batch import SeqChunk, pack
from dspark_server.engine.kv_cache import PageAllocator, PageTable
from dspark_server.models import bf16_weights
from dspark_server.models.attention import KVPool
from dspark_server.models.kernel_library import load_library
from dspark_server.models.loader import load_target
from dspark_server.models.weight_formats import WeightFormat, bf16_supported

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def lib() -> object:
    lib = load_library()
    if not bf16_supported(lib):
        pytest.skip("no AVX512-BF16 (or no kernel library) here")
    return lib


def _skip_without_amx(lib: object, variant: int) -> None:
    if variant == 2 and not lib.dspark_has_amx():  # type: ignore[attr-defined]
        pytest.skip("no AMX-BF16 tile unit here")


@pytest.mark.parametrize("m", [1, 3, 8, 9, 16, 17, 20, 31, 77, 300])
@pytest.mark.parametrize("accumulate", [0, 1])
@pytest.mark.parametrize("variant", [0, 1, 2], ids=["dot", "fma", "amx"])
@pytest.mark.parametrize("n, k", [(160, 96), (512, 96), (512, 100)])
def test_bf16_kernel_is_the_bf16_rounded_product(
    lib: object, m: int, accumulate: int, variant: int, n: int, k: int
) -> None:
    _skip_without_amx(lib, variant)
    g = torch.Generator().manual_seed(m)
    # K even (100: its last 32-value chunk is partial, the tile unit's tail); N five blocks of 32,
    # or 16 (threads then take groups of 4 blocks, and a tail of 1-3 rows runs over several blocks
    # at once; the tile unit takes two at a time); m: one row, tails of 8-row groups and of 16-row
    # tiles, prefill-sized batches
    wt = torch.randn(k, n, generator=g)
    x = torch.randn(m, k, generator=g)
    out = torch.randn(m, n, generator=g)
    ref = (out if accumulate else 0) + x.bfloat16().float() @ wt.bfloat16().float()
    packed = bf16_weights.packed(wt)

    Tensor = torch.Tensor

    def linear(x: Tensor, out: Tensor, n: int = n, accumulate: int = 0, variant: int = variant) -> int:
        args = (x.data_ptr(), x.shape[0], k, packed.data_ptr(), n, out.data_ptr(), accumulate, 2, variant)
        return int(lib.dspark_linear_bf16_variant(*args))  # type: ignore[attr-defined]

    assert linear(x, out, accumulate=accumulate) == 0
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-5)
    # a row's result does not depend on the rows beside it: alone it gives the same bits
    batched = torch.empty(m, n)
    linear(x, batched)
    for i in range(0, m, max(1, m // 4)):
        single = torch.empty(1, n)
        linear(x[i : i + 1].contiguous(), single)
        assert torch.equal(single[0], batched[i])
    # a shape or a loop the kernel does not take is refused, not computed wrong
    assert linear(x, out, n=n - 16) == 1
    assert linear(x, out, variant=3) == 1


@pytest.mark.parametrize("name, code", [("dot", 0), ("fma", 1), ("amx", 2)])
def test_the_served_bf16_loop_can_be_chosen(lib: object, name: str, code: int) -> None:
    _skip_without_amx(lib, code)
    # DSPARK_BF16_GEMM picks the inner loop for the whole process (else it is timed once at start)
    probe = "from dspark_server.models import kernel_library as k; lib = k.load_library()\n"
    probe += "print(lib.dspark_bf16_gemm_variant())"
    env = {**os.environ, "DSPARK_BF16_GEMM": name}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == str(code)


def _model_dir(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=128,  # a multiple of 32, as every GEMM's N must be
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    out = tmp_path / "qwen3"
    transformers.Qwen3ForCausalLM(cfg).float().eval().save_pretrained(out, safe_serialization=True)
    return out


def test_fused_forward_from_bf16_weights_matches_the_bf16_rounded_model(lib: object, tmp_path: Path) -> None:
    model_dir = _model_dir(tmp_path)
    ours = load_target(model_dir)
    ref = copy.deepcopy(ours)
    with torch.no_grad():  # the reference: float32 PyTorch ops over the bf16-rounded GEMM weights
        for name, p in ref.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.copy_(p.bfloat16().float())
    ref.use_kernels(None)
    ours.use_kernels(lib, fused=True, weight_dtype=torch.bfloat16)  # type: ignore[arg-type]
    assert ours._fused is not None and ours._fused.weight_dtype == torch.bfloat16
    f32 = copy.deepcopy(load_target(model_dir))
    f32.use_kernels(lib, fused=True)  # type: ignore[arg-type]
    cfg = ours.config
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (46,), generator=g).tolist()
    results = []
    for model in (ours, ref, f32):
        alloc = PageAllocator(num_pages=16, page_size=4)
        pool = KVPool(
            cfg.num_hidden_layers, alloc.num_slots, cfg.num_key_value_heads, cfg.head_dim, torch.float32
        )
        table = PageTable()
        logits = []
        # a 40-token prefill, then extends of 5 and 1 tokens
        for start, stop in ((0, 40), (40, 45), (45, 46)):
            assert alloc.reserve(table, stop)
            batch = pack([SeqChunk(table, start, ids[start:stop])], alloc)
            with torch.no_grad():
                logits.append(model(batch.input_ids, batch.positions, batch.attention(pool)).logits)
            table.length = stop
        results.append(torch.cat(logits))
    got, want, full = results
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.95
    assert (got - full).abs().max() > 1e-4  # the bf16 weights were served, not the float32 ones


@pytest.mark.parametrize("tokens", [5, 40])  # a verification block, a prefill chunk
def test_context_write_from_bf16_weights_matches_the_bf16_rounded_drafter(lib: object, tokens: int) -> None:
    """The drafter's fused context write served from bf16 copies of fc and the k|v weights stores
    the K/V the PyTorch path stores for the bf16-rounded drafter (up to the activations'
    rounding at each GEMM's input), at the given slots and nowhere else."""
    from test_drafter import make_drafter, make_target

    target = make_target()
    target.fuse_projections()
    ours = make_drafter(target, "markov")
    ref, f32 = copy.deepcopy(ours), copy.deepcopy(ours)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.dim() == 2 and ("fc" in name or "k_proj" in name or "v_proj" in name):
                p.copy_(p.bfloat16().float())
    for model, dtype in ((ours, torch.bfloat16), (f32, torch.float32)):
        model.fuse_projections()
        model.use_kernels(lib, fused=True, weight_dtype=dtype)  # type: ignore[arg-type]
    assert ours._fused_context is not None and ours._fused_context.format == WeightFormat.BF16
    assert f32._fused_context is not None and f32._fused_context.format == WeightFormat.FLOAT32
    g = torch.Generator().manual_seed(tokens)
    feats = torch.randn(tokens, ours.config.context_dim, generator=g)
    positions = torch.arange(tokens) + 3
    slots = torch.randperm(64, generator=g)[:tokens] + 1
    pools = []
    for model in (ours, ref, f32):
        pool = model.new_kv_pool(80)
        model.write_context(feats, positions, slots, pool)
        pools.append(pool)
    got, want, full = pools
    untouched = torch.ones(80, dtype=torch.bool)
    untouched[slots] = False
    for a in (got.k, got.v):
        assert bool((a[:, untouched] == 0).all())
    torch.testing.assert_close(got.k[:, slots], want.k[:, slots], atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got.v[:, slots], want.v[:, slots], atol=3e-2, rtol=3e-2)
    assert (got.k[:, slots] - full.k[:, slots]).abs().max() > 1e-4  # bf16 weights were served


@pytest.mark.parametrize("rows", [1, 2])
def test_greedy_markov_block_from_bf16_w2_follows_the_bf16_rounded_head(lib: object, rows: int) -> None:
    """At one or two requests the greedy Markov draft reads W2 in bf16 under weight-only bf16:
    its tokens are the argmax of U_k + W2 W1[x_{k-1}] with W2 and W1[x] rounded to bf16."""
    from dspark_server.models.drafter_heads import MarkovHead

    torch.manual_seed(rows)
    vocab, rank = 160, 16  # the packed layout's shapes: V a multiple of 32, r even
    head = MarkovHead(vocab, rank)
    head.serve_bf16(2)
    g = torch.Generator().manual_seed(rows)
    base = torch.randn(rows, 7, vocab, generator=g) * 0.3  # small: the bias decides
    anchors = torch.randint(0, vocab, (rows,), generator=g)
    with torch.no_grad():
        got = head.greedy_block(lib, base, anchors)  # type: ignore[arg-type]
        w1, w2 = head.markov_w1.weight, head.markov_w2.weight
        want, prev = [], anchors
        for k in range(7):
            prev = (base[:, k] + w1[prev].bfloat16().float() @ w2.bfloat16().float().T).argmax(-1)
            want.append(prev)
    assert got is not None and torch.equal(got, torch.stack(want, dim=1))
    assert len(set(got.flatten().tolist())) > 3


def test_markov_w2_layouts_are_kept_side_by_side_and_rebuilt_when_w2_changes() -> None:
    """Greedy blocks at few requests read W2^T packed in bf16, sampled blocks read it in float32:
    steps of each kind in turn reuse both copies (a rebuild cost ~1.1 ms a step on the demo
    head), and a change of W2 rebuilds both."""
    from dspark_server.models.drafter_heads import MarkovHead

    head = MarkovHead(160, 16)
    packed, plain = head._w2_transposed("bf16"), head._w2_transposed("f32")
    assert packed.dtype == torch.bfloat16 and plain.dtype == torch.float32
    assert head._w2_transposed("bf16") is packed and head._w2_transposed("f32") is plain
    with torch.no_grad():
        head.markov_w2.weight.add_(1.0)
    assert torch.equal(head._w2_transposed("f32"), head.markov_w2.weight.detach().t())
    new_packed = head._w2_transposed("bf16")
    assert new_packed is not packed
    assert torch.equal(new_packed, bf16_weights.packed(head.markov_w2.weight.detach().t().contiguous()))
