"""Resumable drafter-training checkpoints: weights and AdamW moments in safetensors, step and
history in JSON (no pickle), swapped in atomically."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from dspark_server.models.drafter import DSparkDrafter
from dspark_server.models.drafter_config import DraftConfig
from dspark_server.models.loader import load_state


def save_checkpoint(
    run_dir: str | Path, drafter: DSparkDrafter, opt: torch.optim.Optimizer, state: dict[str, Any]
) -> Path:
    """``run_dir/ckpt``: drafter.safetensors, optim.safetensors (AdamW moments flattened by
    parameter index), state.json. Written to ``ckpt.tmp`` and swapped in, so a crash leaves the
    previous checkpoint (or ``ckpt.old``) intact."""
    run = Path(run_dir)
    tmp, cur, old = run / "ckpt.tmp", run / "ckpt", run / "ckpt.old"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(
        {k: v.detach().contiguous() for k, v in drafter.state_dict().items()},
        str(tmp / "drafter.safetensors"),
        metadata={"format": "pt"},
    )
    flat: dict[str, torch.Tensor] = {}
    for pid, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            flat[f"{pid}.{k}"] = torch.as_tensor(v).detach().contiguous()
    save_file(flat, str(tmp / "optim.safetensors"))
    (tmp / "state.json").write_text(json.dumps(state, indent=1) + "\n")
    shutil.rmtree(old, ignore_errors=True)
    if cur.exists():
        cur.rename(old)
    tmp.rename(cur)
    shutil.rmtree(old, ignore_errors=True)
    return cur


def find_checkpoint(run_dir: str | Path) -> Path | None:
    run = Path(run_dir)
    for d in (run / "ckpt", run / "ckpt.old"):
        if (d / "state.json").is_file():
            return d
    return None


def load_checkpoint(ckpt: str | Path, drafter: DSparkDrafter, opt: torch.optim.Optimizer) -> dict[str, Any]:
    d = Path(ckpt)
    state = json.loads((d / "state.json").read_text())
    saved_cfg = DraftConfig.from_hf_dict(state["draft_config"])
    if saved_cfg != drafter.config:
        raise ValueError(
            f"checkpoint {d} is for another drafter configuration:\n  saved {saved_cfg}\n"
            f"  now   {drafter.config}"
        )
    load_state(drafter, load_file(str(d / "drafter.safetensors")))
    osd = opt.state_dict()
    per_param: dict[int, dict[str, torch.Tensor]] = {}
    for key, v in load_file(str(d / "optim.safetensors")).items():
        pid, name = key.split(".", 1)
        per_param.setdefault(int(pid), {})[name] = v
    opt.load_state_dict({"state": per_param, "param_groups": osd["param_groups"]})
    return state
