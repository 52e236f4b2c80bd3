"""Time one DSpark draft step on CPU: batched backbone + gamma-step sequential loop (greedy).

    python -m tools.draft_timing --requests 1 64 --context 256
    python -m tools.draft_timing --model dspark_server/assets/demo/target \
        --drafts dspark_server/assets/demo/draft,work_data/drafters/rnn --json runs/draft_timing.json

Reports the sequential head's share of the step (the paper: 0.2-1.3% of a GPU round). Random
weights: timing only, no accuracy. Default sizes: a ~5M-parameter target (hidden 256, vocab 8192,
4 layers) and a ~2M-parameter drafter (1 layer, Markov rank 64, confidence head).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dspark_server.config import ModelConfig
from dspark_server.engine.batch import SeqChunk, pack
from dspark_server.engine.kv_cache import PageAllocator, PageTable
from dspark_server.models.attention import KVPool
from dspark_server.models.drafter import DraftBlock, DraftContext, DSparkDrafter
from dspark_server.models.drafter_config import DraftConfig
from dspark_server.models.target import TargetModel


@dataclass(frozen=True)
class StepTiming:
    requests: int
    context: int
    head: str
    rank: int
    backbone_ms: float
    sequential_ms: float  # gamma x (head step + add + argmax)
    confidence_ms: float
    total_ms: float
    sequential_share: float  # sequential_ms / total_ms
    head_only_share: float  # the same loop minus a head-less loop (add + argmax cost removed)
    verify_ms: float  # target forward over R x (gamma + 1) tokens with feature capture
    round_share: float  # sequential_ms / (total_ms + verify_ms), the paper's measure


def tiny_target(vocab: int = 8192, hidden: int = 256, layers: int = 4) -> TargetModel:
    cfg = ModelConfig(
        architecture="qwen3",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=704,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    return TargetModel(cfg).eval().requires_grad_(False)


def build_drafter(target: TargetModel, head: str, rank: int, gamma: int = 7) -> DSparkDrafter:
    cfg = DraftConfig.from_target(
        target.config,
        mask_token_id=target.config.vocab_size - 1,
        num_layers=1,
        target_layer_ids=(0, 1, 2),
        gamma=gamma,
        head_type=head,
        markov_rank=rank,
        confidence=True,
    )
    return DSparkDrafter(cfg, target).eval().requires_grad_(False)


def _interleaved_ms(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Min over repeats (robust to other processes on a shared machine); the timed pieces are
    interleaved within each repeat so they see the same machine conditions."""
    best = {k: float("inf") for k in fns}
    for fn in fns.values():  # warm-up
        fn()
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t0)
    return {k: 1e3 * v for k, v in best.items()}


def _loop(d: DSparkDrafter, block: DraftBlock, anchors: torch.Tensor, use_head: bool) -> torch.Tensor:
    state = d.init_head_state(block.hidden[:, 0])
    prev = anchors
    for k in range(d.gamma):
        logits = block.logits[:, k]
        if use_head:
            logits, state = d.step_logits(logits, prev, block.hidden[:, k], state)
        prev = logits.argmax(dim=-1)
    return prev


def _verify_fn(target: TargetModel, d: DSparkDrafter, requests: int, context: int) -> Callable[[], object]:
    """A target forward over every request's anchor + gamma drafts after ``context`` cached tokens."""
    tc, g = target.config, d.gamma
    alloc = PageAllocator(num_pages=requests * (-(-(context + g + 1) // 16)) + 1, page_size=16)
    pool = KVPool(tc.num_hidden_layers, alloc.num_slots, tc.num_key_value_heads, tc.head_dim, torch.float32)
    chunks = []
    for _ in range(requests):
        table = PageTable()
        assert alloc.reserve(table, context + g + 1)
        table.length = context
        chunks.append(SeqChunk(table, context, torch.randint(0, tc.vocab_size, (g + 1,)).tolist()))
    batch = pack(chunks, alloc)
    attn = batch.attention(pool)
    return lambda: target(batch.input_ids, batch.positions, attn, capture_layers=d.capture_layers)


@torch.inference_mode()
def time_draft_step(
    d: DSparkDrafter, requests: int, context: int, repeats: int = 30, target: TargetModel | None = None
) -> StepTiming:
    cfg = d.config
    pool = d.new_kv_pool(requests * context + 1)
    slots = [1 + r * context + torch.arange(context) for r in range(requests)]
    feats = torch.randn(requests * context, cfg.context_dim)
    d.write_context(feats, torch.arange(context).repeat(requests), torch.cat(slots), pool)
    ctx = DraftContext.from_slot_lists(slots)
    anchors = torch.randint(0, cfg.vocab_size, (requests,))
    positions = torch.full((requests,), context)
    block = d.backbone(anchors, positions, ctx, pool)
    prevs = torch.randint(0, cfg.vocab_size, (requests, cfg.gamma))
    ms = _interleaved_ms(
        {
            "backbone": lambda: d.backbone(anchors, positions, ctx, pool),
            "sequential": lambda: _loop(d, block, anchors, True),
            "bare": lambda: _loop(d, block, anchors, False),
            "confidence": lambda: d.confidence_logits(block.hidden, prevs),
            **({"verify": _verify_fn(target, d, requests, context)} if target is not None else {}),
        },
        repeats,
    )
    backbone, seq, bare, conf = ms["backbone"], ms["sequential"], ms["bare"], ms["confidence"]
    verify = ms.get("verify", 0.0)
    total = backbone + seq + conf
    return StepTiming(
        requests,
        context,
        cfg.head_type,
        cfg.markov_rank,
        backbone,
        seq,
        conf,
        total,
        seq / total,
        max(seq - bare, 0.0) / total,
        verify,
        seq / (total + verify),
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, nargs="+", default=[1, 64])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--heads", nargs="+", default=["markov"], help="markov | gated | rnn | none")
    p.add_argument("--rank", type=int, nargs="+", default=[64])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--model", default=None, help="a real target directory (instead of random weights)")
    p.add_argument("--drafts", default=None, help="comma-separated drafter directories for --model")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.model:
        from dspark_server.models.drafter_checkpoint import load_drafter
        from dspark_server.models.loader import load_target

        target = load_target(args.model)
        drafters = [load_drafter(path, target) for path in (args.drafts or "").split(",") if path]
    else:
        target = tiny_target()
        drafters = [build_drafter(target, head, rank) for head in args.heads for rank in args.rank]
    print(
        f"target params {sum(t.numel() for t in target.parameters()) / 1e6:.2f}M, "
        f"threads {torch.get_num_threads()}"
    )
    rows: list[dict[str, object]] = []
    labels = (
        [p.rstrip("/").split("/")[-1] for p in (args.drafts or "").split(",") if p]
        if args.model
        else [f"{d.config.head_type} r{d.config.markov_rank}" for d in drafters]
    )
    for label, d in zip(labels, drafters, strict=True):
        print(
            f"drafter {d.config.head_type} rank {d.config.markov_rank}: "
            f"{sum(t.numel() for t in d.parameters()) / 1e6:.2f}M params"
        )
        for r in args.requests:
            t = time_draft_step(d, r, args.context, args.repeats, target)
            rows.append({"label": label, **asdict(t)})
            print(
                f"  R={r:3d} ctx={t.context}: backbone {t.backbone_ms:7.2f} ms | sequential "
                f"{t.sequential_ms:6.2f} ms | confidence {t.confidence_ms:5.2f} ms | step "
                f"{t.total_ms:7.2f} ms | sequential share {100 * t.sequential_share:5.1f}% "
                f"(head alone {100 * t.head_only_share:5.1f}%) | target verify "
                f"{t.verify_ms:7.2f} ms -> share of round {100 * t.round_share:5.1f}%"
            )
    if args.json:
        from dspark_server.bench.common import machine_info, write_json

        write_json(
            Path(args.json),
            {
                "kind": "draft_timing",
                "machine": {**machine_info(), "torch_threads": torch.get_num_threads()},
                "config": {
                    "command": "python -m tools.draft_timing "
                    + " ".join(sys.argv[1:] if argv is None else argv),
                    "context": args.context,
                    "repeats": args.repeats,
                },
                "rows": rows,
            },
        )


if __name__ == "__main__":
    main()
