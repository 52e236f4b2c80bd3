"""`dspark train widen`: a function-preserving K-fold widening of a target and its DSpark drafter.

The twin computes exactly what the original computes (up to float rounding), at roughly K² the
cost, so speculative decoding can be measured on a model with real costs whose outputs are known.
Every widened dimension is repeated blockwise, ``v -> [v, v, ..., v]`` (K copies):

- hidden coordinates (embedding output, residual stream, every norm's weight). RMSNorm's mean
  square over K copies is the original's, so ``norm'(tile(x)) = tile(norm(x))``;
- attention heads and KV heads: q/k/v/o projections' head rows are the whole head list tiled, so
  query head ``c*Hq + h`` (copy c of head h) reads kv head ``(c*Hq + h) // (Hq/Hkv) = c*Hkv +
  h // (Hq/Hkv)``, copy c of h's original kv head: the GQA grouping is preserved; head_dim, the
  q/k norms (per head), the softmax scale and the rotary tables are unchanged;
- the SwiGLU intermediate units.

A linear map whose output is a repeated dimension repeats its rows (and its bias); one that sums
over a repeated dimension repeats those input columns and scales them by 1/K, so ``W' tile(x) =
W x``. The LM head sums over the hidden size and carries the 1/K, the embedding does not, so the
twin's embeddings are untied. In the drafter the same rules apply to its layers, ``fc`` (each
target-layer segment of its input separately), ``hidden_norm``, ``norm`` and the hidden-size
columns of the confidence head and of the gated / RNN heads' input projections; the Markov
``W1``/``W2`` are vocabulary-by-rank and stay as they are. Draft logits, Markov bias and raw
confidences therefore equal the original's, and the STS calibrations are copied unchanged.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dspark_server.models.drafter_checkpoint import SHARED_NAMES
from dspark_server.models.drafter_config import DraftConfig
from dspark_server.models.loader import read_safetensors_dir

# Written afresh in the twin; every other file of a source directory is copied unchanged
# (tokenizer, generation_config.json, sts_calibration*.json, ...).
REWRITTEN = ("config.json", "model.safetensors", "model.safetensors.index.json", "training_info.json")
README = "README.md"


@dataclass(frozen=True)
class WidenConfig:
    target_dir: str
    out_dir: str  # the twin target goes to OUT/target, its drafter to OUT/draft
    draft_dir: str | None = None  # None: widen the target only
    factor: int = 8

    def __post_init__(self) -> None:
        if self.factor < 1:
            raise ValueError(f"--factor must be >= 1, got {self.factor}")

    @property
    def out_target(self) -> Path:
        return Path(self.out_dir) / "target"

    @property
    def out_draft(self) -> Path:
        return Path(self.out_dir) / "draft"


@dataclass(frozen=True)
class WidenResult:
    target_dir: Path
    draft_dir: Path | None
    target_parameters: int
    draft_parameters: int | None  # without the shared embedding / LM-head copies


# ----------------------------------------------------------------------------- tensor rules


def tile_rows(t: torch.Tensor, k: int) -> torch.Tensor:
    """An output (or a vector) over a repeated dimension: K copies stacked blockwise along dim 0."""
    return t.repeat(k, *([1] * (t.dim() - 1)))


def read_tiled(w: torch.Tensor, k: int, parts: Sequence[tuple[int, bool]] | None = None) -> torch.Tensor:
    """Input columns of ``w`` [out, in] as consecutive ``(width, repeated)`` parts (default: all
    columns repeated); a repeated part is tiled K times and scaled 1/K, the others are kept."""
    parts = parts or [(w.shape[1], True)]
    widths = [width for width, _ in parts]
    if sum(widths) != w.shape[1]:
        raise ValueError(f"column parts {widths} do not add up to {w.shape[1]} columns")
    pieces = w.split(widths, dim=1)
    exact = torch.promote_types(w.dtype, torch.float32)  # bf16 / fp16 divided in fp32
    out = [
        p.to(exact).repeat(1, k).div(k).to(w.dtype) if rep else p
        for p, (_, rep) in zip(pieces, parts, strict=True)
    ]
    return torch.cat(out, dim=1)


def linear_tiled(w: torch.Tensor, k: int) -> torch.Tensor:
    """A projection between two repeated dimensions: rows tiled, columns tiled and scaled 1/K."""
    return tile_rows(read_tiled(w, k), k)


def unchanged(t: torch.Tensor, k: int) -> torch.Tensor:
    """A tensor over dimensions that are not widened (head_dim, Markov rank, vocabulary)."""
    return t


def embed_tiled(w: torch.Tensor, k: int) -> torch.Tensor:
    """The embedding [V, H]: its output is the hidden size, so columns are tiled without scaling."""
    return w.repeat(1, k)


Rule = Callable[[torch.Tensor, int], torch.Tensor]
_PROJ = re.compile(r"(^|\.)(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)\.(weight|bias)$")


def decoder_rule(name: str) -> Rule | None:
    """The rule of a decoder tensor (target ``model.*`` / ``lm_head`` or drafter backbone), or
    None if the name is not a decoder tensor."""
    if name.endswith("embed_tokens.weight"):
        return embed_tiled
    if name == "lm_head.weight":
        return read_tiled
    if name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
        return unchanged  # over head_dim, which is unchanged
    if name.endswith("norm.weight"):
        return tile_rows  # input_layernorm, post_attention_layernorm, model.norm, hidden_norm
    m = _PROJ.search(name)
    if m is not None:
        return linear_tiled if m.group(5) == "weight" else tile_rows
    return None


def drafter_rule(name: str, cfg: DraftConfig) -> Rule:
    """The rule of a DeepSpec-layout drafter tensor (fails loudly on a name it does not know)."""
    h, r = cfg.hidden_size, cfg.markov_rank
    if name == "fc.weight":  # reads [target layer i output for i in target_layer_ids], each repeated
        segments = [(h, True)] * len(cfg.target_layer_ids)
        return lambda w, k: tile_rows(read_tiled(w, k, segments), k)
    if name in ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight"):
        return unchanged  # [V, r] both
    if name == "markov_head.gate_proj.weight":  # input [h; W1[x]]
        return lambda w, k: read_tiled(w, k, [(h, True), (r, False)])
    if name == "markov_head.joint_proj.weight":  # input [s; W1[x]; h]
        return lambda w, k: read_tiled(w, k, [(2 * r, False), (h, True)])
    if name == "confidence_head.proj.weight":  # input [h] or [h; W1[x]]
        return lambda w, k: read_tiled(w, k, [(h, True)] + ([(r, False)] if w.shape[1] > h else []))
    if name.startswith(("markov_head.", "confidence_head.")) and name.endswith(".bias"):
        return unchanged  # outputs are rank- or scalar-sized
    rule = None if name.startswith(("markov_head.", "confidence_head.")) else decoder_rule(name)
    if rule is None:
        raise ValueError(f"no widening rule for drafter tensor {name!r}")
    return rule


def widen_target_tensors(tensors: dict[str, torch.Tensor], k: int, tied: bool) -> dict[str, torch.Tensor]:
    """A Hugging Face decoder state dict, widened; a tied source gets its own ``lm_head.weight``."""
    src = dict(tensors)
    if tied or "lm_head.weight" not in src:
        src["lm_head.weight"] = src["model.embed_tokens.weight"]
    out: dict[str, torch.Tensor] = {}
    for name, t in src.items():
        if name.startswith("model.rotary_emb."):
            continue
        rule = decoder_rule(name)
        if rule is None:
            raise ValueError(f"no widening rule for target tensor {name!r}")
        out[name] = rule(t, k).contiguous()
    return out


def widen_drafter_tensors(
    tensors: dict[str, torch.Tensor], cfg: DraftConfig, k: int
) -> dict[str, torch.Tensor]:
    """A DeepSpec-layout drafter state dict (with or without the shared embedding / LM-head
    copies, which are widened like the target's), widened."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        clean = name.removeprefix("_orig_mod.")
        if clean.startswith("rotary_emb."):
            continue
        out[clean] = drafter_rule(clean, cfg)(t, k).contiguous()
    return out


# ----------------------------------------------------------------------------- configs


def widen_hf_config(raw: dict[str, Any], k: int) -> dict[str, Any]:
    """A target or drafter ``config.json`` with every repeated size times K, head_dim kept
    explicit (it would otherwise be derived from hidden / heads) and the embeddings untied."""
    heads = int(raw["num_attention_heads"])
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    head_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // heads)
    return raw | {
        "hidden_size": k * int(raw["hidden_size"]),
        "intermediate_size": k * int(raw["intermediate_size"]),
        "num_attention_heads": k * heads,
        "num_key_value_heads": k * kv_heads,
        "head_dim": head_dim,
        "tie_word_embeddings": False,
    }


# ----------------------------------------------------------------------------- directories


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _copy_others(src: Path, dst: Path) -> list[str]:
    copied = []
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name not in REWRITTEN and f.suffix != ".safetensors":
            shutil.copy2(f, dst / f.name)
            copied.append(f.name)
    return copied


def _write_dir(
    src: Path,
    dst: Path,
    config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    k: int,
    what: str,
) -> int:
    dst.mkdir(parents=True, exist_ok=True)
    copied = _copy_others(src, dst)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    # a drafter's parameters leave out its copies of the target's embedding and LM head
    params = sum(t.numel() for name, t in tensors.items() if name not in SHARED_NAMES or what == "Target")
    info = {
        "widened_copy": True,
        "source": str(src.resolve()),
        "factor": k,
        "parameters": params,
        "rules": "hidden, heads, KV heads and MLP units repeated blockwise K times; matrices summing "
        "over a repeated dimension scaled 1/K; embeddings untied (dspark_server/training/widen.py)",
        "copied_unchanged": copied,
        "source_training_info": _read_json(src / "training_info.json"),
    }
    (dst / "training_info.json").write_text(json.dumps(info, indent=2) + "\n")
    if README not in copied:
        (dst / README).write_text(
            f"# {what}: a {k}x widened copy of {src.name}\n\n"
            f"Built by `dspark train widen --factor {k}` from `{src}`. Every hidden coordinate, "
            f"attention head, KV head and MLP unit of the source is repeated {k} times and every "
            f"matrix that sums over a repeated dimension is scaled by 1/{k}: the logits (and, for a "
            "drafter, the Markov bias and confidences) equal the source's up to float rounding, "
            "at real compute cost. Quality is the source's; nothing was trained.\n"
        )
    return params


def widen_pair(cfg: WidenConfig) -> WidenResult:
    k = cfg.factor
    src_target = Path(cfg.target_dir)
    raw_target = json.loads((src_target / "config.json").read_text())
    tensors = widen_target_tensors(
        read_safetensors_dir(src_target), k, bool(raw_target.get("tie_word_embeddings", False))
    )
    n_target = _write_dir(src_target, cfg.out_target, widen_hf_config(raw_target, k), tensors, k, "Target")
    del tensors
    if cfg.draft_dir is None:
        return WidenResult(cfg.out_target, None, n_target, None)
    src_draft = Path(cfg.draft_dir)
    raw_draft = json.loads((src_draft / "config.json").read_text())
    dcfg = DraftConfig.from_hf_dict(raw_draft)
    drafted = widen_drafter_tensors(read_safetensors_dir(src_draft), dcfg, k)
    new_raw = widen_hf_config(raw_draft, k)
    DraftConfig.from_hf_dict(new_raw)  # still a valid drafter config
    n_draft = _write_dir(src_draft, cfg.out_draft, new_raw, drafted, k, "DSpark drafter")
    return WidenResult(cfg.out_target, cfg.out_draft, n_target, n_draft)


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    from dspark_server.assets import default_draft, default_target

    p = argparse.ArgumentParser(
        prog="dspark train widen",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--factor", type=int, default=8, help="K: every widened size times K (default 8)")
    p.add_argument("--out", required=True, help="output directory: OUT/target and OUT/draft")
    p.add_argument("--target", default=None, help="source target directory (default: bundled demo)")
    p.add_argument(
        "--draft",
        default=None,
        help="source drafter directory (default: the bundled demo drafter when --target is not "
        "given; 'none': widen the target only)",
    )
    p.add_argument("--no-check", action="store_true", help="skip comparing the twin's logits to the source's")
    a = p.parse_args(argv)
    draft = None if a.draft == "none" else a.draft or (default_draft() if a.target is None else None)
    target = a.target or default_target()
    cfg = WidenConfig(target_dir=target, out_dir=a.out, draft_dir=draft, factor=a.factor)
    result = widen_pair(cfg)
    mb = result.target_parameters * 4 / 1e6
    print(f"target: {result.target_dir} ({result.target_parameters:,} parameters, {mb:.0f} MB fp32)")
    if result.draft_dir is not None:
        print(
            f"drafter: {result.draft_dir} ({result.draft_parameters:,} parameters besides the shared copies)"
        )
    if not a.no_check:
        from dspark_server.training.widen_check import compare_pairs

        diff = compare_pairs(cfg.target_dir, cfg.draft_dir, result.target_dir, result.draft_dir)
        print(f"max |logit difference| twin vs source: {diff}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
