"""DSpark drafter checkpoints: ``config.json`` + ``model.safetensors`` in DeepSpec's layout.

DeepSpec saves the FULL state dict of its ``Qwen3DSparkModel`` with ``save_pretrained``, which
includes frozen copies of the target's embedding and LM head (``embed_tokens.weight``,
``lm_head.weight``; ``tie_word_embeddings`` is false). We write the same two tensors so DeepSpec's
``from_pretrained`` and SGLang (which skips them and attaches the target's) both load our files.
On load we use the target's modules and only check that the stored copies match them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from dspark_server.models.drafter import DSparkDrafter
from dspark_server.models.drafter_config import DraftConfig
from dspark_server.models.layers import serving_layout_
from dspark_server.models.loader import load_state, read_safetensors_dir
from dspark_server.models.target import TargetModel

SHARED_NAMES = ("embed_tokens.weight", "lm_head.weight")
IGNORED_PREFIXES = ("rotary_emb.",)  # HF rotary buffers, if a writer ever persisted them


def drafter_tensors(drafter: DSparkDrafter, include_shared: bool = True) -> dict[str, torch.Tensor]:
    """The tensors of a DeepSpec-layout ``model.safetensors`` (each its own storage)."""
    out = {name: t.detach().contiguous().clone() for name, t in drafter.state_dict().items()}
    if include_shared:
        out["embed_tokens.weight"] = drafter.shared.embed_tokens.weight.detach().contiguous().clone()
        out["lm_head.weight"] = drafter.shared.lm_head.weight.detach().contiguous().clone()
    return out


def save_drafter(drafter: DSparkDrafter, out_dir: str | Path, include_shared: bool = True) -> Path:
    """Write ``config.json`` and ``model.safetensors``. ``include_shared=False`` writes a
    SGLang-only checkpoint without the embedding / LM-head copies (DeepSpec cannot load it)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = str(drafter.fc.weight.dtype).removeprefix("torch.")
    cfg = drafter.config.to_hf_dict() | {"torch_dtype": dtype}
    # Written directly rather than via loader.save_module: that one drops tensors sharing storage,
    # which would lose lm_head.weight behind a tied target's embedding.
    save_file(
        drafter_tensors(drafter, include_shared), str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def read_draft_config(model_dir: str | Path) -> DraftConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in drafter directory {model_dir}")
    return DraftConfig.from_hf_dict(json.loads(path.read_text()))


def load_drafter(
    model_dir: str | Path, target: TargetModel, dtype: torch.dtype | None = None, check_shared: bool = True
) -> DSparkDrafter:
    """Build a drafter sharing ``target``'s embedding and LM head and load its weights.

    Fails on missing, unexpected or misshapen tensors, on a config that does not fit the target,
    and (``check_shared``) when the stored embedding / LM-head copies differ from the target's,
    which means the drafter was trained for another model.
    """
    cfg = read_draft_config(model_dir)
    drafter = DSparkDrafter(cfg, target)
    drafter.to(dtype or target.lm_head.weight.dtype)
    tensors = read_safetensors_dir(model_dir)
    tensors = {k.removeprefix("_orig_mod."): v for k, v in tensors.items()}  # torch.compile'd saves
    for name in SHARED_NAMES:
        stored = tensors.pop(name, None)
        if stored is None:
            continue
        shared = drafter.shared
        mine = shared.embed_tokens.weight if name.startswith("embed") else shared.lm_head.weight
        if stored.shape != mine.shape:
            raise ValueError(
                f"shape mismatch for {name}: checkpoint {tuple(stored.shape)} vs target {tuple(mine.shape)}"
            )
        if check_shared:
            _check_same_rows(name, stored, mine)
    load_state(drafter, tensors, ignore=IGNORED_PREFIXES)
    drafter.eval()
    drafter.requires_grad_(False)
    drafter.fuse_projections()
    for module in drafter.modules():
        if isinstance(module, nn.Linear):
            serving_layout_(module)  # faster small-M GEMMs; values unchanged
    return drafter


def _check_same_rows(name: str, stored: torch.Tensor, mine: torch.Tensor, rows: int = 64) -> None:
    """Compare a spread of rows at bf16 precision (checkpoints usually store bf16 copies)."""
    idx = torch.linspace(0, mine.shape[0] - 1, min(rows, mine.shape[0])).long()
    a, b = stored[idx].float(), mine.detach()[idx].float()
    if not torch.allclose(a, b, rtol=1e-2, atol=1e-2 * float(b.abs().max()) + 1e-6):
        raise ValueError(
            f"checkpoint {name} differs from the target's: the drafter was trained for "
            "another target model (pass check_shared=False to load anyway)"
        )
