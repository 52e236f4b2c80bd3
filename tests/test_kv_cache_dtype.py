"""A bfloat16 KV cache under float32 activations (--kv-cache-dtype): the fused forward stores keys
and values rounded to bf16 and attends in float32; greedy speculation still equals plain decoding
token for token, "auto" follows the weights' dtype, and a cache no forward can read is refused."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from test_engine import Collector, run_all

from dspark_server.config import EngineConfig, SpeculativeConfig
from dspark_server.engine.batch import SeqChunk
from dspark_server.engine.engine import LLMEngine
from dspark_server.engine.kv_cache import PageTable
from dspark_server.engine.model_runner import ModelRunner
from dspark_server.engine.request import SamplingParams
from dspark_server.models.drafter import DraftContext
from dspark_server.models.kernel_library import load_library
from dspark_server.testing.tiny import build_tiny_drafter, build_tiny_model

pytestmark = pytest.mark.skipif(load_library() is None, reason="the C++ kernels could not be built here")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("kv")
    target = build_tiny_model(root / "target", layers=3, with_eos=False, seed=11, vocab_size=24)
    return target, build_tiny_drafter(target, root / "draft", gamma=4, seed=12)


def _engine(target: Path, draft: Path | None, mode: str, kv: str, **spec: bool) -> LLMEngine:
    cfg = EngineConfig(
        model_dir=str(target),
        draft_dir=str(draft) if draft else None,
        weight_dtype="float32",
        kv_cache_dtype=kv,
        max_running=8,
        spec=SpeculativeConfig(mode=mode, draft_gate=False, price_step_overhead=False, **spec),  # type: ignore[arg-type]
    )
    return LLMEngine(cfg)


def _generate(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    col = Collector()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=96), col.sink(str(i)))
    run_all(engine)
    return [col.tokens(str(i)) for i in range(len(prompts))]


def test_greedy_speculation_over_a_bf16_cache_equals_plain_decoding_over_it(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    rng = random.Random(3)
    prompts = [[rng.randrange(4, 24) for _ in range(rng.randrange(2, 60))] for _ in range(8)]
    plain = _engine(target, None, "off", "bfloat16")
    assert plain.runner.pool.k.dtype == torch.bfloat16
    ref = _generate(plain, prompts)
    assert all(len(t) == 96 for t in ref)
    for mode in ("fixed", "dspark"):
        engine = _engine(target, draft, mode, "bfloat16")
        assert engine.runner.pool.k.dtype == torch.bfloat16
        assert engine.spec is not None and engine.spec.pool.k.dtype == torch.bfloat16  # the drafter's too
        assert _generate(engine, prompts) == ref, mode
        assert engine.stats.spec_accepted_tokens < engine.stats.spec_verified_tokens  # rejections happened


def test_a_bf16_cache_holds_the_rounded_keys_and_changes_the_logits_by_rounding_only(
    pair: tuple[Path, Path],
) -> None:
    target, _ = pair
    ids = random.Random(4).choices(range(4, 24), k=70)
    logits = {}
    for kv in ("float32", "bfloat16"):
        runner = ModelRunner(EngineConfig(model_dir=str(target), weight_dtype="float32", kv_cache_dtype=kv))
        table = PageTable()
        assert runner.allocator.reserve(table, len(ids))
        runner.forward([SeqChunk(table, 0, ids[:60])], [0])  # a prefill, then a verification-sized block
        logits[kv] = runner.forward([SeqChunk(table, 60, ids[60:])], [10]).output.logits
        stored = runner.pool.k[0, runner.allocator.slots(table, 0, 70)]
        assert stored.dtype == getattr(torch, kv) and stored.abs().sum() > 0
    diff = (logits["bfloat16"] - logits["float32"]).abs().max()
    assert 1e-6 < diff < 5e-2, diff  # bf16 rounding of K/V: visible, and small


def test_auto_follows_the_weights_and_an_unreadable_cache_is_refused(
    pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    target, _ = pair
    monkeypatch.delenv("DSPARK_KV_CACHE_DTYPE", raising=False)
    assert EngineConfig(model_dir="/m", weight_dtype="float32").resolved_kv_cache_dtype() == "float32"
    bf16_weights = EngineConfig(model_dir="/m", weight_dtype="bfloat16")
    assert bf16_weights.resolved_kv_cache_dtype() == "bfloat16"
    assert bf16_weights.serving_dtype() == "float32+bfloat16-weights+bfloat16-kv"
    assert EngineConfig(
        model_dir="/m", weight_dtype="bfloat16", kv_cache_dtype="float32"
    ).serving_dtype() == ("float32+bfloat16-weights")
    monkeypatch.setenv("DSPARK_KV_CACHE_DTYPE", "bfloat16")
    assert EngineConfig(model_dir="/m", weight_dtype="float32").resolved_kv_cache_dtype() == "bfloat16"
    monkeypatch.delenv("DSPARK_KV_CACHE_DTYPE")
    # only the fused forward reads a bf16 cache under float32 activations: auto falls back, an
    # explicit request is refused rather than served by a path that cannot read it
    layered = {"model_dir": str(target), "weight_dtype": "float32", "fused_forward": False}
    with pytest.raises(ValueError, match="needs the fused forward"):
        ModelRunner(EngineConfig(**layered, kv_cache_dtype="bfloat16"))  # type: ignore[arg-type]
    monkeypatch.setenv("DSPARK_KV_CACHE_DTYPE", "bfloat16")
    assert ModelRunner(EngineConfig(**layered)).pool.k.dtype == torch.float32  # type: ignore[arg-type]


def test_the_drafter_context_in_a_bf16_cache_is_the_float32_one_rounded(pair: tuple[Path, Path]) -> None:
    """The drafter's context cache follows the target's: its fused write stores the float32
    write's keys and values rounded to bf16, and its block pass over that cache equals, bit for
    bit, the pass over a float32 cache holding the same rounded values."""
    target, draft = pair
    engine = _engine(target, draft, "fixed", "bfloat16")
    assert engine.spec is not None
    drafter, pool = engine.spec.drafter, engine.spec.pool
    assert pool.k.dtype == torch.bfloat16
    f32 = drafter.new_kv_pool(pool.num_slots, torch.float32)
    g = torch.Generator().manual_seed(9)
    features = torch.randn(40, drafter.config.context_dim, generator=g)
    positions, slots = torch.arange(40), torch.arange(40) + 16
    with torch.inference_mode():
        drafter.write_context(features, positions, slots, pool)
        drafter.write_context(features, positions, slots, f32)
    assert torch.equal(pool.k[:, slots], f32.k[:, slots].bfloat16())
    assert torch.equal(pool.v[:, slots], f32.v[:, slots].bfloat16())
    rounded = drafter.new_kv_pool(pool.num_slots, torch.float32)
    rounded.k.copy_(pool.k.float())
    rounded.v.copy_(pool.v.float())
    ctx = DraftContext(slots[None, :], torch.tensor([40]))
    with torch.inference_mode():
        block = drafter.backbone(torch.tensor([5]), torch.tensor([40]), ctx, pool)
        ref = drafter.backbone(torch.tensor([5]), torch.tensor([40]), ctx, rounded)
    assert torch.equal(block.logits, ref.logits) and torch.equal(block.hidden, ref.hidden)
