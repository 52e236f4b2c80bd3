"""Configuration of a DSpark drafter, read from / written to DeepSpec's ``config.json``.

DeepSpec (``deepspec/modeling/dspark/qwen3/config.py``) writes the drafter's config as a copy of
the target's Qwen3 config with the draft depth and these extra keys: ``num_target_layers``,
``block_size``, ``mask_token_id``, ``target_layer_ids``, ``num_anchors``,
``enable_confidence_head``, ``confidence_head_with_markov`` (only when the confidence head is on),
``markov_rank`` and ``markov_head_type`` (only when ``markov_rank > 0``). SGLang 0.5.23
(``parse_dspark_draft_config``) also accepts these keys nested in ``dflash_config`` /
``dspark_config`` or prefixed ``dspark_*`` on the top level; ``from_hf_dict`` reads all three.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dspark_server.config import ModelConfig, RopeScaling

# DeepSpec's names; "vanilla" is the paper's Markov head.
MARKOV_HEAD_TYPES: tuple[str, ...] = ("vanilla", "gated", "rnn")
HEAD_TYPE_ALIASES: dict[str, str] = {
    "markov": "vanilla",
    "vanilla": "vanilla",
    "gated": "gated",
    "rnn": "rnn",
    "none": "none",
}
# Architectures SGLang 0.5.23 serves as a dense DSpark drafter; DeepSpec writes the first one.
DRAFT_ARCHITECTURES: tuple[str, ...] = ("Qwen3DSparkModel", "DSparkDraftModel", "LingDSparkModel")


@dataclass(frozen=True)
class DraftConfig:
    """A Qwen3-style drafter. hidden_size and vocab_size must equal the target's (shared embedding
    and LM head); ``target_layer_ids`` index decoder layers of the target, 0-based, layer i meaning
    the OUTPUT of decoder layer i (== Hugging Face ``hidden_states[i + 1]``; -1 = embeddings)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int  # draft layers
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    mask_token_id: int
    gamma: int = 7  # "block_size": anchor + (gamma - 1) mask tokens, gamma drafts per round
    markov_rank: int = 256  # 0: no sequential head (parallel-only, DFlash style)
    markov_head_type: str = "vanilla"  # vanilla | gated | rnn (ignored when markov_rank == 0)
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    num_anchors: int = 512  # training only: anchors sampled per sequence
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    architecture: str = "Qwen3DSparkModel"
    torch_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.gamma < 1:
            raise ValueError(f"block_size (gamma) must be >= 1, got {self.gamma}")
        if self.markov_rank < 0:
            raise ValueError(f"markov_rank must be >= 0, got {self.markov_rank}")
        if self.markov_rank > 0 and self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(
                f"markov_head_type must be one of {MARKOV_HEAD_TYPES}, got {self.markov_head_type!r}"
            )
        if self.enable_confidence_head and self.confidence_head_with_markov and self.markov_rank == 0:
            raise ValueError("confidence_head_with_markov needs a Markov head (markov_rank > 0)")
        ids = self.target_layer_ids
        if not ids or any(b <= a for a, b in zip(ids[:-1], ids[1:], strict=True)):
            raise ValueError(f"target_layer_ids must be non-empty and strictly increasing, got {ids}")
        if ids[0] < -1 or ids[-1] >= self.num_target_layers:
            raise ValueError(
                f"target_layer_ids {ids} out of range for {self.num_target_layers} "
                "target layers (-1 denotes the embedding output)"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} outside vocab {self.vocab_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @property
    def head_type(self) -> str:
        """markov (DeepSpec "vanilla") | gated | rnn | none."""
        if self.markov_rank == 0:
            return "none"
        return "markov" if self.markov_head_type == "vanilla" else self.markov_head_type

    @property
    def confidence_input_dim(self) -> int:
        return self.hidden_size + (self.markov_rank if self.confidence_head_with_markov else 0)

    @property
    def context_dim(self) -> int:
        """Width of the concatenated target features the drafter's ``fc`` reads."""
        return len(self.target_layer_ids) * self.hidden_size

    # ---------------------------------------------------------------- construction

    @classmethod
    def from_target(
        cls,
        target: ModelConfig,
        *,
        mask_token_id: int,
        num_layers: int = 1,
        target_layer_ids: tuple[int, ...] | None = None,
        num_features: int = 5,
        gamma: int = 7,
        head_type: str = "markov",
        markov_rank: int = 256,
        confidence: bool = True,
        intermediate_size: int | None = None,
        num_anchors: int = 512,
        torch_dtype: str = "float32",
    ) -> DraftConfig:
        """A new drafter for ``target`` (DeepSpec: a copy of the target config, draft depth set)."""
        head = HEAD_TYPE_ALIASES.get(head_type.lower())
        if head is None:
            raise ValueError(f"head_type must be one of {sorted(HEAD_TYPE_ALIASES)}, got {head_type!r}")
        rank = 0 if head == "none" else markov_rank
        ids = target_layer_ids or default_target_layer_ids(target.num_hidden_layers, num_features)
        return cls(
            vocab_size=target.vocab_size,
            hidden_size=target.hidden_size,
            intermediate_size=intermediate_size or target.intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=target.num_attention_heads,
            num_key_value_heads=target.num_key_value_heads,
            head_dim=target.head_dim,
            target_layer_ids=tuple(ids),
            num_target_layers=target.num_hidden_layers,
            mask_token_id=mask_token_id,
            gamma=gamma,
            markov_rank=rank,
            markov_head_type="vanilla" if head == "none" else head,
            enable_confidence_head=confidence,
            confidence_head_with_markov=confidence and rank > 0,
            num_anchors=num_anchors,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            rope_scaling=target.rope_scaling,
            max_position_embeddings=target.max_position_embeddings,
            attention_bias=target.attention_bias,
            torch_dtype=torch_dtype,
        )

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> DraftConfig:
        nested = {**(raw.get("dflash_config") or {}), **(raw.get("dspark_config") or {})}

        def get(key: str, default: Any = None) -> Any:
            prefixed = raw.get(f"dspark_{key}")
            if prefixed is not None:
                return prefixed
            return nested.get(key, raw.get(key, default))

        archs = raw.get("architectures") or [DRAFT_ARCHITECTURES[0]]
        arch = str(archs[0])
        if arch not in DRAFT_ARCHITECTURES:
            raise ValueError(
                f"not a dense DSpark drafter: architectures={archs} (expected one of {DRAFT_ARCHITECTURES})"
            )
        block = get("block_size")
        ids = get("target_layer_ids")
        mask_id = raw.get("dspark_noise_token_id")  # SGLang: the prefixed form wins
        mask_id = get("mask_token_id") if mask_id is None else mask_id
        if block is None or ids is None or mask_id is None:
            raise ValueError("DSpark config.json needs block_size, target_layer_ids and mask_token_id")
        rank = int(get("markov_rank", 0) or 0)
        head = get("markov_head_type")
        if rank > 0 and head is None:
            raise ValueError("markov_head_type is required when markov_rank > 0")
        # SGLang treats a missing enable_confidence_head as enabled; the default of
        # confidence_head_with_markov follows SGLang too (on iff there is a Markov head).
        conf = bool(get("enable_confidence_head", True))
        with_markov = bool(get("confidence_head_with_markov", rank > 0)) if conf else False
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        rope = ModelConfig.from_hf_dict({**raw, "model_type": "qwen3", "architectures": []})
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            target_layer_ids=tuple(int(i) for i in ids),
            num_target_layers=int(get("num_target_layers", max(int(i) for i in ids) + 1)),
            mask_token_id=int(mask_id),
            gamma=int(block),
            markov_rank=rank,
            markov_head_type=str(head or "vanilla").lower(),
            enable_confidence_head=conf,
            confidence_head_with_markov=with_markov,
            num_anchors=int(get("num_anchors", 512)),
            rms_norm_eps=rope.rms_norm_eps,
            rope_theta=rope.rope_theta,
            rope_scaling=rope.rope_scaling,
            max_position_embeddings=rope.max_position_embeddings,
            attention_bias=bool(raw.get("attention_bias", False)),
            architecture=arch,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """DeepSpec's layout: a Qwen3 config (``model_type: qwen3``) plus the DSpark keys."""
        out: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": _rope_scaling_dict(self.rope_scaling),
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": self.num_hidden_layers,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "torch_dtype": self.torch_dtype,
            "num_target_layers": self.num_target_layers,
            "block_size": self.gamma,
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
            "num_anchors": self.num_anchors,
            "enable_confidence_head": self.enable_confidence_head,
            "markov_rank": self.markov_rank,
        }
        if self.enable_confidence_head:
            out["confidence_head_with_markov"] = self.confidence_head_with_markov
        if self.markov_rank > 0:
            out["markov_head_type"] = self.markov_head_type
        return out


def default_target_layer_ids(num_target_layers: int, num_features: int = 5) -> tuple[int, ...]:
    """``num_features`` layers spread evenly from layer 1 to L-3 (DeepSpec's Qwen3-8B choice
    [1, 9, 17, 25, 33] for L = 36; the same rule as SGLang's ``build_target_layer_ids``)."""
    if num_features == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    if end < start:
        raise ValueError(f"need at least 4 target layers to spread features, got {num_target_layers}")
    span = end - start
    ids = sorted({int(round(start + i * span / (num_features - 1))) for i in range(num_features)})
    return tuple(ids)


def _rope_scaling_dict(s: RopeScaling | None) -> dict[str, Any] | None:
    if s is None:
        return None
    return {
        "rope_type": "llama3",
        "factor": s.factor,
        "low_freq_factor": s.low_freq_factor,
        "high_freq_factor": s.high_freq_factor,
        "original_max_position_embeddings": s.original_max_position_embeddings,
    }
