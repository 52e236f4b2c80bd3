"""Tiny randomly initialised model directories for tests and benchmarks (no downloads)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from dspark_server.config import ModelConfig
from dspark_server.models.loader import save_target
from dspark_server.models.target import TargetModel

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_TRAIN_TEXT = (
    "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n"
    "        self.x = x\n        self.y = y\n\nThe quick brown fox jumps over the lazy dog. "
    "Speculative decoding drafts several tokens and verifies them in one pass. "
    "héllo wörld 你好 🙂\n"
)


def build_tokenizer(out_dir: Path, vocab_size: int = 320) -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_TRAIN_TEXT] * 4, trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": CHAT_TEMPLATE,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "bos_token": None,
                "tokenizer_class": "PreTrainedTokenizerFast",
            },
            indent=2,
        )
    )
    return tok


def tiny_hf_config(
    vocab_size: int,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    eos: list[int] | None = None,
    max_positions: int = 4096,
) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": max_positions,
        "tie_word_embeddings": True,
        "eos_token_id": eos or [],
        "torch_dtype": "float32",
    }


def build_tiny_model(
    out_dir: str | Path,
    seed: int = 0,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    init_std: float = 0.2,
    with_eos: bool = True,
    vocab_size: int | None = None,
) -> Path:
    """A random Qwen3 target with a real byte-level BPE tokenizer and chat template.

    ``init_std`` is large so that logits are far from ties (greedy equality tests stay exact).
    ``with_eos=False`` lists no EOS id so that generations run to ``max_tokens``.
    ``vocab_size`` shrinks the model's vocabulary below the tokenizer's (exact-distribution tests).
    """
    out = Path(out_dir)
    tok = build_tokenizer(out)
    vocab = vocab_size or tok.get_vocab_size()
    specials = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    eos = [i for i in specials if i is not None] if with_eos else []
    hf = tiny_hf_config(vocab, hidden, layers, heads, kv_heads, intermediate, eos)
    torch.manual_seed(seed)
    model = TargetModel(ModelConfig.from_hf_dict(hf))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                continue
            p.normal_(0.0, init_std if "embed" in name else init_std / (p.shape[-1] ** 0.5) * 4)
    save_target(model, out, hf)
    if not with_eos:
        tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
        tok_cfg["eos_token"] = None
        (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    return out


def build_tiny_drafter(
    target_dir: str | Path,
    out_dir: str | Path,
    seed: int = 0,
    gamma: int = 4,
    head_type: str = "markov",
    markov_rank: int = 16,
    layers: int = 1,
    init_std: float = 0.2,
) -> Path:
    """A random DSpark drafter for a target made by ``build_tiny_model`` (random drafts: many
    rejections, which is what losslessness tests want)."""
    from dspark_server.models.drafter import DSparkDrafter
    from dspark_server.models.drafter_checkpoint import save_drafter
    from dspark_server.models.drafter_config import DraftConfig
    from dspark_server.models.loader import load_target

    target = load_target(target_dir)
    mask_id = HFTokenizer.from_file(str(Path(target_dir) / "tokenizer.json")).token_to_id("<|mask|>")
    if mask_id is None:
        raise ValueError(f"{target_dir}: the tokenizer has no <|mask|> token")
    cfg = DraftConfig.from_target(
        target.config,
        mask_token_id=mask_id,
        num_layers=layers,
        gamma=gamma,
        head_type=head_type,
        markov_rank=markov_rank,
        target_layer_ids=tuple(range(min(2, target.config.num_hidden_layers))),
    )
    torch.manual_seed(seed)
    drafter = DSparkDrafter(cfg, target)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, init_std / (p.shape[-1] ** 0.5) * 4)
    return save_drafter(drafter, out_dir)


def write_flat_sps_profile(path: Path, probes: tuple[int, ...] = (1, 8, 64, 512)) -> Path:
    """An SPS table where verifying more tokens costs nothing (50 steps/s at every probe): a
    speculative engine served with it needs no start-up profiling and verifies drafts whatever the
    machine's timings."""
    from dspark_server.planner import SpsCostTable, save_sps_table

    save_sps_table(SpsCostTable(probes, tuple(50.0 for _ in probes), probes[-1]), path)
    return path
