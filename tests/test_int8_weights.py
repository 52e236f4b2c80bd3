"""Weight-only int8 for the drafter (--draft-weight-dtype int8): the kernel computes x @ W with W
quantized per column and each row of x quantized to int16, exactly up to float32 rounding; its
int32 sums never overflow; the drafter's context write reads the int8 copies for a few rows and
the bf16 copies for many; and greedy speculation with the int8 drafter still emits exactly the
tokens of plain decoding."""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import torch
from test_engine import Collector, run_all

from dspark_server.config import EngineConfig, SpeculativeConfig
from dspark_server.config_args import add_engine_args, engine_config_from_args
from dspark_server.engine.engine import LLMEngine
from dspark_server.engine.request import SamplingParams
from dspark_server.models import int8_weights
from dspark_server.models.kernel_library import load_library
from dspark_server.models.weight_formats import WeightFormat, int8_supported
from dspark_server.testing.tiny import build_tiny_drafter, build_tiny_model

Tensor = torch.Tensor


@pytest.fixture(scope="module")
def lib() -> object:
    lib = load_library()
    if not int8_supported(lib):
        pytest.skip("no AVX512-VNNI / AVX512-BF16 (or no kernel library) here")
    return lib


def _linear(lib: object, x: Tensor, wbuf: Tensor, k: int, n: int, out: Tensor, accumulate: int = 0) -> int:
    args = (x.data_ptr(), x.shape[0], k, wbuf.data_ptr(), n, out.data_ptr(), accumulate, 2)
    return int(lib.dspark_linear_int8(*args))  # type: ignore[attr-defined]


def _quantized_rows(x: Tensor) -> Tensor:
    """Each row as the kernel multiplies it: rounded to int16 steps of max|row| / 32767."""
    scale = x.abs().amax(dim=1, keepdim=True) / 32767.0
    return torch.round(x / scale) * scale


@pytest.mark.parametrize("m", [1, 3, 8, 9, 16, 17, 40])
@pytest.mark.parametrize("accumulate", [0, 1])
@pytest.mark.parametrize("n, k", [(160, 96), (512, 100), (64, 1100)])
def test_int8_kernel_is_the_quantized_product(lib: object, m: int, accumulate: int, n: int, k: int) -> None:
    # N five blocks of 32 or sixteen (threads take groups of blocks, tails of 1-3 rows run over
    # several at once); K 1100: int32 sums flushed every 512 products, the last chunk partial
    g = torch.Generator().manual_seed(m * 7 + k)
    wt = torch.randn(k, n, generator=g)
    x = torch.randn(m, k, generator=g)
    before = torch.randn(m, n, generator=g)
    out = before.clone()
    product = _quantized_rows(x).double() @ int8_weights.dequantized(wt).double()
    ref = (before.double() if accumulate else 0) + product
    wbuf = int8_weights.packed(wt)
    assert _linear(lib, x, wbuf, k, n, out, accumulate) == 0
    torch.testing.assert_close(out.double(), ref, atol=2e-4 * k**0.5, rtol=1e-5)
    # the quantization error itself is small against the float32 product, and not zero
    plain = (before.double() if accumulate else 0) + (x @ wt).double()
    rel = (out.double() - plain).norm() / (x @ wt).norm()
    assert 1e-4 < rel < 2e-2
    # a row's result does not depend on the rows beside it
    single = torch.empty(1, n)
    _linear(lib, x[m - 1 :].contiguous(), wbuf, k, n, single)
    batched = torch.empty(m, n)
    _linear(lib, x, wbuf, k, n, batched)
    assert torch.equal(single[0], batched[m - 1])
    # a shape the kernel does not take is refused, not computed wrong
    assert _linear(lib, x, wbuf, k, n - 16, out) == 1


def test_int8_sums_do_not_overflow(lib: object) -> None:
    """Every product at its largest (|x| -> 32767, |w| -> 127) over K = 4096: one int32 sum over K
    would wrap; the kernel's partial sums do not."""
    k, n = 4096, 32
    wt = torch.full((k, n), 0.5)
    x = torch.full((2, k), 3.0)
    x[1] *= -1
    out = torch.empty(2, n)
    assert _linear(lib, x, int8_weights.packed(wt), k, n, out) == 0
    torch.testing.assert_close(out, torch.tensor([[1.5 * k], [-1.5 * k]]).expand(2, n), rtol=1e-6, atol=0)


def test_packed_buffer_holds_the_scales_then_the_pairs() -> None:
    g = torch.Generator().manual_seed(5)
    k, n = 6, 64
    wt = torch.randn(k, n, generator=g)
    q, scales = int8_weights.quantized(wt)
    assert q.abs().max() == 127 and bool((q.abs().amax(dim=0) == 127).all())  # each column's max -> 127
    buf = int8_weights.packed(wt)
    assert buf.dtype == torch.int8 and buf.numel() == 4 * n + k * n
    assert torch.equal(buf[: 4 * n].view(torch.float32), scales)
    blocks = buf[4 * n :].view(n // 32, k // 2, 32, 2)
    for col, kk in ((0, 0), (33, 5), (63, 2)):
        assert blocks[col // 32, kk // 2, col % 32, kk % 2] == q[kk, col]
    with pytest.raises(ValueError):
        int8_weights.packed(torch.zeros(5, 64))


@pytest.mark.parametrize("tokens", [5, 40])  # a verification block's accepted tokens, a prompt chunk
def test_context_write_reads_int8_for_few_rows_and_bf16_for_many(lib: object, tokens: int) -> None:
    from test_drafter import make_drafter, make_target

    target = make_target()
    target.fuse_projections()
    base = make_drafter(target, "markov")
    models = {}
    for dtype in (torch.int8, torch.bfloat16, torch.float32):
        model = copy.deepcopy(base)
        model.fuse_projections()
        model.use_kernels(lib, fused=True, weight_dtype=dtype)  # type: ignore[arg-type]
        models[dtype] = model
    assert models[torch.int8]._fused_context is not None
    assert models[torch.int8]._fused_context.format == WeightFormat.INT8
    g = torch.Generator().manual_seed(tokens)
    feats = torch.randn(tokens, base.config.context_dim, generator=g)
    positions = torch.arange(tokens) + 3
    slots = torch.randperm(64, generator=g)[:tokens] + 1
    pools = {}
    for dtype, model in models.items():
        pools[dtype] = model.new_kv_pool(80)
        model.write_context(feats, positions, slots, pools[dtype])
    got, bf16, f32 = pools[torch.int8], pools[torch.bfloat16], pools[torch.float32]
    torch.testing.assert_close(got.k[:, slots], f32.k[:, slots], atol=5e-2, rtol=5e-2)
    if tokens > 16:  # many rows: the bf16 copies serve, bit for bit the bf16 format's write
        assert torch.equal(got.k, bf16.k) and torch.equal(got.v, bf16.v)
    else:  # few rows: the int8 copies serve (neither the bf16 nor the float32 result)
        assert (got.k[:, slots] - bf16.k[:, slots]).abs().max() > 1e-5
        assert (got.k[:, slots] - f32.k[:, slots]).abs().max() > 1e-5


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("int8")  # every GEMM's N a multiple of 32 (vocabulary 64)
    target = build_tiny_model(root / "target", layers=3, with_eos=False, seed=21, vocab_size=64)
    return target, build_tiny_drafter(target, root / "draft", gamma=4, seed=22)


def _generate(
    target: Path, draft: Path | None, mode: str, draft_dtype: str, prompts: list[list[int]]
) -> tuple[LLMEngine, list[list[int]]]:
    cfg = EngineConfig(
        model_dir=str(target),
        draft_dir=str(draft) if draft else None,
        weight_dtype="bfloat16",
        draft_weight_dtype=draft_dtype,
        max_running=8,
        spec=SpeculativeConfig(mode=mode, draft_gate=False, price_step_overhead=False),  # type: ignore[arg-type]
    )
    engine = LLMEngine(cfg)
    col = Collector()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=64), col.sink(str(i)))
    run_all(engine)
    return engine, [col.tokens(str(i)) for i in range(len(prompts))]


def test_greedy_speculation_with_an_int8_drafter_equals_plain_decoding(
    lib: object, pair: tuple[Path, Path]
) -> None:
    target, draft = pair
    rng = random.Random(8)
    prompts = [[rng.randrange(4, 64) for _ in range(rng.randrange(2, 50))] for _ in range(8)]
    _, ref = _generate(target, None, "off", "auto", prompts)
    assert all(len(t) == 64 for t in ref)
    accepted = {}
    for dtype in ("int8", "bfloat16"):
        engine, outputs = _generate(target, draft, "fixed", dtype, prompts)
        assert engine.spec is not None
        assert engine.spec.drafter.serving_weight_dtype == getattr(torch, dtype)
        assert outputs == ref, dtype
        accepted[dtype] = engine.stats.spec_accepted_tokens
        assert 0 < engine.stats.spec_accepted_tokens < engine.stats.spec_verified_tokens
    # int8 moves a few drafts, not the drafter's quality
    assert abs(accepted["int8"] - accepted["bfloat16"]) <= 0.1 * accepted["bfloat16"]


def test_the_flag_and_the_environment_choose_the_drafters_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    monkeypatch.delenv("DSPARK_DRAFT_WEIGHT_DTYPE", raising=False)
    p = argparse.ArgumentParser()
    add_engine_args(p)
    cfg = engine_config_from_args(p.parse_args(["--draft-weight-dtype", "int8", "--weight-dtype", "float32"]))
    assert (cfg.draft_weight_dtype, cfg.resolved_draft_weight_dtype()) == ("int8", "int8")
    auto = engine_config_from_args(p.parse_args(["--weight-dtype", "float32"]))
    assert auto.resolved_draft_weight_dtype() == "float32"  # auto: the target's choice
    monkeypatch.setenv("DSPARK_DRAFT_WEIGHT_DTYPE", "int8")
    assert auto.resolved_draft_weight_dtype() == "int8"
    with pytest.raises(SystemExit):
        p.parse_args(["--draft-weight-dtype", "int4"])


@pytest.mark.parametrize("vnni", [True, False])
def test_auto_serves_a_drafter_too_big_for_the_caches_in_int8(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, vnni: bool
) -> None:
    from dspark_server import config

    monkeypatch.delenv("DSPARK_DRAFT_WEIGHT_DTYPE", raising=False)
    monkeypatch.delenv("DSPARK_WEIGHT_DTYPE", raising=False)
    flags = "avx512f avx512_bf16" + (" avx512_vnni" if vnni else "")
    monkeypatch.setattr(config, "cpu_flags", lambda: flags)
    big, small = tmp_path / "big", tmp_path / "small"
    for d, size in ((big, config.INT8_DRAFT_FROM_BYTES), (small, config.INT8_DRAFT_FROM_BYTES - 1)):
        d.mkdir()
        with open(d / "model.safetensors", "wb") as f:
            f.truncate(size)  # sparse: only the size is read

    def resolved(draft: Path, weights: str = "auto") -> str:
        cfg = EngineConfig(model_dir="/m", draft_dir=str(draft), weight_dtype=weights)
        return cfg.resolved_draft_weight_dtype()

    assert resolved(big) == ("int8" if vnni else "bfloat16")
    assert resolved(small) == "bfloat16"  # the demo drafter's case: the target's choice
    assert resolved(big, "float32") == "float32"  # float32 asked for the model: nothing rounded
    assert (
        EngineConfig(
            model_dir="/m", draft_dir=str(big), draft_weight_dtype="bfloat16"
        ).resolved_draft_weight_dtype()
        == "bfloat16"
    )
