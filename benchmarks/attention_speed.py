"""Attention and whole-forward time of the demo target, per attention impl (issue #15, item 2).

For every dtype, request count and query length: R requests with ragged ~CONTEXT-token histories
whose pages were handed out interleaved (as under serving), each adding Q tokens (Q = 1: decode,
Q = 8: a verification block). Per repetition, in alternating order, every impl runs (a) the
attention of all layers alone (``PagedAttention.attend``: KV write + attention, on random q/k/v)
and (b) the whole target forward (a fresh ``PackedBatch.attention`` each time, so the gather
path's padded groups are built inside it, as in serving). Reports medians and, per impl, the
ratio median(gather) / median(impl). The machine may be shared: trust ratios of interleaved
medians, not absolute times. Optionally (--drafter) times the demo drafter's backbone the same way.

    python benchmarks/attention_speed.py --threads 2 [--out runs/attention_speed.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dspark_server.assets import DEMO_DRAFT, DEMO_TARGET
from dspark_server.engine.batch import SeqChunk, pack
from dspark_server.engine.kv_cache import PageAllocator, PageTable
from dspark_server.models.attention import KVPool
from dspark_server.models.loader import load_target
from dspark_server.models.target import TargetModel

PAGE = 16


def _batch(target: TargetModel, requests: int, context: int, queries: int, dtype: torch.dtype, seed: int):
    """Ragged histories (context +- 25%), pages reserved round-robin, random K/V in the pool."""
    g = torch.Generator().manual_seed(seed)
    cfg = target.config
    lens = torch.randint(context * 3 // 4, context * 5 // 4 + 1, (requests,), generator=g).tolist()
    alloc = PageAllocator(sum(-(-(n + queries) // PAGE) for n in lens) + 1, PAGE)
    tables = [PageTable() for _ in lens]
    for upto in range(0, max(lens) + queries, PAGE):
        for t, n in zip(tables, lens, strict=True):
            assert alloc.reserve(t, min(upto + PAGE, n + queries))
    for t, n in zip(tables, lens, strict=True):
        t.length = n
    pool = KVPool(cfg.num_hidden_layers, alloc.num_slots, cfg.num_key_value_heads, cfg.head_dim, dtype)
    pool.k.normal_(generator=g)
    pool.v.normal_(generator=g)
    ids = torch.randint(0, cfg.vocab_size, (requests, queries), generator=g)
    chunks = [SeqChunk(t, n, ids[i].tolist()) for i, (t, n) in enumerate(zip(tables, lens, strict=True))]
    return pack(chunks, alloc), pool


CLOCK: Callable[[], float] = time.perf_counter


def _timed(fn: Callable[[], object]) -> float:
    t0 = CLOCK()
    fn()
    return CLOCK() - t0


def _case(
    target: TargetModel, impls: list[str], requests: int, context: int, queries: int, repeats: int
) -> dict[str, dict[str, float]]:
    cfg, dtype = target.config, target.lm_head.weight.dtype
    batch, pool = _batch(target, requests, context, queries, dtype, seed=requests * 100 + queries)
    t = batch.num_tokens
    q = torch.randn(t, cfg.num_attention_heads, cfg.head_dim).to(dtype)
    kv = torch.randn(t, cfg.num_key_value_heads, cfg.head_dim).to(dtype)

    def attention() -> None:
        attn = batch.attention(pool)
        for layer in range(cfg.num_hidden_layers):
            attn.attend(layer, q, kv, kv)

    def forward() -> None:
        target(batch.input_ids, batch.positions, batch.attention(pool))

    samples: dict[str, dict[str, list[float]]] = {i: {"attention": [], "forward": []} for i in impls}
    with torch.inference_mode():
        for rep in range(repeats + 2):  # two warm-up rounds (kernel build, allocator)
            for impl in impls if rep % 2 == 0 else impls[::-1]:
                pool.impl = impl
                a, f = _timed(attention), _timed(forward)
                if rep >= 2:
                    samples[impl]["attention"].append(a)
                    samples[impl]["forward"].append(f)
    return {i: {k: statistics.median(v) * 1e3 for k, v in s.items()} for i, s in samples.items()}


def _drafter_case(target: TargetModel, impls: list[str], requests: int, context: int, repeats: int) -> dict:
    from dspark_server.models.drafter import DraftContext
    from dspark_server.models.drafter_checkpoint import load_drafter

    d = load_drafter(DEMO_DRAFT, target)
    dtype = target.lm_head.weight.dtype
    d.to(dtype)
    batch, _ = _batch(target, requests, context, 1, dtype, seed=7)
    lay = batch.layout
    slots = [lay.seq_slots(r)[: lay.kv_lens[r] - 1] for r in range(lay.num_seqs)]
    pool = d.new_kv_pool(int(lay.slots.max()) + 1, dtype)
    pool.k.normal_()
    pool.v.normal_()
    ctx = DraftContext.from_slot_lists(slots)
    anchors = torch.randint(0, d.config.vocab_size, (requests,))
    pos = ctx.lens.clone()
    samples: dict[str, list[float]] = {i: [] for i in impls}
    with torch.inference_mode():
        for rep in range(repeats + 2):
            for impl in impls if rep % 2 == 0 else impls[::-1]:
                pool.impl = impl
                s = _timed(lambda: d.backbone(anchors, pos, ctx, pool))
                if rep >= 2:
                    samples[impl].append(s)
    return {i: statistics.median(v) * 1e3 for i, v in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--queries", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=400)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument(
        "--impls", nargs="+", default=["gather", "auto", "torch"], help="first one is the baseline"
    )
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--drafter", action="store_true", help="also time the demo drafter's backbone")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: this thread's CPU time (with --threads 1 all work runs on it): immune to the "
        "descheduling that dominates wall time on an oversubscribed machine",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        if args.threads != 1:
            ap.error("--clock cpu measures the calling thread only: use it with --threads 1")
        global CLOCK
        CLOCK = time.thread_time
    base = args.impls[0]
    rows: list[dict] = []
    print(
        f"threads={args.threads} clock={args.clock} context~{args.context} repeats={args.repeats}; "
        f"ms = medians, x = {base}/impl"
    )
    print("| dtype | R | Q | impl | attention ms | forward ms | attention x | forward x |")
    print("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for name in args.dtypes:
        target = load_target(DEMO_TARGET, getattr(torch, name))
        for r in args.requests:
            for nq in args.queries:
                res = _case(target, args.impls, r, args.context, nq, args.repeats)
                for impl, m in res.items():
                    ra = res[base]["attention"] / m["attention"]
                    rf = res[base]["forward"] / m["forward"]
                    rows.append(dict(dtype=name, requests=r, queries=nq, impl=impl, **m, attn_x=ra, fwd_x=rf))
                    print(
                        f"| {name} | {r} | {nq} | {impl} | {m['attention']:.3f} | {m['forward']:.3f} "
                        f"| {ra:.2f} | {rf:.2f} |",
                        flush=True,
                    )
        if args.drafter:
            for r in args.requests:
                res = _drafter_case(target, args.impls, r, args.context, args.repeats)
                for impl, ms in res.items():
                    rows.append(dict(dtype=name, requests=r, impl=impl, drafter_backbone=ms))
                    print(
                        f"drafter backbone {name} R={r} {impl}: {ms:.3f} ms ({res[base] / ms:.2f}x)",
                        flush=True,
                    )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
