"""Pure mappings between dspark-server's settings and SGLang 0.5.23's (no SGLang import here).

* :class:`SGLangConfig` -> ``sglang.Engine(**kwargs)`` keyword arguments (:func:`build_server_kwargs`,
  names are fields of SGLang's ``ServerArgs``) and the environment SGLang reads at start-up
  (:func:`build_env`).
* our :class:`SamplingParams` -> SGLang's per-request ``sampling_params`` dict
  (:func:`sampling_params_to_sglang`).
* SGLang's per-request ``meta_info`` -> our speculative counters (:func:`spec_counts_from_meta_info`)
  and finish reason (:func:`finish_from_meta_info`).

Facts these rest on (SGLang 0.5.23 wheel): ``srt/arg_groups/fields/{spec,model,parallel,schedule,
serving,exec_,device,observability}.py`` declare the ``ServerArgs`` fields; DSpark's verification
planner only runs with ``SGLANG_RAGGED_VERIFY_MODE=compact`` (``srt/speculative/ragged_verify.py``;
the default ``static`` verifies every draft); ``TokenizerManager._calculate_spec_decoding_metrics``
fills ``spec_verify_ct``, ``spec_num_correct_drafts``, ``spec_num_proposed_drafts``,
``spec_correct_drafts_histogram`` and (with a ragged layout) ``spec_cap_length`` /
``spec_cap_lens_histogram`` in the *final* ``meta_info`` of a request only.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dspark_server.engine.request import SamplingParams, SpecStats
from dspark_server.engine.stats import EngineStats

SGLANG_VERSION = "0.5.23"
SGLANG_SPEC_MODES: tuple[str, ...] = ("off", "fixed", "dspark")
RAGGED_VERIFY_MODES: tuple[str, ...] = ("static", "compact", "cap-accept")
RAGGED_VERIFY_ENV = "SGLANG_RAGGED_VERIFY_MODE"
# Our spec mode -> SGLang's ragged-verify mode. "dspark": the confidence/SPS-scheduled planner
# (SGLang's production variant, see docs/sglang.md); "fixed": verify all gamma drafts.
_VERIFY_MODE_OF = {"dspark": "compact", "fixed": "static"}
# Kwargs this module sets itself; extra_server_args may not override them silently.
_OWNED_KWARGS = frozenset(
    {
        "model_path",
        "tokenizer_path",
        "skip_tokenizer_init",
        "tp_size",
        "dtype",
        "context_length",
        "max_running_requests",
        "mem_fraction_static",
        "attention_backend",
        "random_seed",
        "enable_deterministic_inference",
        "enable_metrics",
        "disable_radix_cache",
        "speculative_algorithm",
        "speculative_draft_model_path",
        "speculative_dspark_block_size",
        "speculative_dspark_sps_table_path",
        "speculative_dspark_confidence_sts_path",
    }
)


@dataclass(frozen=True)
class SGLangConfig:
    """Everything `dspark serve --backend sglang` / `dspark profile --backend sglang` pass to SGLang.

    ``spec_mode``: ``dspark`` (SGLang's DSpark planner: ragged verification scheduled from the
    drafter's confidences and the SPS table), ``fixed`` (verify all gamma drafts) or ``off`` (no
    drafter: plain target decoding). ``None`` limits leave SGLang's own defaults (e.g. 48 running
    requests under speculation). ``extra_server_args``: further ``ServerArgs`` fields as
    ``(name, value)`` pairs (``--sglang-arg name=value``).
    """

    model_path: str
    draft_path: str | None = None
    spec_mode: str = "dspark"
    gamma: int | None = None  # None: the drafter's block_size
    sps_table_path: str | None = None
    sts_path: str | None = None
    tp_size: int = 1
    dtype: str = "auto"
    max_model_len: int | None = None
    max_running: int | None = None
    max_queued: int = 256
    mem_fraction_static: float | None = None
    attention_backend: str | None = None
    random_seed: int | None = None
    deterministic: bool = False  # per-request seeds only take effect in this mode
    enable_metrics: bool = False  # SGLang's own sglang:* Prometheus metrics
    prefix_cache: bool = True  # SGLang's radix cache (--no-prefix-cache: disable_radix_cache)
    log_level: str = "error"
    verify_mode: str | None = None  # override SGLANG_RAGGED_VERIFY_MODE (default from spec_mode)
    extra_server_args: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.spec_mode not in SGLANG_SPEC_MODES:
            hint = (
                " (SGLang has no static-threshold planner; use dspark or fixed)"
                if self.spec_mode == "threshold"
                else ""
            )
            raise ValueError(
                f"the SGLang backend supports --spec-mode {', '.join(SGLANG_SPEC_MODES)}; "
                f"got {self.spec_mode!r}{hint}"
            )
        if self.spec_mode != "off" and not self.draft_path:
            raise ValueError(f"--spec-mode {self.spec_mode} needs a drafter (--draft DIR)")
        if self.gamma is not None and not 1 <= self.gamma <= 32:
            raise ValueError(f"gamma must be in 1..32, got {self.gamma}")
        if self.tp_size < 1:
            raise ValueError(f"tp size must be >= 1, got {self.tp_size}")
        if self.max_running is not None and self.max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {self.max_running}")
        if self.max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {self.max_queued}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if self.verify_mode is not None and self.verify_mode not in RAGGED_VERIFY_MODES:
            raise ValueError(f"verify_mode must be one of {RAGGED_VERIFY_MODES}, got {self.verify_mode!r}")
        for name, _ in self.extra_server_args:
            if name in _OWNED_KWARGS:
                raise ValueError(
                    f"--sglang-arg {name}=... would override a setting dspark passes "
                    "itself; use the dspark flag instead (see docs/sglang.md)"
                )
        object.__setattr__(self, "extra_server_args", tuple(tuple(kv) for kv in self.extra_server_args))

    @property
    def speculative(self) -> bool:
        return self.spec_mode != "off"

    @property
    def ragged_verify_mode(self) -> str | None:
        """SGLANG_RAGGED_VERIFY_MODE for this configuration (None without speculation)."""
        if not self.speculative:
            return None
        return self.verify_mode or _VERIFY_MODE_OF[self.spec_mode]


def build_server_kwargs(cfg: SGLangConfig, **overrides: Any) -> dict[str, Any]:
    """``sglang.Engine(**kwargs)`` / ``ServerArgs(**kwargs)`` for ``cfg``.

    We tokenize prompts and detokenize outputs ourselves (same text as the native engine, stop
    strings applied by us), so SGLang runs with ``skip_tokenizer_init``. ``overrides`` (e.g. the
    profiler's port) are applied last.
    """
    kw: dict[str, Any] = {
        "model_path": cfg.model_path,
        "skip_tokenizer_init": True,
        "tp_size": cfg.tp_size,
        "dtype": cfg.dtype,
        "log_level": cfg.log_level,
    }
    optional = {
        "context_length": cfg.max_model_len,
        "max_running_requests": cfg.max_running,
        "mem_fraction_static": cfg.mem_fraction_static,
        "attention_backend": cfg.attention_backend,
        "random_seed": cfg.random_seed,
    }
    kw.update({k: v for k, v in optional.items() if v is not None})
    if cfg.deterministic:
        kw["enable_deterministic_inference"] = True
    if cfg.enable_metrics:
        kw["enable_metrics"] = True
    if not cfg.prefix_cache:
        kw["disable_radix_cache"] = True
    if cfg.speculative:
        kw["speculative_algorithm"] = "DSPARK"
        kw["speculative_draft_model_path"] = cfg.draft_path
        if cfg.gamma is not None:
            kw["speculative_dspark_block_size"] = cfg.gamma
        if cfg.ragged_verify_mode != "static":  # static verification reads neither file
            if cfg.sps_table_path:
                kw["speculative_dspark_sps_table_path"] = cfg.sps_table_path
            if cfg.sts_path:
                kw["speculative_dspark_confidence_sts_path"] = cfg.sts_path
    kw.update(dict(cfg.extra_server_args))
    kw.update(overrides)
    return kw


def build_env(cfg: SGLangConfig) -> dict[str, str]:
    """Environment variables SGLang's scheduler processes must see (set before the Engine)."""
    mode = cfg.ragged_verify_mode
    return {RAGGED_VERIFY_ENV: mode} if mode is not None else {}


def parse_extra_server_args(items: Iterable[str]) -> tuple[tuple[str, Any], ...]:
    """``--sglang-arg name=value`` items -> ``(name, value)``; values are JSON when they parse
    (numbers, true/false, null, lists), else strings. Dashes in names become underscores."""
    out: list[tuple[str, Any]] = []
    for item in items:
        name, sep, raw = item.partition("=")
        name = name.strip().lstrip("-").replace("-", "_")
        if not sep or not name.isidentifier():
            raise ValueError(f"--sglang-arg expects NAME=VALUE (a ServerArgs field), got {item!r}")
        try:
            value: Any = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        out.append((name, value))
    return tuple(out)


# ---- per-request sampling ----------------------------------------------------------------------


def sampling_params_to_sglang(
    params: SamplingParams, eos_token_ids: Iterable[int] = (), *, include_stop_strings: bool = False
) -> dict[str, Any]:
    """Our sampling settings as SGLang's ``sampling_params`` dict.

    ``top_k`` 0 (ours: disabled) becomes SGLang's -1; temperature 0 stays 0 (SGLang turns it into
    top_k = 1, i.e. greedy). The model's EOS ids join ``stop_token_ids`` unless ``ignore_eos`` so
    SGLang stops exactly where our output processor does. Stop *strings* are left out by default:
    with ``skip_tokenizer_init`` SGLang cannot match text, so the backend applies them itself and
    aborts the request (``include_stop_strings=True`` is for a tokenizer-owning SGLang). ``seed``
    becomes ``sampling_seed``, which SGLang honours only with deterministic inference on.
    """
    out: dict[str, Any] = {
        "max_new_tokens": int(params.max_tokens),
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": int(params.top_k) if params.top_k > 0 else -1,
        "ignore_eos": bool(params.ignore_eos),
    }
    stop_ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        stop_ids.update(int(t) for t in eos_token_ids)
    if stop_ids:
        out["stop_token_ids"] = sorted(stop_ids)
    if params.seed is not None:
        out["sampling_seed"] = int(params.seed)
    if include_stop_strings and params.stop:
        out["stop"] = list(params.stop)
    return out


# ---- per-request results -----------------------------------------------------------------------


def finish_from_meta_info(meta: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """(our finish reason, error message) from ``meta_info["finish_reason"]``.

    SGLang writes ``{"type": "stop" | "length" | "abort", ...}`` (or None while running). An
    abort we did not ask for (out of memory, a rejected request, a crashed scheduler) is an error.
    """
    fr = meta.get("finish_reason")
    if fr is None:
        return None, None
    kind = fr.get("type") if isinstance(fr, Mapping) else str(fr)
    if kind in ("stop", "length"):
        return kind, None
    if kind == "abort":
        message = fr.get("message") if isinstance(fr, Mapping) else None
        return "abort", f"SGLang aborted the request: {message or 'aborted'}"
    return "stop", None


@dataclass(frozen=True)
class SpecCounts:
    """One finished request's speculative counters, in our definitions (see docs/sglang.md).

    ``accepted_per_position[j]``: rounds with at least j+1 accepted drafts;
    ``verified_per_position[j]``: rounds that verified at least j+1 drafts;
    ``round_lengths``: emitted tokens per round (accepted + 1) -> number of rounds.
    """

    rounds: int = 0
    draft_tokens: int = 0
    verified_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()
    verified_per_position: tuple[int, ...] = ()
    round_lengths: tuple[tuple[int, int], ...] = field(default=())

    def to_spec_stats(self) -> SpecStats:
        return SpecStats(
            rounds=self.rounds,
            draft_tokens=self.draft_tokens,
            verified_tokens=self.verified_tokens,
            accepted_tokens=self.accepted_tokens,
            emitted_tokens=self.emitted_tokens,
        )

    def add_to(self, stats: EngineStats) -> None:
        """Fold into the server-wide counters (and the acceptance-length histogram)."""
        if not self.rounds:
            return
        stats.spec_rounds += self.rounds
        stats.spec_draft_tokens += self.draft_tokens
        stats.spec_verified_tokens += self.verified_tokens
        stats.spec_accepted_tokens += self.accepted_tokens
        stats.spec_emitted_tokens += self.emitted_tokens
        _add_into(stats.accepted_per_position, self.accepted_per_position)
        _add_into(stats.verified_per_position, self.verified_per_position)
        n = max(len(stats.accepted_per_position), len(stats.verified_per_position))
        for lst in (stats.accepted_per_position, stats.verified_per_position):
            lst.extend([0] * (n - len(lst)))
        for length, count in self.round_lengths:
            for _ in range(count):
                stats.observe("acceptance_length", length)


def _add_into(target: list[int], values: Sequence[int]) -> None:
    if len(values) > len(target):
        target.extend([0] * (len(values) - len(target)))
    for i, v in enumerate(values):
        target[i] += v


def _at_least(hist: Sequence[int], offset: int, size: int) -> tuple[int, ...]:
    """out[j] = sum(hist[k] for k >= j + offset), j < size."""
    tail = [0] * (len(hist) + 1)
    for k in range(len(hist) - 1, -1, -1):
        tail[k] = tail[k + 1] + int(hist[k])
    return tuple(tail[j + offset] if j + offset < len(tail) else 0 for j in range(size))


def spec_counts_from_meta_info(meta: Mapping[str, Any], gamma: int, completion_tokens: int) -> SpecCounts:
    """Our counters from a finished request's ``meta_info``.

    * rounds = ``spec_verify_ct``; draft tokens = ``spec_num_proposed_drafts`` (rounds x gamma);
      accepted = ``spec_num_correct_drafts``.
    * verified drafts: SGLang's verify length counts the anchor, so verified = sum(verify_len) -
      rounds, from ``spec_cap_lens_histogram`` (else ``spec_cap_length`` x rounds); without a
      ragged layout (static mode) every draft is verified.
    * emitted = tokens after the first (which comes from prefill), at most accepted + rounds.
    """
    rounds = int(meta.get("spec_verify_ct") or 0)
    if rounds <= 0:
        return SpecCounts()
    accepted = int(meta.get("spec_num_correct_drafts") or 0)
    drafted = int(meta.get("spec_num_proposed_drafts") or rounds * gamma)
    cap_hist = [int(x) for x in meta.get("spec_cap_lens_histogram") or []]
    if cap_hist:
        verified = sum(k * c for k, c in enumerate(cap_hist)) - rounds
        verified_pos = _at_least(cap_hist, 2, gamma)
    elif meta.get("spec_cap_length") is not None:
        verified = round(float(meta["spec_cap_length"]) * rounds) - rounds
        verified_pos = ()
    else:
        verified = drafted
        verified_pos = (rounds,) * gamma
    verified = min(max(verified, accepted), drafted)
    acc_hist = [int(x) for x in meta.get("spec_correct_drafts_histogram") or []]
    accepted_pos = _at_least(acc_hist, 1, gamma) if acc_hist else ()
    emitted = max(0, min(accepted + rounds, completion_tokens - 1))
    lengths = tuple((k + 1, c) for k, c in enumerate(acc_hist) if c)
    return SpecCounts(
        rounds=rounds,
        draft_tokens=drafted,
        verified_tokens=verified,
        accepted_tokens=accepted,
        emitted_tokens=emitted,
        accepted_per_position=accepted_pos,
        verified_per_position=verified_pos,
        round_lengths=lengths,
    )


# ---- documentation table -----------------------------------------------------------------------

# (our flag, SGLang ServerArgs field / env, note) -- rendered in docs/sglang.md and checked by tests.
FLAG_MAPPING: tuple[tuple[str, str, str], ...] = (
    ("--model DIR", "model_path", "target checkpoint (HF directory)"),
    ("--draft DIR", "speculative_draft_model_path", "with speculative_algorithm=DSPARK"),
    (
        "--spec-mode dspark",
        "speculative_algorithm=DSPARK + SGLANG_RAGGED_VERIFY_MODE=compact",
        "SGLang's budget planner (production variant)",
    ),
    (
        "--spec-mode fixed",
        "speculative_algorithm=DSPARK + SGLANG_RAGGED_VERIFY_MODE=static",
        "verify all gamma drafts",
    ),
    ("--spec-mode off", "(no speculative_algorithm)", "target only"),
    ("--gamma N", "speculative_dspark_block_size", "verify window N+1 (speculative_num_draft_tokens)"),
    ("--profile FILE", "speculative_dspark_sps_table_path", "SpsCostTable JSON; dspark mode only"),
    ("--calibration FILE", "speculative_dspark_confidence_sts_path", "STS JSON; dspark mode only"),
    ("--tp N", "tp_size", "tensor parallel GPUs"),
    ("--dtype D", "dtype", "auto | bfloat16 | float16 | float32"),
    ("--max-model-len N", "context_length", ""),
    ("--max-running N", "max_running_requests", "SGLang's default under speculation: 48"),
    ("--max-queued N", "(ours)", "admission limit before 429, kept by the backend"),
    ("--mem-fraction F", "mem_fraction_static", "GPU memory share for weights + KV"),
    ("--attention-backend B", "attention_backend", ""),
    ("--random-seed N", "random_seed", "server-wide seed"),
    ("--deterministic", "enable_deterministic_inference", "makes per-request seeds effective"),
    ("--sglang-metrics", "enable_metrics", "SGLang's own sglang:* metrics"),
    ("--sglang-arg NAME=VALUE", "NAME", "any other ServerArgs field"),
    ("(always)", "skip_tokenizer_init=True", "we tokenize, detokenize and match stop strings"),
)
