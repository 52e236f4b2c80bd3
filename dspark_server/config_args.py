"""Engine settings as command-line flags: each flag's default is read from the dataclasses in
``config.py`` (never restated here), and ``engine_config_from_args`` turns parsed flags back into
an ``EngineConfig``. Used by ``dspark`` and by the repository's tools/ scripts."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, fields, replace
from typing import Any, Literal, cast

from dspark_server.config import ATTENTION_IMPLS, SPEC_MODES, EngineConfig, SpecMode, SpeculativeConfig

Speculation = Literal["all", "gamma", "none"]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows ``(default: X)`` after every flag whose help does not already say its default; flags
    defaulting to nothing (None, off switches, empty lists) explain themselves in their help."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, [], argparse.SUPPRESS) or "default" in text:
            return text
        return super()._get_help_string(action) or text


def field_default(cls: type, name: str) -> Any:
    """The default of dataclass field ``name`` (its factory's value for default_factory fields)."""
    for f in fields(cls):
        if f.name == name:
            if f.default is not MISSING:
                return f.default
            if f.default_factory is not MISSING:
                return f.default_factory()
            raise ValueError(f"{cls.__name__}.{name} has no default")
    raise KeyError(f"{cls.__name__} has no field {name}")


@dataclass(frozen=True)
class _Flag:
    flag: str
    owner: type  # EngineConfig or SpeculativeConfig
    field: str
    type: type
    help: str


_CAPACITY = (
    _Flag("--max-model-len", EngineConfig, "max_model_len", int, "longest prompt + completion, in tokens"),
    _Flag("--max-running", EngineConfig, "max_running", int, "requests decoded together"),
    _Flag(
        "--max-queued", EngineConfig, "max_queued", int, "requests waiting beyond --max-running (then 429)"
    ),
    _Flag(
        "--max-batch-tokens",
        EngineConfig,
        "max_batch_tokens",
        int,
        "token budget of one engine step (prefill chunks + decodes + drafts verified)",
    ),
    _Flag(
        "--prefill-chunk", EngineConfig, "prefill_chunk", int, "longest prefill piece per request and step"
    ),
    _Flag("--page-size", EngineConfig, "page_size", int, "KV cache slots per page"),
    _Flag(
        "--num-pages",
        EngineConfig,
        "num_pages",
        int,
        "KV cache pages (default: enough for half of --max-running at --max-model-len)",
    ),
)
_SPEC = (
    _Flag("--threshold", SpeculativeConfig, "threshold", float, "threshold mode: survival cut-off"),
    _Flag(
        "--profile",
        SpeculativeConfig,
        "profile_path",
        str,
        "SPS cost table JSON (default: profile the engine at start-up, at most 25 s)",
    ),
    _Flag(
        "--calibration",
        SpeculativeConfig,
        "calibration_path",
        str,
        "STS calibration JSON for sampled requests (default: the drafter's sts_calibration.json)",
    ),
    _Flag(
        "--greedy-calibration",
        SpeculativeConfig,
        "greedy_calibration_path",
        str,
        "STS calibration JSON for temperature-0 requests (default: the drafter's "
        "sts_calibration_greedy.json, else --calibration)",
    ),
)


def add_engine_args(
    parser: argparse.ArgumentParser, speculation: Speculation = "all", serving: bool = True
) -> None:
    """The native engine's flags. ``speculation``: ``all`` the speculation flags, ``gamma`` only
    --draft and --gamma (commands that force their own mode: profile, calibrate, eval), ``none``
    neither. ``serving=False`` leaves out --max-queued (admission control of a server)."""
    g = parser.add_argument_group("model")
    g.add_argument("--model", default=None, help="target model directory (default: bundled demo target)")
    if speculation != "none":
        g.add_argument("--draft", default=None, help="DSpark drafter directory (default: bundled demo)")
    g.add_argument(
        "--dtype",
        default=None,
        help=f"weights dtype (default: {field_default(EngineConfig, 'dtype')} native, auto sglang)",
    )
    g.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's; `dspark serve` with the engine process: CPUs - 1)",
    )
    g.add_argument(
        "--prefill-threads",
        type=int,
        default=None,
        help="threads for a forward of one request's prompt (default: --threads; `dspark serve` "
        "with the engine process: all CPUs, taking back the HTTP process's core while it has "
        "little to stream)",
    )
    g.add_argument(
        "--attention-impl",
        choices=ATTENTION_IMPLS,
        default=None,
        help="how attention reads the KV cache: kernel (C++, in place), torch (blockwise PyTorch), "
        "gather (copy every history, then SDPA), auto (the kernel where it runs, else gather) "
        "(default: $DSPARK_ATTENTION, else auto)",
    )
    g.add_argument(
        "--no-layer-kernels",
        action="store_true",
        help="run the decoder's element-wise steps as PyTorch ops instead of the fused C++ kernels",
    )
    g.add_argument(
        "--no-fused-forward",
        action="store_true",
        help="run the float32 target forward layer by layer from Python instead of as one C++ call",
    )
    g.add_argument(
        "--weight-dtype",
        choices=("auto", "float32", "bfloat16"),
        default=None,
        help="the fused forward's GEMM weights: bfloat16 serves weight-only bf16 copies (half the "
        "bytes read, fp32 accumulation; needs AVX512-BF16); auto: $DSPARK_WEIGHT_DTYPE, else "
        "bfloat16 where the CPU has native bf16, else float32; float32 for bit-exact fp32 "
        f"(default: {field_default(EngineConfig, 'weight_dtype')})",
    )
    g.add_argument(
        "--draft-weight-dtype",
        choices=("auto", "float32", "bfloat16", "int8"),
        default=None,
        help="the drafter's GEMM weights: int8 serves weight-only int8 copies for its few-row calls "
        "(half bf16's bytes; needs AVX512-VNNI), which moves the tokens it drafts but never the "
        "tokens verification emits; auto: $DSPARK_DRAFT_WEIGHT_DTYPE, else --weight-dtype's choice "
        f"(default: {field_default(EngineConfig, 'draft_weight_dtype')})",
    )
    g.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "float32", "bfloat16"),
        default=None,
        help="the target's KV cache: bfloat16 halves the bytes attention reads (keys and values "
        "rounded as they are stored, attention in float32; needs the fused forward); auto: "
        "$DSPARK_KV_CACHE_DTYPE, else bfloat16 where the weights are served in bfloat16, else "
        f"--dtype (default: {field_default(EngineConfig, 'kv_cache_dtype')})",
    )
    if speculation != "none":
        s = parser.add_argument_group("speculation")
        if speculation == "all":
            s.add_argument(
                "--spec-mode",
                choices=SPEC_MODES,
                default=None,
                help="off | fixed | threshold | dspark (default: dspark with a drafter, off without)",
            )
        s.add_argument("--gamma", type=int, default=None, help="draft block size (default: the drafter's)")
        if speculation == "all":
            for f in _SPEC:
                s.add_argument(f.flag, type=f.type, default=field_default(f.owner, f.field), help=f.help)
            s.add_argument(
                "--no-draft-gate",
                action="store_true",
                help="dspark mode: always draft, even at loads where plain steps measure faster",
            )
            s.add_argument(
                "--no-prompt-lookup",
                action="store_true",
                help="draft with the drafter only, also where a request repeats itself (by default "
                "the continuation of the repeated text is drafted there: prompt lookup)",
            )
            s.add_argument(
                "--no-online-calibration",
                action="store_true",
                help="dspark mode: plan on the calibration file as it is (by default it is "
                "corrected by the acceptance of the rounds this server verifies)",
            )
            s.add_argument(
                "--sps-only-cost",
                action="store_true",
                help="dspark mode: price a step by SPS(B) alone (the paper's cost model), leaving "
                "out the measured draft and bookkeeping time",
            )
    c = parser.add_argument_group("capacity")
    for f in _CAPACITY:
        if f.flag == "--max-queued" and not serving:
            continue
        c.add_argument(f.flag, type=f.type, default=field_default(f.owner, f.field), help=f.help)
    c.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="prefill every prompt in full (by default full KV pages outlive their request and a "
        "prompt starts after the longest prefix it shares with cached ones)",
    )


def _arg(ns: argparse.Namespace, f: _Flag) -> Any:
    return getattr(ns, f.field if f.owner is EngineConfig else f.flag[2:].replace("-", "_"), None)


def engine_config_from_args(
    ns: argparse.Namespace, spec_mode: str | None = None, variant: str | None = None
) -> EngineConfig:
    """An ``EngineConfig`` from flags ``add_engine_args`` added (absent flags keep the dataclass
    defaults). ``spec_mode`` overrides --spec-mode; ``variant`` picks a bundled demo drafter.
    Raises ValueError when a speculative mode has no drafter."""
    from dspark_server.assets import default_draft, default_target

    model = getattr(ns, "model", None)
    draft = getattr(ns, "draft", None) or (default_draft(variant) if model is None else None)
    mode = spec_mode or getattr(ns, "spec_mode", None) or ("dspark" if draft else "off")
    if mode not in SPEC_MODES:
        raise ValueError(f"spec mode must be one of {SPEC_MODES}, got {mode!r}")
    if mode != "off" and not draft:
        raise ValueError(f"--spec-mode {mode} needs a drafter (--draft DIR)")
    spec = replace(
        SpeculativeConfig(mode=cast(SpecMode, mode), gamma=getattr(ns, "gamma", None)),
        draft_gate=not getattr(ns, "no_draft_gate", False),
        price_step_overhead=not getattr(ns, "sps_only_cost", False),
        prompt_lookup=not getattr(ns, "no_prompt_lookup", False),
        online_calibration=not getattr(ns, "no_online_calibration", False),
        **{f.field: v for f in _SPEC if (v := _arg(ns, f)) is not None},
    )
    capacity = {f.field: v for f in _CAPACITY if (v := _arg(ns, f)) is not None}
    return EngineConfig(
        model_dir=model or default_target(),
        draft_dir=draft if mode != "off" else None,
        dtype=getattr(ns, "dtype", None) or field_default(EngineConfig, "dtype"),
        num_threads=getattr(ns, "threads", None),
        wide_step_threads=getattr(ns, "prefill_threads", None),
        attention_impl=getattr(ns, "attention_impl", None),
        layer_kernels=not getattr(ns, "no_layer_kernels", False),
        fused_forward=not getattr(ns, "no_fused_forward", False),
        prefix_cache=not getattr(ns, "no_prefix_cache", False),
        weight_dtype=getattr(ns, "weight_dtype", None) or field_default(EngineConfig, "weight_dtype"),
        kv_cache_dtype=getattr(ns, "kv_cache_dtype", None) or field_default(EngineConfig, "kv_cache_dtype"),
        draft_weight_dtype=getattr(ns, "draft_weight_dtype", None)
        or field_default(EngineConfig, "draft_weight_dtype"),
        spec=spec,
        **capacity,
    )
