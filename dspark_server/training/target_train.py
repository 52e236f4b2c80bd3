"""Train the small Qwen3-architecture demo target on CPU.

Pipeline: corpus documents -> chat / plain samples (``chat_format``) -> token stream with a
loss mask (``prepare_data``) -> packed random windows -> ``TargetModel`` with
``DenseCausalAttention`` -> AdamW, warm-up + cosine LR, gradient clipping -> periodic held-out loss,
resumable checkpoints (safetensors + JSON only, no pickle) -> final Hugging Face directory via
``loader.save_target`` plus tokenizer files and ``generation_config.json``.

    python -m dspark_server.training.target_train --out dspark_server/assets/demo/target
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from dspark_server.config import ModelConfig
from dspark_server.models.attention import DenseCausalAttention
from dspark_server.models.loader import load_state, save_target
from dspark_server.models.target import TargetModel
from dspark_server.training.chat_format import (
    ENDOFTEXT,
    IM_END,
    render_chat,
)
from dspark_server.training.loop import EvalReport, LoopConfig, LoopProgress, StepReport, run_training_loop
from dspark_server.training.target_data import DataConfig, TokenStream, prepare_data

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


# ------------------------------------------------------------------------------ architecture


@dataclass(frozen=True)
class TargetArch:
    vocab_size: int = 6144
    hidden_size: int = 256
    intermediate_size: int = 576
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6


def hf_config(arch: TargetArch, eos_ids: tuple[int, ...], pad_id: int) -> dict[str, Any]:
    """A ``Qwen3ForCausalLM`` ``config.json`` (also loadable by ``transformers``)."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": arch.num_hidden_layers,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_key_value_heads,
        "head_dim": arch.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": arch.max_position_embeddings,
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": arch.num_hidden_layers,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": list(eos_ids),
        "pad_token_id": pad_id,
        "torch_dtype": "float32",
    }


def generation_config(eos_ids: tuple[int, ...], pad_id: int) -> dict[str, Any]:
    return {
        "bos_token_id": None,
        "eos_token_id": list(eos_ids),
        "pad_token_id": pad_id,
        "do_sample": False,
        "max_new_tokens": 256,
    }


def init_weights(model: TargetModel, std: float = 0.02) -> None:
    """GPT-2 style init: N(0, std) everywhere, residual output projections scaled by 1/sqrt(2L)."""
    n_layers = model.config.num_hidden_layers
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.normal_(0.0, std / math.sqrt(2 * n_layers))
            elif p.dim() >= 2:
                p.normal_(0.0, std)
            else:
                p.zero_()


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


# ------------------------------------------------------------------------------------- model io


def forward_logits(model: TargetModel, x: torch.Tensor) -> torch.Tensor:
    """Logits [B, S, V] of a [B, S] batch (positions 0..S-1 in every row)."""
    b, s = x.shape
    positions = torch.arange(s).repeat(b)
    out = model(x.flatten(), positions, DenseCausalAttention(b, s))
    return out.logits.view(b, s, -1)


def masked_loss(logits: torch.Tensor, y: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    ce = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="none")
    mf = m.flatten().float()
    return (ce * mf).sum() / mf.sum().clamp_min(1.0)


def train_step(
    model: TargetModel,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    m: torch.Tensor,
    lr: float,
    clip: float = 1.0,
) -> tuple[float, float]:
    for g in opt.param_groups:
        g["lr"] = lr
    loss = masked_loss(forward_logits(model, x), y, m)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    return float(loss.detach()), float(gnorm)


@torch.no_grad()
def evaluate(model: TargetModel, batches) -> float:
    was = model.training
    model.eval()
    tot, n = 0.0, 0.0
    for x, y, m in batches:
        ce = F.cross_entropy(forward_logits(model, x).flatten(0, 1), y.flatten(), reduction="none")
        tot += float((ce * m.flatten()).sum())
        n += float(m.sum())
    model.train(was)
    return tot / max(n, 1.0)


def make_optimizer(model: TargetModel, lr: float, weight_decay: float) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and not n.startswith("lm_head")]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )


def save_checkpoint(
    ckpt_dir: str | Path, model: TargetModel, opt: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Weights and AdamW moments as safetensors, step/config/history as JSON (no pickle)."""
    d = Path(ckpt_dir)
    d.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(tensors, str(d / "model.tmp"))
    osd = opt.state_dict()
    otensors = {}
    for pid, st in osd["state"].items():
        for k, v in st.items():
            otensors[f"{pid}.{k}"] = torch.as_tensor(v).detach().contiguous()
    save_file(otensors, str(d / "optim.tmp"))
    (d / "state.tmp").write_text(json.dumps(state, indent=1) + "\n")
    for stem in ("model", "optim"):
        (d / f"{stem}.tmp").replace(d / f"{stem}.safetensors")
    (d / "state.tmp").replace(d / "state.json")


def load_checkpoint(ckpt_dir: str | Path, model: TargetModel, opt: torch.optim.Optimizer) -> dict[str, Any]:
    d = Path(ckpt_dir)
    tensors = load_file(str(d / "model.safetensors"))
    if model.config.tie_word_embeddings:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    load_state(model, tensors, ignore=("model.rotary_emb.",))
    flat = load_file(str(d / "optim.safetensors"))
    osd = opt.state_dict()
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, v in flat.items():
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = v
    opt.load_state_dict({"state": state, "param_groups": osd["param_groups"]})
    return json.loads((d / "state.json").read_text())


def export_model(
    model: TargetModel,
    out_dir: str | Path,
    tokenizer_dir: str | Path,
    hf: dict[str, Any],
    gen: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> None:
    """Final Hugging Face directory: weights + config + tokenizer files + generation config."""
    out = Path(out_dir)
    save_target(model, out, hf)
    for name in TOKENIZER_FILES:
        src = Path(tokenizer_dir) / name
        if src.is_file():
            shutil.copyfile(src, out / name)
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    if extra is not None:
        (out / "training_info.json").write_text(json.dumps(extra, indent=2) + "\n")


# ------------------------------------------------------------------------------------ training


@dataclass(frozen=True)
class TrainConfig:
    data: DataConfig = field(default_factory=DataConfig)
    arch: TargetArch = field(default_factory=TargetArch)
    run_dir: str = "work_data/target_run"  # checkpoints + log
    out_dir: str = "dspark_server/assets/demo/target"  # final model directory
    steps: int = 950
    batch_size: int = 6
    seq_len: int = 256
    lr: float = 2.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_windows: int = 32
    ckpt_every: int = 25
    seed: int = 0
    threads: int = 2
    resume: bool = True
    progress: bool = True
    max_minutes: float | None = None  # stop early (and export) after this much training time


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cos)


def build_model(arch: TargetArch, tok: Tokenizer, seed: int = 0) -> tuple[TargetModel, dict, dict]:
    im_end, pad = tok.token_to_id(IM_END), tok.token_to_id(ENDOFTEXT)
    if im_end is None or pad is None or tok.get_vocab_size(with_added_tokens=True) != arch.vocab_size:
        raise ValueError(
            f"tokenizer (vocab {tok.get_vocab_size(with_added_tokens=True)}) does not match "
            f"arch.vocab_size={arch.vocab_size} or lacks the special tokens"
        )
    eos = (im_end, pad)
    hf = hf_config(arch, eos, pad)
    torch.manual_seed(seed)
    model = TargetModel(ModelConfig.from_hf_dict(hf))
    init_weights(model)
    return model, hf, generation_config(eos, pad)


def train_target(cfg: TrainConfig = TrainConfig()) -> dict[str, Any]:
    """Train (resuming from ``run_dir`` when a checkpoint exists) and export to ``out_dir``."""
    torch.set_num_threads(cfg.threads)
    data_manifest = prepare_data(cfg.data)
    tok = Tokenizer.from_file(str(Path(cfg.data.tokenizer_dir) / "tokenizer.json"))
    model, hf, gen = build_model(cfg.arch, tok, cfg.seed)
    opt = make_optimizer(model, cfg.lr, cfg.weight_decay)
    run = Path(cfg.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    ckpt = run / "ckpt"
    history: dict[str, Any] = {"train": [], "heldout": []}
    prog = LoopProgress()
    if cfg.resume and (ckpt / "state.json").is_file():
        st = load_checkpoint(ckpt, model, opt)
        prog = LoopProgress(st["step"], st["elapsed"], st["tokens_seen"])
        history = st["history"]
        print(f"resumed from {ckpt} at step {prog.step}", flush=True)
    train = TokenStream(cfg.data.out_dir, "train")
    held = TokenStream(cfg.data.out_dir, "heldout").fixed_batches(
        cfg.eval_windows, cfg.batch_size, cfg.seq_len
    )
    n_params = count_parameters(model)
    print(f"parameters: {n_params:,}  train tokens: {train.ids.numel():,}", flush=True)
    model.train()
    ema: float | None = None

    def one_step(index: int) -> StepReport:
        nonlocal ema
        x, y, m = train.random_batch(cfg.batch_size, cfg.seq_len, cfg.seed, index)
        lr = lr_at(index, cfg)
        loss, gnorm = train_step(model, opt, x, y, m, lr, cfg.grad_clip)
        ema = loss if ema is None else 0.95 * ema + 0.05 * loss
        if (index + 1) % 10 == 0:
            history["train"].append([index + 1, round(ema, 4)])
        record = {"loss": round(loss, 4), "ema": round(ema, 4), "lr": lr, "gnorm": round(gnorm, 3)}
        return StepReport(record, {"loss": f"{ema:.3f}", "lr": f"{lr:.1e}"}, x.numel())

    def run_eval() -> EvalReport:
        t0 = time.time()
        held_loss = round(evaluate(model, held), 4)
        history["heldout"].append([prog.step, held_loss])
        train_ema = f"{ema:.4f}" if ema is not None else "-"
        return EvalReport(
            held_loss, f"train(ema) {train_ema}  heldout {held_loss:.4f}  ({time.time() - t0:.1f}s eval)"
        )

    def save() -> None:
        state = {
            "step": prog.step,
            "elapsed": prog.train_seconds,
            "tokens_seen": prog.tokens_seen,
            "history": history,
            "config": asdict(cfg),
        }
        save_checkpoint(ckpt, model, opt, state)

    loop = LoopConfig(
        steps=cfg.steps,
        eval_every=cfg.eval_every,
        ckpt_every=cfg.ckpt_every,
        max_minutes=cfg.max_minutes,
        progress=cfg.progress,
        desc="train target",
    )
    status = run_training_loop(loop, prog, run / "log.jsonl", one_step, run_eval, save)
    step, elapsed, tokens_seen = prog.step, prog.train_seconds, prog.tokens_seen
    final_held = history["heldout"][-1][1] if history["heldout"] else evaluate(model, held)
    info = {
        "status": status,
        "parameters": n_params,
        "steps": step,
        "tokens_seen": tokens_seen,
        "train_seconds": round(elapsed, 1),
        "final_train_loss_ema": history["train"][-1][1] if history["train"] else None,
        "final_heldout_loss": final_held,
        "data": data_manifest,
        "config": asdict(cfg),
    }
    model.eval()
    export_model(model, cfg.out_dir, cfg.data.tokenizer_dir, hf, gen, info)
    if status == "interrupted":
        raise KeyboardInterrupt
    return info


# ----------------------------------------------------------------------------------- checking


@torch.no_grad()
def greedy_generate(
    model: TargetModel, prompt_ids: list[int], max_new_tokens: int = 64, stop_ids: tuple[int, ...] = ()
) -> list[int]:
    """Greedy decoding by full recompute per token (for checks, not serving)."""
    ids = list(prompt_ids)
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = forward_logits(model, torch.tensor([ids]))[0, -1]
        nxt = int(logits.argmax())
        out.append(nxt)
        ids.append(nxt)
        if nxt in stop_ids:
            break
    return out


def chat_answer(model: TargetModel, tok: Tokenizer, user: str, max_new_tokens: int = 96) -> str:
    prompt = render_chat([{"role": "user", "content": user}], add_generation_prompt=True)
    ids = tok.encode(prompt, add_special_tokens=False).ids
    stops = tuple(model.config.eos_token_ids)
    return tok.decode(greedy_generate(model, ids, max_new_tokens, stops), skip_special_tokens=False)


DEMO_PROMPTS = (
    "Write a Python function that reads a file",
    "Tell me about the history of Python.",
    "Write a Python function `parse_args(argv)` that parses command line arguments.",
    "Explain how the garbage collector works.",
)


def main(argv: list[str] | None = None) -> int:
    d = TrainConfig()
    a0 = TargetArch()
    p = argparse.ArgumentParser(description="Train the demo Qwen3 target model on CPU.")
    p.add_argument("--corpus", default=d.data.corpus_dir)
    p.add_argument("--tokenizer", default=d.data.tokenizer_dir)
    p.add_argument("--data-dir", default=d.data.out_dir)
    p.add_argument("--run-dir", default=d.run_dir)
    p.add_argument("--out", default=d.out_dir)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--ckpt-every", type=int, default=d.ckpt_every)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument("--hidden-size", type=int, default=a0.hidden_size)
    p.add_argument("--intermediate-size", type=int, default=a0.intermediate_size)
    p.add_argument("--layers", type=int, default=a0.num_hidden_layers)
    p.add_argument("--heads", type=int, default=a0.num_attention_heads)
    p.add_argument("--kv-heads", type=int, default=a0.num_key_value_heads)
    p.add_argument("--head-dim", type=int, default=a0.head_dim)
    p.add_argument("--vocab-size", type=int, default=a0.vocab_size)
    p.add_argument("--max-minutes", type=float, default=None)
    p.add_argument("--no-resume", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--prepare-only", action="store_true", help="only build the token streams")
    p.add_argument("--sample", metavar="MODEL_DIR", help="print greedy answers of a saved model and exit")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.sample:
        from dspark_server.models.loader import load_target

        model = load_target(a.sample)
        tok = Tokenizer.from_file(str(Path(a.sample) / "tokenizer.json"))
        for q in DEMO_PROMPTS:
            print(f"### {q}\n{chat_answer(model, tok, q)}\n", flush=True)
        return 0
    data = replace(d.data, corpus_dir=a.corpus, tokenizer_dir=a.tokenizer, out_dir=a.data_dir, seed=a.seed)
    if a.prepare_only:
        print(json.dumps(prepare_data(data, force=True), indent=2))
        return 0
    arch = TargetArch(
        vocab_size=a.vocab_size,
        hidden_size=a.hidden_size,
        intermediate_size=a.intermediate_size,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        head_dim=a.head_dim,
    )
    cfg = TrainConfig(
        data=data,
        arch=arch,
        run_dir=a.run_dir,
        out_dir=a.out,
        steps=a.steps,
        batch_size=a.batch_size,
        seq_len=a.seq_len,
        lr=a.lr,
        warmup_steps=a.warmup_steps,
        eval_every=a.eval_every,
        ckpt_every=a.ckpt_every,
        seed=a.seed,
        threads=a.threads,
        resume=not a.no_resume,
        progress=not a.no_progress,
        max_minutes=a.max_minutes,
    )
    info = train_target(cfg)
    print(json.dumps({k: v for k, v in info.items() if k not in ("data", "config")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
