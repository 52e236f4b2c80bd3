"""Hugging Face model directories <-> modules. Safetensors only: no pickle, no remote code."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from dspark_server.config import ModelConfig
from dspark_server.models.target import TargetModel

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}") from None


def read_safetensors_dir(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a directory's ``*.safetensors`` files (sharded or single)."""
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [root / s for s in shards]
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {root} (pickle checkpoints are not loaded)")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def load_state(module: nn.Module, tensors: dict[str, torch.Tensor], ignore: tuple[str, ...] = ()) -> None:
    """Copy tensors into a module by name, failing loudly on missing, unexpected or misshapen ones."""
    own = module.state_dict()
    missing = [k for k in own if k not in tensors]
    unexpected = [k for k in tensors if k not in own and not k.startswith(ignore)]
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not match the model: missing={missing[:8]} unexpected={unexpected[:8]}"
        )
    for name, param in own.items():
        src = tensors[name]
        if src.shape != param.shape:
            raise ValueError(
                f"shape mismatch for {name}: checkpoint {tuple(src.shape)} vs model {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(src.to(param.dtype))


def load_target(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> TargetModel:
    cfg = ModelConfig.from_dir(model_dir)
    model = TargetModel(cfg).to(dtype)
    tensors = read_safetensors_dir(model_dir)
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    load_state(model, tensors, ignore=("model.rotary_emb.",))
    model.eval()
    model.requires_grad_(False)
    model.fuse_projections()
    return model


def save_module(
    module: nn.Module, out_dir: str | Path, config: dict[str, Any], skip: tuple[str, ...] = ()
) -> None:
    """Write ``config.json`` and ``model.safetensors`` (shared storage written once)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    seen: set[int] = set()
    tensors: dict[str, torch.Tensor] = {}
    for name, t in module.state_dict().items():
        if name in skip or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        tensors[name] = t.detach().contiguous().cpu()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def save_target(model: TargetModel, out_dir: str | Path, hf_config: dict[str, Any]) -> None:
    skip = ("lm_head.weight",) if model.config.tie_word_embeddings else ()
    save_module(model, out_dir, hf_config, skip=skip)
