"""Train a DSpark drafter against a frozen target on self-distilled data (``dspark train draft``).

Per step (``train_step``):

1. a batch of ``batch_size`` distilled sequences (prompt + the target's own answer, loss mask on
   the answer; ``distill.py``), right-padded to the longest one (at most ``seq_len`` tokens);
2. one dense causal target pass (``DenseCausalAttention``, no grad) capturing the drafter's
   ``target_layer_ids`` features for every position and the target's logits at the rows the blocks
   need (``label - 1``);
3. ``anchors_per_seq`` random anchors per sequence (``losses.sample_anchors``: an anchor and its
   first label are both answer tokens), every block of the batch in one ``forward_train``;
4. ``dspark_loss``: 0.1 CE + 0.9 L1 (TV) + 1.0 confidence BCE, position weights exp(-(k-1)/4);
5. AdamW (weight decay 0), linear warm-up then cosine to ``min_lr_ratio``, grad-norm clip 1.0.

A tqdm bar shows the loss, TV, first/last-position accuracy and the expected acceptance length τ;
``log.jsonl`` in the run directory has every step's per-position numbers. Held-out sequences
(a deterministic slice of the data, or ``--eval-data``) are evaluated every ``eval_every`` steps:
τ (temperature 1: 1 + Σ_k Π_{i≤k} (1 - ½‖p_d,i - p_t,i‖₁)) and τ_greedy (temperature 0: the
drafter's argmax equals the target's). Checkpoints (drafter weights and AdamW moments in
safetensors, step/history in JSON; no pickle) make a run resumable (``--resume``) with the same
data order, anchors and schedule as an uninterrupted run. ``--max-minutes`` stops cleanly: it
checkpoints and exports. The final drafter is written with ``save_drafter`` (DeepSpec layout).

    python -m dspark_server.training.draft_train --target dspark_server/assets/demo/target \\
        --data work_data/draft_data --out work_data/drafters/markov --steps 1500
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dspark_server.models.drafter import DSparkDrafter
from dspark_server.models.drafter_checkpoint import save_drafter
from dspark_server.models.drafter_config import DraftConfig, default_target_layer_ids
from dspark_server.models.loader import load_target
from dspark_server.models.target import TargetModel
from dspark_server.training.chat_format import MASK
from dspark_server.training.distill import load_sequences
from dspark_server.training.draft_batches import (
    BatchOrder,
    anchor_generator,
    make_batch,
    split_heldout,
)
from dspark_server.training.draft_checkpoints import find_checkpoint, load_checkpoint, save_checkpoint
from dspark_server.training.draft_step import (
    evaluate,
    train_step,
)
from dspark_server.training.loop import EvalReport, LoopConfig, LoopProgress, StepReport, run_training_loop
from dspark_server.training.losses import (
    LossConfig,
)

log = logging.getLogger(__name__)

INFO_FILE = "training_info.json"


# ------------------------------------------------------------------------------------ configs


@dataclass(frozen=True)
class DrafterArch:
    """What ``DraftConfig.from_target`` needs beyond the target itself."""

    gamma: int = 7
    head: str = "markov"  # markov | gated | rnn | none
    layers: int = 1
    markov_rank: int = 64
    target_layer_ids: tuple[int, ...] | None = None  # None: ``default_layer_ids``
    confidence: bool = True
    intermediate_size: int | None = None  # None: the target's


@dataclass(frozen=True)
class DraftTrainConfig:
    target_dir: str
    data: str  # distilled data: a ``distill`` output directory or a records JSONL file
    out_dir: str
    run_dir: str | None = None  # checkpoints + log; None: ``default_run_dir(out_dir)``
    eval_data: str | None = None  # None: hold out a slice of ``data``
    arch: DrafterArch = field(default_factory=DrafterArch)
    loss: LossConfig = field(default_factory=LossConfig)
    steps: int = 1000
    batch_size: int = 8  # sequences per step
    seq_len: int = 320  # longer sequences are cut (prompt first, so the answer tail is lost)
    anchors_per_seq: int = 48
    lr: float = 6e-4  # DeepSpec's
    warmup_frac: float = 0.04
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    init_std: float = 0.02  # Hugging Face initializer_range
    eval_every: int = 100  # 0: only at the end
    eval_fraction: float = 0.02
    max_eval_sequences: int = 64
    ckpt_every: int = 50
    seed: int = 0
    threads: int = 2
    resume: bool = False
    overwrite: bool = False  # start fresh even if the run directory holds a checkpoint
    max_minutes: float | None = None
    progress: bool = True
    include_shared: bool = True  # write the frozen embedding / LM-head copies (DeepSpec loads need them)


def default_run_dir(out_dir: str | Path) -> Path:
    """``work_data/draft_runs/<name>-<hash of the out path>``: never inside the package."""
    out = Path(out_dir).resolve()
    return Path("work_data/draft_runs") / f"{out.name}-{hashlib.sha1(str(out).encode()).hexdigest()[:8]}"


def default_layer_ids(num_target_layers: int, num_features: int = 5) -> tuple[int, ...]:
    """Small targets (<= 8 layers): every layer but the last, at most the last 5 of them
    (4 layers -> (0, 1, 2), 6 -> (0..4)); deeper ones: DeepSpec's spread from 1 to L-3."""
    if num_target_layers <= 1:
        return (0,)
    if num_target_layers <= 8:
        return tuple(range(num_target_layers - 1))[-num_features:]
    return default_target_layer_ids(num_target_layers, num_features)


def mask_token_id(target_dir: str | Path) -> int:
    from dspark_server.models.tokenizer import Tokenizer

    tid = Tokenizer(target_dir).token_id(MASK)
    if tid is None:
        raise ValueError(f"the tokenizer in {target_dir} has no {MASK} token (the drafter's mask token)")
    return tid


def build_drafter(
    target: TargetModel,
    mask_id: int,
    arch: DrafterArch,
    seed: int = 0,
    init_std: float = 0.02,
    num_anchors: int = 512,
) -> DSparkDrafter:
    """A freshly initialised drafter: N(0, init_std) matrices and embeddings, zero biases, unit
    norms (the Hugging Face ``_init_weights`` DeepSpec's ``PreTrainedModel`` drafter gets)."""
    ids = arch.target_layer_ids or default_layer_ids(target.config.num_hidden_layers)
    cfg = DraftConfig.from_target(
        target.config,
        mask_token_id=mask_id,
        num_layers=arch.layers,
        target_layer_ids=tuple(ids),
        gamma=arch.gamma,
        head_type=arch.head,
        markov_rank=arch.markov_rank,
        confidence=arch.confidence,
        intermediate_size=arch.intermediate_size,
        num_anchors=num_anchors,
    )
    drafter = DSparkDrafter(cfg, target)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * init_std)
    return drafter


def lr_at(step: int, cfg: DraftTrainConfig) -> float:
    """Linear warm-up over ``warmup_frac`` of the steps, then cosine to ``min_lr_ratio * lr``."""
    warm = max(1, round(cfg.warmup_frac * cfg.steps))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    frac = min(1.0, (step - warm) / max(1, cfg.steps - warm))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


# ------------------------------------------------------------------------------------ optimizer


def make_optimizer(drafter: DSparkDrafter, cfg: DraftTrainConfig) -> torch.optim.AdamW:
    params = [p for p in drafter.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


# ------------------------------------------------------------------------------------ training


def _fmt(xs: list[float]) -> str:
    return "/".join(f"{x:.2f}" for x in xs)


def train_draft(cfg: DraftTrainConfig) -> dict[str, Any]:
    """Train (or resume), evaluating and checkpointing; export the drafter to ``out_dir``."""
    torch.set_num_threads(cfg.threads)
    target = load_target(cfg.target_dir)
    drafter = build_drafter(
        target,
        mask_token_id(cfg.target_dir),
        cfg.arch,
        cfg.seed,
        cfg.init_std,
        num_anchors=cfg.anchors_per_seq,
    )
    opt = make_optimizer(drafter, cfg)
    run = Path(cfg.run_dir) if cfg.run_dir else default_run_dir(cfg.out_dir)
    run.mkdir(parents=True, exist_ok=True)

    data = load_sequences(cfg.data)
    if cfg.eval_data:
        train_idx, held_set = np.arange(len(data)), load_sequences(cfg.eval_data)
        held_set = held_set.subset(np.arange(min(len(held_set), cfg.max_eval_sequences)))
    else:
        train_idx, held_idx = split_heldout(len(data), cfg.eval_fraction, cfg.max_eval_sequences)
        held_set = data.subset(held_idx)
    order = BatchOrder(train_idx, cfg.batch_size, cfg.seed)
    held = [
        make_batch(held_set, list(range(i, min(i + cfg.batch_size, len(held_set)))), cfg.seq_len)
        for i in range(0, len(held_set), cfg.batch_size)
    ]
    data_info = {
        "sequences": len(data),
        "train_sequences": int(len(train_idx)),
        "heldout_sequences": len(held_set),
        "answer_tokens": data.num_answer_tokens,
        "tokens": int(data.ids.size),
    }

    prog, blocks_seen = LoopProgress(), 0
    history: dict[str, list] = {"train": [], "heldout": []}
    ckpt = find_checkpoint(run)
    if ckpt is not None and cfg.resume:
        st = load_checkpoint(ckpt, drafter, opt)
        prog = LoopProgress(st["step"], st["train_seconds"], st["tokens_seen"])
        blocks_seen, history = st["blocks_seen"], st["history"]
        if st.get("data") != data_info:
            log.warning(
                "resuming with different data (%s, was %s): batches differ from the first run",
                data_info,
                st.get("data"),
            )
        print(f"resumed from {ckpt} at step {prog.step}", file=sys.stderr, flush=True)
    elif ckpt is not None and not cfg.overwrite:
        saved_step = json.loads((ckpt / "state.json").read_text())["step"]
        raise FileExistsError(
            f"{run} holds a checkpoint (step {saved_step}); "
            "pass --resume to continue it or --overwrite to start again"
        )
    elif cfg.resume:
        print(f"no checkpoint in {run}: starting from step 0", file=sys.stderr, flush=True)

    n_params = sum(p.numel() for p in drafter.parameters())
    print(
        f"drafter: {n_params:,} trainable parameters, head={drafter.config.head_type}, "
        f"layers={drafter.config.num_hidden_layers}, gamma={drafter.gamma}, "
        f"target_layer_ids={drafter.config.target_layer_ids}; data: {data_info}; run dir {run}",
        file=sys.stderr,
        flush=True,
    )

    def state() -> dict[str, Any]:
        return {
            "step": prog.step,
            "train_seconds": round(prog.train_seconds, 2),
            "tokens_seen": prog.tokens_seen,
            "blocks_seen": blocks_seen,
            "history": history,
            "data": data_info,
            "draft_config": drafter.config.to_hf_dict(),
            "config": _jsonable(asdict(cfg)),
        }

    def run_eval() -> EvalReport:
        t0 = time.perf_counter()
        ev = evaluate(drafter, target, held, cfg.anchors_per_seq, cfg.loss, cfg.seed)
        ev["step"], ev["seconds"] = prog.step, round(time.perf_counter() - t0, 2)
        history["heldout"].append(ev)
        return EvalReport(
            {k: ev[k] for k in ("loss", "tau", "tau_greedy")},
            f"heldout: loss {ev['loss']:.4f} tv {ev['tv']:.4f} tau {ev['tau']:.3f} "
            f"tau_greedy {ev['tau_greedy']:.3f} accept {_fmt(ev['accept_per_pos'])} "
            f"acc {_fmt(ev['accuracy_per_pos'])} ({ev['seconds']:.1f}s)",
        )

    ema: dict[str, float] = {}

    def one_step(index: int) -> StepReport:
        nonlocal blocks_seen, ema
        t0 = time.perf_counter()
        batch = make_batch(data, order.batch(index), cfg.seq_len)
        lr = lr_at(index, cfg)
        r, gnorm = train_step(
            drafter,
            target,
            opt,
            batch,
            cfg.anchors_per_seq,
            anchor_generator(cfg.seed, index),
            lr,
            cfg.loss,
            cfg.grad_clip,
        )
        dt = time.perf_counter() - t0
        blocks_seen += r.blocks
        res = r.res
        cur = {
            "loss": float(res.loss.detach()),
            "tv": float(res.tv),
            "tau": float(res.tau),
            "acc1": float(res.accuracy_per_pos[0]),
        }
        ema = {k: v if k not in ema else 0.9 * ema[k] + 0.1 * v for k, v in cur.items()}
        rec: dict[str, Any] = {
            "loss": round(cur["loss"], 5),
            "ce": round(float(res.ce), 5),
            "tv": round(cur["tv"], 5),
            "confidence": round(float(res.confidence), 5),
            "tau": round(cur["tau"], 4),
            "accept_per_pos": [round(float(x), 4) for x in res.accept_per_pos],
            "accuracy_per_pos": [round(float(x), 4) for x in res.accuracy_per_pos],
            "lr": lr,
            "gnorm": round(gnorm, 4),
            "seconds": round(dt, 3),
            "tokens": batch.num_tokens,
            "blocks": r.blocks,
        }
        if (index + 1) % 10 == 0 or index + 1 == cfg.steps:
            history["train"].append({"step": index + 1, **{k: rec[k] for k in ("loss", "tv", "tau")}})
        postfix = {
            "loss": f"{ema['loss']:.3f}",
            "tv": f"{ema['tv']:.3f}",
            "acc1": f"{ema['acc1']:.2f}",
            "tau": f"{ema['tau']:.2f}",
            "lr": f"{lr:.1e}",
            "s_step": f"{dt:.2f}",
        }
        return StepReport(rec, postfix, batch.num_tokens)

    loop = LoopConfig(
        steps=cfg.steps,
        eval_every=cfg.eval_every or cfg.steps,
        ckpt_every=cfg.ckpt_every,
        max_minutes=cfg.max_minutes,
        eval_at_start=not history["heldout"],
        progress=cfg.progress,
        desc="train draft",
    )
    stopped = run_training_loop(
        loop,
        prog,
        run / "log.jsonl",
        one_step,
        run_eval if held else None,
        lambda: save_checkpoint(run, drafter, opt, state()),
    )
    step, train_seconds, tokens_seen = prog.step, prog.train_seconds, prog.tokens_seen

    drafter.eval()
    out = save_drafter(drafter, cfg.out_dir, include_shared=cfg.include_shared)
    last_eval = history["heldout"][-1] if history["heldout"] else None
    info = {
        "status": stopped,
        "steps": step,
        "target_steps": cfg.steps,
        "parameters": n_params,
        "train_seconds": round(train_seconds, 1),
        "seconds_per_step": round(train_seconds / max(step, 1), 3),
        "tokens_seen": tokens_seen,
        "tokens_per_s": round(tokens_seen / max(train_seconds, 1e-9), 1),
        "blocks_seen": blocks_seen,
        "heldout": last_eval,
        "heldout_history": [
            {k: e[k] for k in ("step", "loss", "tau", "tau_greedy")} for e in history["heldout"]
        ],
        "data": data_info,
        "run_dir": str(run),
        "config": _jsonable(asdict(cfg)),
    }
    (out / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    if stopped == "interrupted":
        raise KeyboardInterrupt
    return info


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    return x


# ---------------------------------------------------------------------------------------- cli


def build_parser() -> argparse.ArgumentParser:
    d = DraftTrainConfig(target_dir="", data="", out_dir="")
    a0 = DrafterArch()
    p = argparse.ArgumentParser(
        prog="dspark train draft",
        description="Train a DSpark drafter on self-distilled data (make the "
        "data with `python -m dspark_server.training.distill`).",
    )
    p.add_argument("--target", required=True, help="target model directory (frozen)")
    p.add_argument("--data", required=True, help="distilled data directory or records JSONL file")
    p.add_argument("--out", required=True, help="output drafter directory (config.json + model.safetensors)")
    p.add_argument(
        "--run-dir", default=None, help="checkpoints and log (default work_data/draft_runs/<out name>-<hash>)"
    )
    p.add_argument("--eval-data", default=None, help="held-out distilled data (default: a slice of --data)")
    p.add_argument("--gamma", type=int, default=a0.gamma)
    p.add_argument("--head", choices=("markov", "gated", "rnn", "none"), default=a0.head)
    p.add_argument("--layers", type=int, default=a0.layers)
    p.add_argument("--markov-rank", type=int, default=a0.markov_rank)
    p.add_argument(
        "--target-layers",
        default=None,
        help="comma-separated target layer ids (default: all but the last for <= 8 layers)",
    )
    p.add_argument("--no-confidence", action="store_true", help="no confidence head")
    p.add_argument("--intermediate-size", type=int, default=None)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup-frac", type=float, default=d.warmup_frac)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--anchors-per-seq", type=int, default=d.anchors_per_seq)
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--ckpt-every", type=int, default=d.ckpt_every)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument("--resume", action="store_true", help="continue from the run directory's checkpoint")
    p.add_argument("--overwrite", action="store_true", help="start again even if a checkpoint exists")
    p.add_argument("--max-minutes", type=float, default=None, help="wall budget: checkpoint, export, exit")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--no-shared-copies",
        action="store_true",
        help="omit the target's embedding / LM-head copies from model.safetensors (smaller; "
        "this server and SGLang load it, DeepSpec's from_pretrained does not)",
    )
    return p


def config_from_args(a: argparse.Namespace) -> DraftTrainConfig:
    layer_ids = tuple(int(x) for x in a.target_layers.split(",")) if a.target_layers else None
    arch = DrafterArch(
        gamma=a.gamma,
        head=a.head,
        layers=a.layers,
        markov_rank=a.markov_rank,
        target_layer_ids=layer_ids,
        confidence=not a.no_confidence,
        intermediate_size=a.intermediate_size,
    )
    return DraftTrainConfig(
        target_dir=a.target,
        data=a.data,
        out_dir=a.out,
        run_dir=a.run_dir,
        eval_data=a.eval_data,
        arch=arch,
        steps=a.steps,
        batch_size=a.batch_size,
        seq_len=a.seq_len,
        anchors_per_seq=a.anchors_per_seq,
        lr=a.lr,
        warmup_frac=a.warmup_frac,
        eval_every=a.eval_every,
        ckpt_every=a.ckpt_every,
        seed=a.seed,
        threads=a.threads,
        resume=a.resume,
        overwrite=a.overwrite,
        max_minutes=a.max_minutes,
        progress=not a.no_progress,
        include_shared=not a.no_shared_copies,
    )


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    info = train_draft(config_from_args(build_parser().parse_args(argv)))
    print(json.dumps({k: v for k, v in info.items() if k not in ("config", "heldout_history")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
