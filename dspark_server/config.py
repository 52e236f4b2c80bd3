"""Frozen configuration dataclasses shared by the CLI, the engine and the server."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from dspark_server.machine import checkpoint_bytes, cpu_flags

SpecMode = Literal["off", "fixed", "threshold", "dspark"]
SPEC_MODES: tuple[str, ...] = get_args(SpecMode)
ATTENTION_IMPLS: tuple[str, ...] = ("auto", "kernel", "torch", "gather")


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling (``rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Qwen3 / Llama decoder, read from a Hugging Face ``config.json``."""

    architecture: Literal["qwen3", "llama"]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def uses_qk_norm(self) -> bool:
        return self.architecture == "qwen3"

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = [a.lower() for a in raw.get("architectures") or []]
        model_type = str(raw.get("model_type", "")).lower()
        if model_type == "qwen3" or any(a.startswith("qwen3") for a in archs):
            arch: Literal["qwen3", "llama"] = "qwen3"
        elif model_type == "llama" or any(a.startswith("llama") for a in archs):
            arch = "llama"
        else:
            raise ValueError(
                f"unsupported model (model_type={model_type!r}, architectures={archs}); "
                "only Qwen3 and Llama decoders are supported"
            )
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        # transformers >= 5 writes "rope_parameters"; older checkpoints "rope_theta" + "rope_scaling".
        rope_params = raw.get("rope_parameters") or {}
        rope_theta = raw.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        scaling = None
        rs = raw.get("rope_scaling") or rope_params
        rope_type = rs.get("rope_type", rs.get("type", "default")) if rs else "default"
        if rope_type != "default":
            if rope_type != "llama3":
                raise ValueError(f"unsupported rope_scaling type {rope_type!r} (only 'llama3')")
            scaling = RopeScaling(
                factor=float(rs["factor"]),
                low_freq_factor=float(rs["low_freq_factor"]),
                high_freq_factor=float(rs["high_freq_factor"]),
                original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
            )
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((int(eos),) if eos is not None else ())
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            rope_scaling=scaling,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model directory {model_dir}")
        return cls.from_hf_dict(json.loads(path.read_text()))


@dataclass(frozen=True)
class SpeculativeConfig:
    mode: SpecMode = "off"
    gamma: int | None = None  # None: the drafter's block size
    threshold: float = 0.5
    profile_path: str | None = None
    calibration_path: str | None = None
    greedy_calibration_path: str | None = None  # STS for temperature-0 requests
    live_sps_refresh: bool = True
    draft_gate: bool = True  # dspark mode: skip drafting at loads where plain steps are faster
    # dspark mode: price a step as (draft + bookkeeping time) + 1/SPS(B), not 1/SPS(B) alone
    price_step_overhead: bool = True
    # every speculative mode: where a request repeats itself, draft the continuation of the
    # repeated text (prompt lookup) instead of the drafter's block (engine/spec/lookup.py)
    prompt_lookup: bool = True
    # dspark mode: correct the calibration file by the server's own verified rounds
    # (planner/online_calibration.py)
    online_calibration: bool = True

    def __post_init__(self) -> None:
        if self.mode not in SPEC_MODES:
            raise ValueError(f"spec mode must be one of {SPEC_MODES}, got {self.mode!r}")
        if self.gamma is not None and not 1 <= self.gamma <= 32:
            raise ValueError(f"gamma must be in 1..32, got {self.gamma}")


def _chosen(value: str, env: str) -> str | None:
    """A dtype setting's explicit choice: ``value`` unless "auto", else ``$env`` unless unset or
    "auto"; None: "auto" stands, the caller decides."""
    if value != "auto":
        return value
    from_env = os.environ.get(env, "").strip()
    return from_env if from_env and from_env != "auto" else None


INT8_DRAFT_FROM_BYTES = 64 << 20  # a drafter checkpoint from which "auto" serves it in int8


@dataclass(frozen=True)
class EngineConfig:
    """Capacity and scheduling limits of the native engine."""

    model_dir: str
    draft_dir: str | None = None
    dtype: str = "float32"
    page_size: int = 16
    num_pages: int | None = None  # None: derived from max_running * max_model_len
    max_model_len: int = 2048
    max_running: int = 64
    max_queued: int = 256
    max_batch_tokens: int = 512  # token budget of one engine step (prefill chunks + decodes)
    prefill_chunk: int = 256
    num_threads: int | None = None
    # Threads for a forward of at least ``wide_step_tokens`` tokens of at most
    # ``wide_step_requests`` requests (a prompt's prefill at one request), whose GEMMs scale with
    # threads; None: ``num_threads`` (``--prefill-threads``). `dspark serve` leaves a core to the
    # HTTP process, which has nothing to stream during such a step, so the step takes it back:
    # served at one request (bench_serving, code, temperature 0) +4 to +9% tokens/s, median TTFT
    # 12.7 -> 10.0 ms in plain decoding. Where other requests stream meanwhile it did not pay:
    # -7 to +5% at 4 requests, -3 and -7% at 64.
    wide_step_threads: int | None = None
    wide_step_tokens: int = 64
    wide_step_requests: int = 1
    # How attention reads the KV pool: "auto" (C++ kernel, else PyTorch), "kernel", "torch",
    # "gather" (the old copy of every history); None: $DSPARK_ATTENTION, else "auto".
    attention_impl: str | None = None
    # The decoder layers' element-wise steps (norms, q/k norm + rotary + KV store, silu * up) as
    # fused C++ kernels; False: PyTorch ops (also what runs where the kernels cannot be built).
    layer_kernels: bool = True
    # The whole float32 target forward as one C++ call (models/fused_forward.py) where it applies;
    # False: the layer-by-layer path above. Needs layer_kernels.
    fused_forward: bool = True
    # The fused forward's GEMM weights: "float32", or "bfloat16" (weight-only bf16 copies, half the
    # bytes a forward reads, fp32 accumulation, on CPUs with AVX512-BF16; else float32 ones).
    # Activations, the KV cache and sampling stay float32; the model's own weights are kept.
    # "auto": $DSPARK_WEIGHT_DTYPE where set, else bfloat16 where the CPU computes it natively
    # (AVX512-BF16 or AMX-BF16) and the fused forward runs, else float32 (``resolved_weight_dtype``).
    weight_dtype: str = "auto"
    # The drafter's fused GEMM weights: "float32", "bfloat16", or "int8" (weight-only int8 with a
    # scale per output column for its calls of a few rows, bf16 for larger ones; AVX512-VNNI):
    # half bf16's bytes, and the drafter's block pass and context writes are bound by them. Its
    # precision moves which tokens it drafts, never the tokens verification emits. "auto":
    # $DSPARK_DRAFT_WEIGHT_DTYPE where set, else int8 for a drafter of INT8_DRAFT_FROM_BYTES or
    # more under bf16 weights on a CPU with AVX512-VNNI, else ``resolved_weight_dtype``
    # (``resolved_draft_weight_dtype``).
    draft_weight_dtype: str = "auto"
    # The target's KV cache: "float32", or "bfloat16" (keys and values rounded as they are stored,
    # attention in float32: half the bytes attention reads, which at many requests over long
    # histories is most of a forward; needs the fused forward). "auto": $DSPARK_KV_CACHE_DTYPE
    # where set, else bfloat16 where the weights are served in bfloat16, else ``dtype``
    # (``resolved_kv_cache_dtype``; the drafter's context cache follows where its fused calls read it).
    kv_cache_dtype: str = "auto"
    # Keep full KV pages of finished (and running) requests and start a prompt after the longest
    # cached prefix it shares with them (engine/prefix_cache.py); False: every prompt prefilled.
    prefix_cache: bool = True
    spec: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def resolved_weight_dtype(self) -> str:
        """``weight_dtype`` with "auto" decided for this machine: "float32" or "bfloat16"."""
        chosen = _chosen(self.weight_dtype, "DSPARK_WEIGHT_DTYPE")
        if chosen is not None:
            return chosen
        native = any(f in cpu_flags().split() for f in ("avx512_bf16", "amx_bf16"))
        return "bfloat16" if native and self.layer_kernels and self.fused_forward else "float32"

    def resolved_draft_weight_dtype(self) -> str:
        """``draft_weight_dtype`` with "auto" decided: "float32", "bfloat16" or "int8". A drafter
        too big for the caches reads its weights from memory at every step, and int8 halves
        those bytes (the K=8 twin, one request: a drafting step 24.0 -> 22.5 ms in-process, its
        drafts kept as often); a small one (the demo's, 19 MB) keeps the target's choice."""
        chosen = _chosen(self.draft_weight_dtype, "DSPARK_DRAFT_WEIGHT_DTYPE")
        if chosen is not None:
            return chosen
        target = self.resolved_weight_dtype()
        vnni = "avx512_vnni" in cpu_flags().split()
        if target == "bfloat16" and vnni and checkpoint_bytes(self.draft_dir) >= INT8_DRAFT_FROM_BYTES:
            return "int8"
        return target

    def resolved_kv_cache_dtype(self) -> str:
        """``kv_cache_dtype`` with "auto" decided: "bfloat16" with bf16 weights, else ``dtype``."""
        chosen = _chosen(self.kv_cache_dtype, "DSPARK_KV_CACHE_DTYPE")
        if chosen is not None:
            return chosen
        return "bfloat16" if self.resolved_weight_dtype() == "bfloat16" else self.dtype

    def serving_dtype(self) -> str:
        """The dtype a profile of this engine's steps is measured in: ``dtype``, with the fused
        forward's weight dtype and the KV cache's where they differ (e.g.
        "float32+bfloat16-weights", "float32+bfloat16-weights+bfloat16-kv")."""
        weights, kv = self.resolved_weight_dtype(), self.resolved_kv_cache_dtype()
        out = self.dtype if weights == self.dtype else f"{self.dtype}+{weights}-weights"
        return out if kv == self.dtype else f"{out}+{kv}-kv"

    def resolved_num_pages(self) -> int:
        if self.num_pages is not None:
            return self.num_pages
        pages_per_request = -(-self.max_model_len // self.page_size) + 1
        return max(pages_per_request, self.max_running * pages_per_request // 2)


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    drain_timeout_s: float = 30.0
    # Prompt characters (message contents, or the completion prompt) checked before tokenizing:
    # over this, 413. None: only the model's own bound (max_model_len x the longest token's
    # characters, a 400 context_length_exceeded), which no longer text can fit under.
    max_prompt_chars: int | None = None
    tokenizer_workers: int = 2  # threads tokenizing long prompts off the event loop
    max_tokenize_queue: int = 32  # long prompts waiting for (or in) a tokenizer thread; then 429
    header_timeout_s: float = 10.0  # from a connection's (or request's) first byte to its last header
    body_timeout_s: float = 30.0  # from the headers to the end of the body (then 408)
    idle_timeout_s: float = 5.0  # keep-alive connections with no request are closed after this
    max_connections: int = 512  # open connections beyond this are answered 503 and closed
    sse_keepalive_s: float = 5.0  # a stream with nothing to send sends an SSE comment this often
    queue_timeout_s: float = 600.0  # no first token within this: the request ends with an error
