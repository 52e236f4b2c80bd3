"""In-place paged attention (C++ kernel and PyTorch path) against dense attention over the gathered
history: ragged batches, mixed query lengths, GQA, page boundaries, page-0 padding, fp32 / bf16."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_drafter import data, make_drafter, make_target

from dspark_server.config import EngineConfig
from dspark_server.engine.batch import SeqChunk, pack
from dspark_server.engine.kv_cache import PageAllocator, PageTable
from dspark_server.engine.model_runner import ModelRunner
from dspark_server.models import attention, kernel_library, paged_kernel
from dspark_server.models.attention import (
    KVPool,
    block_attention,
    merge_attention,
    paged_attend,
    resolve_impl,
)
from dspark_server.models.drafter import DraftContext
from dspark_server.models.paged_layout import PagedLayout

KERNEL = kernel_library.load_library()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="the C++ kernel could not be built here")
IMPLS = [pytest.param("kernel", marks=needs_kernel), "torch"]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def reference(
    q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, layout: PagedLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense float64 attention, one sequence at a time, over its gathered keys."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64)
    for r in range(layout.num_seqs):
        s, q0, n = layout.seq_slots(r), int(layout.q_start[r]), layout.q_lens[r]
        if len(s) == 0:
            continue
        rep = q.shape[1] // kc.shape[1]
        kk = kc[s].double().transpose(0, 1).repeat_interleave(rep, 0)  # [Hq, K, D]
        vv = vc[s].double().transpose(0, 1).repeat_interleave(rep, 0)
        sc = q[q0 : q0 + n].double().transpose(0, 1) @ kk.transpose(1, 2) * q.shape[-1] ** -0.5
        visible = torch.arange(len(s))[None, :] < layout.kv_limit[q0 : q0 + n, None]
        sc = sc.masked_fill(~visible, float("-inf"))
        out[q0 : q0 + n] = (sc.softmax(-1) @ vv).transpose(0, 1)
        lse[q0 : q0 + n] = torch.logsumexp(sc, -1).transpose(0, 1)
    return out, lse


def ragged_batch(
    hq: int, hkv: int, d: int, dtype: torch.dtype, page_size: int = 16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PagedLayout]:
    """Decodes, verification blocks and a 40-token prefill chunk after histories that end just
    before, on and after page boundaries, with pages handed out interleaved (scattered)."""
    g = torch.Generator().manual_seed(0)
    q_lens = [1, 4, 8, 40, 1, 8, 1, 4]
    starts = [15, 16, 17, 0, 100, 47, 0, 33]
    alloc = PageAllocator(num_pages=64, page_size=page_size)
    tables = [PageTable() for _ in q_lens]
    for upto in range(0, max(s + n for s, n in zip(starts, q_lens, strict=True)) + 1, page_size):
        for t, s, n in zip(tables, starts, q_lens, strict=True):
            assert alloc.reserve(t, min(upto + 1, s + n))
    kv_slots = [alloc.slots(t, 0, s + n) for t, s, n in zip(tables, starts, q_lens, strict=True)]
    kc = torch.randn(alloc.num_slots, hkv, d, generator=g).to(dtype)
    vc = torch.randn(alloc.num_slots, hkv, d, generator=g).to(dtype)
    kc[:page_size], vc[:page_size] = 1e4, 1e4  # page 0 (padding) must never be read
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype)
    return q, kc, vc, PagedLayout.causal(q_lens, kv_slots)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 2, 64), (8, 2, 16), (4, 4, 128), (6, 2, 24)])
def test_matches_dense_reference(impl: str, dtype: torch.dtype, hq: int, hkv: int, d: int) -> None:
    q, kc, vc, layout = ragged_batch(hq, hkv, d, dtype)
    out, lse = paged_attend(q, kc, vc, layout, impl, want_lse=True)
    ref, ref_lse = reference(q, kc, vc, layout)
    assert out.dtype == dtype and lse is not None
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), ref.to(dtype).double(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=tol, rtol=tol)


@pytest.mark.parametrize("impl", IMPLS)
def test_float64_and_unsupported_shapes_fall_back(impl: str) -> None:
    q, kc, vc, layout = ragged_batch(4, 2, 16, torch.float64)
    out, _ = paged_attend(q, kc, vc, layout, impl)
    torch.testing.assert_close(out, reference(q, kc, vc, layout)[0], atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("blk", [5, 17])
def test_draft_blocks_see_context_and_their_own_block(impl: str, dtype: torch.dtype, blk: int) -> None:
    """The drafter's layout: every query of block r sees its context (possibly none) and, through
    ``extra``, its own block's new keys bidirectionally (17 > the kernel's 16-row tiles)."""
    g = torch.Generator().manual_seed(3)
    r, hq, hkv, d = 3, 4, 2, 64
    kc = torch.randn(200, hkv, d, generator=g).to(dtype)
    vc = torch.randn(200, hkv, d, generator=g).to(dtype)
    lens = torch.tensor([0, 17, 40])
    slots = DraftContext.from_slot_lists(
        [torch.randperm(180, generator=g)[: int(n)] + 20 for n in lens]
    ).slots
    layout = PagedLayout.blocks(slots, lens, blk)
    q = torch.randn(r * blk, hq, d, generator=g).to(dtype)
    k = torch.randn(r * blk, hkv, d, generator=g).to(dtype)
    v = torch.randn(r * blk, hkv, d, generator=g).to(dtype)
    got, lse = paged_attend(q, kc, vc, layout, impl, want_lse=True, extra=(k, v))
    assert lse is not None and got.dtype == dtype
    for i in range(r):  # reference: keys = [context of i; block i], all visible
        s, rows = slots[i, : int(lens[i])], slice(i * blk, (i + 1) * blk)
        kk = torch.cat([kc[s], k[rows]]).double().transpose(0, 1).repeat_interleave(hq // hkv, 0)
        vv = torch.cat([vc[s], v[rows]]).double().transpose(0, 1).repeat_interleave(hq // hkv, 0)
        sc = q[rows].double().transpose(0, 1) @ kk.transpose(1, 2) * d**-0.5
        ref = (sc.softmax(-1) @ vv).transpose(0, 1)
        torch.testing.assert_close(
            got[rows].double(), ref.to(dtype).double(), atol=TOL[dtype], rtol=TOL[dtype]
        )
        ref_lse = torch.logsumexp(sc, -1).transpose(0, 1)
        torch.testing.assert_close(lse[rows].double(), ref_lse, atol=TOL[dtype], rtol=TOL[dtype])


@needs_kernel
@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 2, 64), (8, 2, 16), (4, 4, 128)])
def test_float32_queries_over_a_bfloat16_cache_read_the_rounded_values(hq: int, hkv: int, d: int) -> None:
    """A bfloat16 KV cache under float32 activations (--kv-cache-dtype bfloat16): the kernel reads
    each stored bf16 value as the float32 it is, so its output equals, bit for bit, the float32
    kernel's over a float32 pool holding the same rounded values (decodes, verification blocks and
    a prefill chunk), and the drafter's block (float32 keys of its own) likewise."""
    q, kc, vc, layout = ragged_batch(hq, hkv, d, torch.float32)
    kb, vb = kc.bfloat16(), vc.bfloat16()
    out, lse = paged_attend(q, kb, vb, layout, "kernel", want_lse=True)
    ref, ref_lse = paged_attend(q, kb.float(), vb.float(), layout, "kernel", want_lse=True)
    assert out.dtype == torch.float32 and lse is not None and ref_lse is not None
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    assert not torch.equal(out, paged_attend(q, kc, vc, layout, "kernel")[0])  # it did round
    g = torch.Generator().manual_seed(5)
    lens = torch.tensor([3, 40])
    ctx = DraftContext.from_slot_lists([torch.randperm(200, generator=g)[: int(n)] + 16 for n in lens])
    blocks = PagedLayout.blocks(ctx.slots, lens, 7)
    qb = torch.randn(14, hq, d, generator=g)
    extra = (torch.randn(14, hkv, d, generator=g), torch.randn(14, hkv, d, generator=g))
    got, _ = paged_attend(qb, kb, vb, blocks, "kernel", extra=extra)
    assert torch.equal(got, paged_attend(qb, kb.float(), vb.float(), blocks, "kernel", extra=extra)[0])


def test_merge_attention_is_softmax_over_the_union() -> None:
    g = torch.Generator().manual_seed(4)
    q, k, v = (
        torch.randn(2, 3, 16, generator=g),
        torch.randn(9, 16, generator=g),
        torch.randn(9, 16, generator=g),
    )
    parts = []
    for sl in (slice(0, 4), slice(4, 9)):
        sc = q @ k[sl].T
        parts.append((sc.softmax(-1) @ v[sl], torch.logsumexp(sc, -1)))
    got = merge_attention(parts[0][0], parts[0][1], parts[1][0], parts[1][1])
    torch.testing.assert_close(got, (q @ k.T).softmax(-1) @ v, atol=1e-6, rtol=1e-6)
    out_b, lse_b = block_attention(
        q[None], k[None, :2, None].expand(1, 2, 3, 16), v[None, :2, None].expand(1, 2, 3, 16)
    )
    assert out_b.shape == (1, 2, 3, 16) and lse_b.shape == (1, 2, 3)


@pytest.mark.parametrize("impl", ["kernel", "torch", "auto"])
def test_target_forward_equals_gather_path(impl: str) -> None:
    """The whole packed forward (mixed prefill chunk, decodes, verification block) per impl."""
    if impl == "kernel" and KERNEL is None:
        pytest.skip("the C++ kernel could not be built here")
    target = make_target()
    cfg = target.config
    outs = []
    for which in (impl, "gather"):
        alloc = PageAllocator(num_pages=40, page_size=4)
        pool = KVPool(
            cfg.num_hidden_layers,
            alloc.num_slots,
            cfg.num_key_value_heads,
            cfg.head_dim,
            torch.float32,
            which,
        )
        tables = [PageTable() for _ in range(4)]
        g = torch.Generator().manual_seed(5)
        first = [
            SeqChunk(t, 0, torch.randint(0, 90, (n,), generator=g).tolist())
            for t, n in zip(tables, (9, 3, 14, 1), strict=True)
        ]
        second = [
            SeqChunk(t, c.start + len(c.token_ids), [7] * n)
            for t, c, n in zip(tables, first, (1, 40, 8, 4), strict=True)
        ]
        logits = []
        for chunks in (first, second):
            for c in chunks:
                assert alloc.reserve(c.table, c.start + len(c.token_ids))
            batch = pack(chunks, alloc)
            with torch.no_grad():
                logits.append(target(batch.input_ids, batch.positions, batch.attention(pool)).logits)
            for c in chunks:
                c.table.length = c.start + len(c.token_ids)
        outs.append(torch.cat(logits))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["kernel", "torch"])
def test_drafter_backbone_equals_gather_path(impl: str) -> None:
    if impl == "kernel" and KERNEL is None:
        pytest.skip("the C++ kernel could not be built here")
    target = make_target()
    d = make_drafter(target)
    ids, feats = data()
    slots = torch.randperm(60)[:24] + 4
    a = torch.tensor([0, 7, 13, 24])
    blocks = []
    for which in (impl, "gather"):
        pool = d.new_kv_pool(64, impl=which)
        d.write_context(feats[0], torch.arange(24), slots, pool)
        ctx = DraftContext.from_slot_lists([slots[: int(x)] for x in a])
        blocks.append(d.backbone(ids[0, a.clamp(max=23)], a, ctx, pool))
    torch.testing.assert_close(blocks[0].hidden, blocks[1].hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(blocks[0].logits, blocks[1].logits, atol=1e-4, rtol=1e-5)


def test_engine_config_selects_the_impl(tiny_model: Path) -> None:
    """EngineConfig.attention_impl reaches the runner's pool; every impl gives the same logits."""
    logits = {}
    for impl in ("gather", "torch", "auto"):
        runner = ModelRunner(EngineConfig(model_dir=str(tiny_model), page_size=4, attention_impl=impl))
        assert runner.pool.impl == impl
        tables = [PageTable() for _ in range(3)]
        chunks = [SeqChunk(t, 0, list(range(3, 3 + n))) for t, n in zip(tables, (5, 37, 2), strict=True)]
        for c in chunks:
            assert runner.allocator.reserve(c.table, len(c.token_ids) + 8)
        first = runner.forward(chunks, [1, 1, 1]).output.logits
        steps = [SeqChunk(t, t.length, [9] * n) for t, n in zip(tables, (1, 8, 4), strict=True)]
        logits[impl] = torch.cat([first, runner.forward(steps, [1, 8, 4]).output.logits])
    torch.testing.assert_close(logits["torch"], logits["gather"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits["auto"], logits["gather"], atol=1e-5, rtol=1e-5)


def test_unknown_impl_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="attention impl"):
        KVPool(1, 4, 1, 16, torch.float32, impl="flash")
    monkeypatch.setenv("DSPARK_ATTENTION", "gather")
    assert KVPool(1, 4, 1, 16, torch.float32).impl == "gather"


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "flags", [("-mno-avx512f",), ("-mno-avx512f", "-mno-avx2")], ids=["avx2", "portable"]
)
def test_kernel_without_avx512(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, flags: tuple[str, ...]
) -> None:
    """The kernel built for a CPU without AVX-512 (its AVX2 path, where this CPU has AVX2) and
    without AVX2 either (the plain-C++ loops) against the reference."""
    monkeypatch.setenv("DSPARK_KERNEL_CACHE", str(tmp_path))
    lib = kernel_library.open_library(kernel_library.build("g++", flags))
    for hq, hkv, d in [(4, 2, 64), (8, 2, 16), (4, 1, 128), (2, 1, 80)]:
        q, kc, vc, layout = ragged_batch(hq, hkv, d, dtype)
        out, lse = paged_kernel.kernel_attention(lib, q, kc, vc, layout, want_lse=True)
        ref, ref_lse = reference(q, kc, vc, layout)
        assert lse is not None
        torch.testing.assert_close(out.double(), ref.to(dtype).double(), atol=TOL[dtype], rtol=TOL[dtype])
        torch.testing.assert_close(lse.double(), ref_lse, atol=TOL[dtype], rtol=TOL[dtype])


def test_auto_resolves_to_gather_without_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = torch.zeros(8, 2, 64)
    if KERNEL is not None:
        assert resolve_impl("auto", torch.float32, cache, 4) == "kernel"
    assert resolve_impl("auto", torch.float64, cache.double(), 4) == "gather"
    assert resolve_impl("torch", torch.float32, cache, 4) == "torch"
    monkeypatch.setattr(attention, "load_library", lambda: None)
    assert resolve_impl("auto", torch.float32, cache, 4) == "gather"
    q, kc, vc, layout = ragged_batch(4, 2, 64, torch.float32)
    with pytest.raises(RuntimeError, match="could not be built"):
        paged_attend(q, kc, vc, layout, "kernel")


@needs_kernel
def test_kernel_build_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    monkeypatch.setenv("DSPARK_KERNEL_CACHE", str(tmp_path))
    compiler = shutil.which("g++")
    assert compiler is not None
    first = kernel_library.build(compiler)
    stamp = first.stat().st_mtime_ns
    assert first.parent == tmp_path and kernel_library.build(compiler) == first
    assert first.stat().st_mtime_ns == stamp and list(tmp_path.iterdir()) == [first]


def test_loading_the_kernel_leaves_the_process_floating_point_state_alone(tmp_path: Path) -> None:
    """A kernel linked with -ffast-math turns on flush-to-zero for the whole process when loaded:
    subnormals become 0 (Python then reads 5e-324 as 0.0 and requests with tiny top_p fail)."""
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from dspark_server.models.attention import KVPool\n"
        "KVPool(1, 64, 2, 64, torch.float32, impl='kernel')\n"
        "assert float('5e-324') > 0, 'flush-to-zero: 5e-324 parsed as 0.0'\n"
        "x = torch.tensor([1e-40], dtype=torch.float32)\n"
        "assert float(x * 1.0) > 0, 'flush-to-zero in float32 arithmetic'\n"
    )
    env = {**__import__("os").environ, "DSPARK_KERNEL_CACHE": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


def test_one_requests_prompt_runs_on_the_prefill_threads_and_gives_the_same_logits(tiny_model: Path) -> None:
    narrow = torch.get_num_threads()
    cfg = EngineConfig(model_dir=str(tiny_model), page_size=4, max_model_len=256)
    wide_cfg = EngineConfig(**{**cfg.__dict__, "wide_step_threads": narrow + 1})
    seen: list[int] = []
    logits = {}
    for name, c in (("narrow", cfg), ("wide", wide_cfg)):
        runner = ModelRunner(c)
        inner = runner.target.forward

        def spy(*a: object, _inner: object = inner, **k: object) -> object:
            seen.append(torch.get_num_threads())
            return _inner(*a, **k)  # type: ignore[operator]

        runner.target.forward = spy  # type: ignore[method-assign]
        tables = [PageTable() for _ in range(3)]
        for t in tables:
            assert runner.allocator.reserve(t, 100)
        seen.clear()
        out = [
            runner.forward([SeqChunk(tables[0], 0, list(range(3, 73)))], [1]),  # one prompt, 70 tokens
            runner.forward([SeqChunk(t, 0, list(range(3, 43))) for t in tables[1:]], [1, 1]),  # two
            runner.forward([SeqChunk(tables[0], 70, [5])], [1]),  # one decode
        ]
        logits[name] = torch.cat([r.output.logits for r in out])
        assert seen == ([narrow + 1, narrow, narrow] if name == "wide" else [narrow] * 3)
        assert torch.get_num_threads() == narrow
    torch.testing.assert_close(logits["wide"], logits["narrow"], atol=1e-5, rtol=1e-5)
