"""Drafter checkpoints: round trip, DeepSpec's layout written by hand, loud failures, SGLang parsing."""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_drafter import make_target

from dspark_server.models.drafter import DraftContext, DSparkDrafter
from dspark_server.models.drafter_checkpoint import load_drafter, save_drafter
from dspark_server.models.drafter_config import DraftConfig
from dspark_server.models.target import TargetModel

V, H, S, R = 97, 64, 20, 8  # V and H must match test_drafter.make_target


def make_drafter(target: TargetModel, head: str = "markov") -> DSparkDrafter:
    torch.manual_seed(1)
    cfg = DraftConfig.from_target(
        target.config,
        mask_token_id=V - 1,
        num_layers=2,
        target_layer_ids=(1, 2),
        gamma=4,
        head_type=head,
        markov_rank=R,
        intermediate_size=80,
    )
    d = DSparkDrafter(cfg, target)
    with torch.no_grad():
        for p in d.parameters():
            p.normal_(0, 0.3)
    return d.eval()


def run_both_paths(d: DSparkDrafter) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids, feats = torch.randint(0, V - 1, (1, S), generator=g), torch.randn(1, S, 2 * H, generator=g)
    anchors = torch.tensor([[2, 9, 15]])
    with torch.no_grad():
        train = d.forward_train(feats, ids, anchors)
    pool = d.new_kv_pool(32)
    d.write_context(feats[0], torch.arange(S), torch.arange(S) + 1, pool)
    a = anchors[0]
    ctx = DraftContext.from_slot_lists([torch.arange(int(x)) + 1 for x in a])
    block = d.backbone(ids[0, a], a, ctx, pool)
    return train.logits, train.confidence_logits, block.logits


@pytest.mark.parametrize(
    ("head", "tied"), [("markov", False), ("rnn", True), ("gated", False), ("none", False)]
)
def test_round_trip_gives_identical_logits(tmp_path: Path, head: str, tied: bool) -> None:
    target = make_target(tied=tied)
    d = make_drafter(target, head)
    save_drafter(d, tmp_path)
    loaded = load_drafter(tmp_path, target)
    assert loaded.config == d.config
    mine, theirs = d.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    # the loaded weights are stored in their serving layout: same values, GEMMs rounding apart
    for a, b in zip(run_both_paths(d), run_both_paths(loaded), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert torch.equal(tensors["lm_head.weight"], target.lm_head.weight)  # DeepSpec keeps both copies
    assert torch.equal(tensors["embed_tokens.weight"], target.model.embed_tokens.weight)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3DSparkModel"] and raw["model_type"] == "qwen3"
    assert raw["block_size"] == 4 and raw["target_layer_ids"] == [1, 2] and raw["mask_token_id"] == V - 1
    assert raw["markov_rank"] == (0 if head == "none" else R)
    assert ("markov_head_type" in raw) == (head != "none")


def deepspec_config() -> dict[str, Any]:
    """What DeepSpec's save_pretrained writes (transformers 5: rope_parameters, dtype)."""
    return {
        "architectures": ["Qwen3DSparkModel"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "block_size": 4,
        "bos_token_id": None,
        "dtype": "bfloat16",
        "confidence_head_with_markov": True,
        "enable_confidence_head": True,
        "eos_token_id": None,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": H,
        "initializer_range": 0.02,
        "intermediate_size": 80,
        "layer_types": ["full_attention"],
        "markov_head_type": "vanilla",
        "markov_rank": R,
        "mask_token_id": 96,
        "max_position_embeddings": 256,
        "max_window_layers": 28,
        "num_anchors": 512,
        "num_attention_heads": 4,
        "num_hidden_layers": 1,
        "num_key_value_heads": 2,
        "num_target_layers": 4,
        "pad_token_id": None,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "sliding_window": None,
        "target_layer_ids": [0, 2],
        "tie_word_embeddings": False,
        "transformers_version": "5.24.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": V,
    }


def deepspec_tensors(target: TargetModel) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)

    def rnd(*shape: int) -> torch.Tensor:
        return (0.2 * torch.randn(*shape, generator=g)).to(torch.bfloat16)

    t = {
        f"layers.0.{n}": rnd(*s)
        for n, s in [
            ("self_attn.q_proj.weight", (64, H)),
            ("self_attn.k_proj.weight", (32, H)),
            ("self_attn.v_proj.weight", (32, H)),
            ("self_attn.o_proj.weight", (H, 64)),
            ("self_attn.q_norm.weight", (16,)),
            ("self_attn.k_norm.weight", (16,)),
            ("mlp.gate_proj.weight", (80, H)),
            ("mlp.up_proj.weight", (80, H)),
            ("mlp.down_proj.weight", (H, 80)),
            ("input_layernorm.weight", (H,)),
            ("post_attention_layernorm.weight", (H,)),
        ]
    }
    t |= {
        "norm.weight": rnd(H),
        "fc.weight": rnd(H, 2 * H),
        "hidden_norm.weight": rnd(H),
        "markov_head.markov_w1.weight": rnd(V, R),
        "markov_head.markov_w2.weight": rnd(V, R),
        "confidence_head.proj.weight": rnd(1, H + R),
        "confidence_head.proj.bias": rnd(1),
        "embed_tokens.weight": target.model.embed_tokens.weight.to(torch.bfloat16),
        "lm_head.weight": target.lm_head.weight.to(torch.bfloat16),
    }
    return t


def write_deepspec(path: Path, cfg: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def test_deepspec_layout_checkpoint_loads_and_runs(tmp_path: Path) -> None:
    target = make_target()
    tensors = deepspec_tensors(target)
    d = load_drafter(write_deepspec(tmp_path, deepspec_config(), tensors), target)
    cfg = d.config
    assert (cfg.gamma, cfg.target_layer_ids, cfg.mask_token_id, cfg.head_type) == (4, (0, 2), 96, "markov")
    assert cfg.rope_theta == 10000.0 and cfg.num_hidden_layers == 1 and cfg.torch_dtype == "bfloat16"
    assert torch.equal(d.markov_head.markov_w1.weight, tensors["markov_head.markov_w1.weight"].float())
    k_norm = tensors["layers.0.self_attn.k_norm.weight"].float()
    assert torch.equal(d.layers[0].self_attn.k_norm.weight, k_norm)
    train_logits, conf, serve_logits = run_both_paths(d)
    assert train_logits.shape == (1, 3, 4, V) and conf is not None and torch.isfinite(conf).all()
    assert serve_logits.shape == (3, 4, V) and torch.isfinite(serve_logits).all()
    # Shared modules are the target's own, not copies of the checkpoint's bf16 tensors.
    assert d.shared.lm_head is target.lm_head and d.shared.embed_tokens is target.model.embed_tokens


@pytest.mark.parametrize("case", ["missing", "unexpected", "shape", "other_target", "config"])
def test_bad_checkpoints_fail_loudly(tmp_path: Path, case: str) -> None:
    target = make_target()
    cfg, tensors = deepspec_config(), deepspec_tensors(target)
    if case == "missing":
        del tensors["markov_head.markov_w2.weight"]
    elif case == "unexpected":
        tensors["markov_head.joint_proj.weight"] = torch.zeros(3 * R, 2 * R + H)
    elif case == "shape":
        tensors["fc.weight"] = torch.zeros(H, 3 * H)
    elif case == "other_target":
        tensors["lm_head.weight"] = make_target(seed=9).lm_head.weight.clone()
    else:
        cfg["hidden_size"] = 32
    with pytest.raises(ValueError):
        load_drafter(write_deepspec(tmp_path, cfg, tensors), target)


def test_checkpoint_without_shared_copies_loads(tmp_path: Path) -> None:
    """SGLang-style exports may omit embed_tokens / lm_head; the target's are used anyway."""
    target = make_target()
    d = make_drafter(target)
    save_drafter(d, tmp_path, include_shared=False)
    assert "lm_head.weight" not in load_file(str(tmp_path / "model.safetensors"))
    loaded = load_drafter(tmp_path, target)
    torch.testing.assert_close(run_both_paths(d)[0], run_both_paths(loaded)[0], atol=1e-5, rtol=1e-5)


def test_config_variants_parse_alike() -> None:
    base = DraftConfig.from_hf_dict(deepspec_config())
    assert DraftConfig.from_hf_dict(base.to_hf_dict()) == base
    nested = deepspec_config()
    dspark_keys = ("block_size", "target_layer_ids", "mask_token_id", "markov_rank", "markov_head_type")
    nested["dflash_config"] = {k: nested.pop(k) for k in dspark_keys}
    assert DraftConfig.from_hf_dict(nested) == base
    prefixed = deepspec_config()
    for k, new in [
        ("block_size", "dspark_block_size"),
        ("target_layer_ids", "dspark_target_layer_ids"),
        ("mask_token_id", "dspark_noise_token_id"),
        ("markov_rank", "dspark_markov_rank"),
    ]:
        prefixed[new] = prefixed.pop(k)
    assert DraftConfig.from_hf_dict(prefixed) == base
    with pytest.raises(ValueError, match="architectures"):
        DraftConfig.from_hf_dict(deepspec_config() | {"architectures": ["Qwen3ForCausalLM"]})


def test_transformers_reads_our_config() -> None:
    transformers = pytest.importorskip("transformers")
    d = make_drafter(make_target())
    hf = transformers.Qwen3Config.from_dict(d.config.to_hf_dict())
    assert (hf.hidden_size, hf.num_hidden_layers, hf.head_dim) == (H, 2, 16)
    assert hf.block_size == 4 and hf.target_layer_ids == [1, 2] and hf.markov_head_type == "vanilla"
    theta = getattr(hf, "rope_theta", None) or hf.rope_parameters["rope_theta"]
    assert theta == 10000.0


# --------------------------------------------------------------------------- SGLang's parser

_SGLANG_STUBS = (  # heavy imports of the two files that parse_dspark_draft_config does not use
    "sglang",
    "sglang.srt",
    "sglang.srt.speculative",
    "sglang.srt.speculative.dspark_components",
    "sglang.kernels",
    "sglang.kernels.ops.sampling.renorm",
    "sglang.kernels.ops.speculative.verify_sampling",
    "sglang.srt.layers",
    "sglang.srt.layers.quantization.unquant",
    "sglang.srt.layers.sampler",
    "sglang.srt.managers.schedule_batch",
    "sglang.srt.model_executor.runner_utils.pool",
    "sglang.srt.runtime_context",
    "sglang.srt.speculative.spec_utils",
    "sglang.srt.utils",
    "sglang.srt.arg_groups.overrides",
)


class _Stub(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})


def _load_sglang_parser() -> Any:
    """Load SGLang 0.5.23's dspark_config.py by file path with its heavy imports stubbed;
    sys.modules is restored afterwards."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        pytest.skip("sglang is not installed")
    root = Path(spec.origin).parent
    files = {
        "sglang.srt.speculative.dflash_utils": root / "srt/speculative/dflash_utils.py",
        "sglang.srt.speculative.dspark_components.dspark_config": root
        / "srt/speculative/dspark_components/dspark_config.py",
    }
    if not all(f.is_file() for f in files.values()):
        pytest.skip("this sglang has no DSpark config parser")
    names = (*_SGLANG_STUBS, *files)
    saved = {n: sys.modules.get(n) for n in names}
    try:
        for n in _SGLANG_STUBS:
            sys.modules[n] = _Stub(n)
        module = None
        for name, path in files.items():
            mspec = importlib.util.spec_from_file_location(name, path)
            assert mspec is not None and mspec.loader is not None
            module = importlib.util.module_from_spec(mspec)
            sys.modules[name] = module
            mspec.loader.exec_module(module)
        return module
    except Exception as exc:  # an sglang whose module layout differs: not ours to fight
        pytest.skip(f"cannot load SGLang's DSpark config parser on CPU: {exc!r}")
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_sglang_parses_our_config(tmp_path: Path, head: str) -> None:
    sgl = _load_sglang_parser()
    d = make_drafter(make_target(), head)
    save_drafter(d, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    parsed = sgl.parse_dspark_draft_config(draft_hf_config=raw)
    assert parsed.gamma == d.config.gamma
    assert parsed.target_layer_ids == list(d.config.target_layer_ids)
    assert parsed.mask_token_id == d.config.mask_token_id
    assert parsed.markov_rank == R and parsed.require_markov()
    assert parsed.markov_head_type == d.config.markov_head_type
    assert parsed.num_hidden_layers == 2 and parsed.num_target_layers == 4
