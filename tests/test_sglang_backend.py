"""The SGLang backend on a CPU machine: our settings -> SGLang's ServerArgs and sampling params,
SGLang's meta_info -> our statistics, the no-CUDA refusal, the backend's stream/abort/stats logic
against a fake engine speaking SGLang's stream format, the drafter checkpoint through SGLang's
runtime checks, the synchronous planner next to SGLang's budget, and the profiler wrapper.

Needs SGLang's source: ``pip install --no-deps sglang==0.5.23`` plus ``msgspec==0.23.0`` (the CI
list is in docs/sglang.md). SGLang's package ``__init__`` pulls the CUDA stack, so its modules are
read here without running it: ``ServerArgs``' fields from the AST of ``srt/arg_groups/fields``,
light modules imported under empty package shells, single functions compiled from their source.
A missing SGLang fails these tests (it does not skip them).
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import importlib
import importlib.util
import json
import sys
import types
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Optional, Union

import httpx
import msgspec
import numpy as np
import pytest
import torch

from dspark_server.backends.sglang import SGLangBackend
from dspark_server.backends.sglang_args import (
    FLAG_MAPPING,
    SGLangConfig,
    build_env,
    build_server_kwargs,
    finish_from_meta_info,
    parse_extra_server_args,
    sampling_params_to_sglang,
    spec_counts_from_meta_info,
)
from dspark_server.backends.sglang_runtime import (
    SGLangUnavailableError,
    check_draft_for_sglang,
    require_sglang_runtime,
)
from dspark_server.config import ServerConfig
from dspark_server.engine.backend import QueueFullError
from dspark_server.engine.request import InvalidRequestError, SamplingParams
from dspark_server.jobs.profile_sglang import (
    PROFILE_ENV,
    SGLangProfileConfig,
    convert_sglang_table,
    default_sglang_profile_path,
    profile_server_kwargs,
)
from dspark_server.models.tokenizer import Tokenizer
from dspark_server.planner import PlannerConfig, SpsCostTable, make_planner, prefix_survival
from dspark_server.testing.tiny import build_tiny_drafter

CI_HINT = "pip install --no-deps sglang==0.5.23 && pip install msgspec==0.23.0"


# ---- reading SGLang's source without running its package __init__ ----------------------------


@pytest.fixture(scope="module")
def sg_root() -> Path:
    spec = importlib.util.find_spec("sglang")  # locates the package; does not import it
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"SGLang's source is needed for these tests: {CI_HINT}")
    root = Path(next(iter(spec.submodule_search_locations)))
    assert (root / "srt" / "server_args.py").is_file(), f"{root} is not SGLang 0.5.23's package"
    return root


class _Stub(types.ModuleType):
    """A heavy SGLang module the code under test imports but does not use: any attribute is a
    dummy class."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})


def _import_sglang(root: Path, dotted: str, stubs: tuple[str, ...] = ()) -> types.ModuleType:
    """Import SGLang module ``dotted`` with empty package shells for its parents (so no package
    ``__init__`` runs) and ``stubs`` for heavy imports; ``sys.modules`` is restored afterwards."""
    saved = {k: v for k, v in sys.modules.items() if k == "sglang" or k.startswith("sglang.")}
    for k in saved:
        del sys.modules[k]
    try:
        for name in stubs:
            sys.modules[name] = _Stub(name)
        for name in (dotted, *stubs):
            parts = name.split(".")
            for i in range(1, len(parts)):
                pkg = ".".join(parts[:i])
                if pkg not in sys.modules:
                    shell = types.ModuleType(pkg)
                    shell.__path__ = [str(root.joinpath(*parts[1:i]))]
                    sys.modules[pkg] = shell
        return importlib.import_module(dotted)
    finally:
        for k in [k for k in sys.modules if k == "sglang" or k.startswith("sglang.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def _compile_defs(path: Path, wanted: set[str], env: dict[str, Any], cls: str | None = None) -> dict:
    """Compile only the top-level defs (or methods of class ``cls``) named ``wanted``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    body = tree.body
    if cls is not None:
        body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    nodes = [n for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in wanted]
    missing = wanted - {n.name for n in nodes}
    assert not missing, f"{path} no longer defines {missing}"
    ns = dict(env)
    future = ast.ImportFrom(module="__future__", names=[ast.alias("annotations")], level=0)
    module = ast.fix_missing_locations(ast.Module(body=[future, *nodes], type_ignores=[]))
    exec(compile(module, str(path), "exec", dont_inherit=True), ns)
    return ns


# ---- ServerArgs: our kwargs are SGLang's fields, with values of their types ------------------


@pytest.fixture(scope="module")
def server_fields(sg_root: Path) -> dict[str, str]:
    """ServerArgs field -> its type (source text), from the namespaces ServerArgs is built from."""
    tree = ast.parse((sg_root / "srt" / "server_args.py").read_text())
    namespaces = next(
        [e.id for e in node.value.elts]
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(getattr(t, "id", "") == "_INPUT_NAMESPACES" for t in node.targets)
    )
    fields: dict[str, str] = {}
    for f in (sg_root / "srt" / "arg_groups" / "fields").glob("*.py"):
        for node in ast.parse(f.read_text()).body:
            if isinstance(node, ast.ClassDef) and node.name in namespaces:
                for st in node.body:
                    if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                        ann = st.annotation  # A[T, help] -> T
                        if isinstance(ann, ast.Subscript) and isinstance(ann.slice, ast.Tuple):
                            ann = ann.slice.elts[0]
                        fields[st.target.id] = ast.unparse(ann)
    assert len(fields) > 400 and "speculative_dspark_sps_table_path" in fields, len(fields)
    return fields


def _accepts(type_src: str, value: Any) -> bool:
    node = ast.parse(type_src, mode="eval").body
    return _node_accepts(node, value)


def _node_accepts(node: ast.expr, value: Any) -> bool:
    if isinstance(node, ast.Name):
        simple = {"str": str, "int": int, "float": (int, float), "bool": bool}
        if node.id not in simple:
            return True  # a type we do not model (e.g. a Struct): not checked
        if node.id in ("int", "float") and isinstance(value, bool):
            return False
        return isinstance(value, simple[node.id])
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
        args = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if node.value.id == "Optional":
            return value is None or _node_accepts(args[0], value)
        if node.value.id == "Union":
            return any(_node_accepts(a, value) for a in args)
        if node.value.id == "Literal":
            return value in [ast.literal_eval(a) for a in args]
    return True


def _configs(tmp: Path) -> list[SGLangConfig]:
    return [
        SGLangConfig(
            model_path="/m/target",
            draft_path="/m/draft",
            spec_mode="dspark",
            gamma=5,
            sps_table_path=str(tmp / "sps.json"),
            sts_path=str(tmp / "sts.json"),
            tp_size=2,
            dtype="bfloat16",
            max_model_len=4096,
            max_running=64,
            mem_fraction_static=0.8,
            attention_backend="fa3",
            random_seed=7,
            deterministic=True,
            enable_metrics=True,
            extra_server_args=(("cuda_graph_max_bs_decode", 64), ("chunked_prefill_size", 4096)),
        ),
        SGLangConfig(
            model_path="/m/target",
            draft_path="/m/draft",
            spec_mode="fixed",
            sps_table_path="x.json",
            sts_path="y.json",
        ),
        SGLangConfig(model_path="/m/target", spec_mode="off", max_running=8, prefix_cache=False),
    ]


def test_server_kwargs_are_server_args_fields_of_the_right_types(
    tmp_path: Path, server_fields: dict[str, str]
) -> None:
    for cfg in _configs(tmp_path):
        for name, value in build_server_kwargs(cfg).items():
            assert name in server_fields, f"{name} is not a ServerArgs field of SGLang 0.5.23"
            assert _accepts(server_fields[name], value), (name, server_fields[name], value)
    prof = SGLangProfileConfig(server=_configs(tmp_path)[0], batch_sizes=(1, 8, 96))
    for name, value in profile_server_kwargs(prof, 31000).items():
        assert name in server_fields and _accepts(server_fields[name], value), name


def test_dspark_mapping(tmp_path: Path) -> None:
    cfg = _configs(tmp_path)[0]
    kw = build_server_kwargs(cfg)
    assert kw == {
        "model_path": "/m/target",
        "skip_tokenizer_init": True,
        "tp_size": 2,
        "dtype": "bfloat16",
        "log_level": "error",
        "context_length": 4096,
        "max_running_requests": 64,
        "mem_fraction_static": 0.8,
        "attention_backend": "fa3",
        "random_seed": 7,
        "enable_deterministic_inference": True,
        "enable_metrics": True,
        "speculative_algorithm": "DSPARK",
        "speculative_draft_model_path": "/m/draft",
        "speculative_dspark_block_size": 5,
        "speculative_dspark_sps_table_path": str(tmp_path / "sps.json"),
        "speculative_dspark_confidence_sts_path": str(tmp_path / "sts.json"),
        "cuda_graph_max_bs_decode": 64,
        "chunked_prefill_size": 4096,
    }
    assert build_env(cfg) == {"SGLANG_RAGGED_VERIFY_MODE": "compact"}


def test_fixed_and_off_modes() -> None:
    fixed = SGLangConfig(model_path="t", draft_path="d", spec_mode="fixed", sps_table_path="s", sts_path="c")
    kw = build_server_kwargs(fixed)
    assert kw["speculative_algorithm"] == "DSPARK" and "speculative_dspark_block_size" not in kw
    assert "speculative_dspark_sps_table_path" not in kw  # static verification reads neither file
    assert "speculative_dspark_confidence_sts_path" not in kw
    assert build_env(fixed) == {"SGLANG_RAGGED_VERIFY_MODE": "static"}
    off = SGLangConfig(model_path="t", draft_path="d", spec_mode="off")
    assert not any(k.startswith("speculative") for k in build_server_kwargs(off))
    assert "disable_radix_cache" not in build_server_kwargs(off)  # SGLang's radix cache stays on
    uncached = SGLangConfig(model_path="t", spec_mode="off", prefix_cache=False)
    assert build_server_kwargs(uncached)["disable_radix_cache"] is True  # --no-prefix-cache
    assert build_env(off) == {}
    over = SGLangConfig(model_path="t", draft_path="d", verify_mode="cap-accept")
    assert build_env(over) == {"SGLANG_RAGGED_VERIFY_MODE": "cap-accept"}


def test_config_refusals() -> None:
    with pytest.raises(ValueError, match="static-threshold"):
        SGLangConfig(model_path="t", draft_path="d", spec_mode="threshold")
    with pytest.raises(ValueError, match="needs a drafter"):
        SGLangConfig(model_path="t", spec_mode="dspark")
    with pytest.raises(ValueError, match="gamma"):
        SGLangConfig(model_path="t", draft_path="d", gamma=0)
    with pytest.raises(ValueError, match="verify_mode"):
        SGLangConfig(model_path="t", draft_path="d", verify_mode="ragged")
    with pytest.raises(ValueError, match="dspark flag"):
        SGLangConfig(model_path="t", draft_path="d", extra_server_args=(("tp_size", 2),))


def test_extra_server_args_parsing() -> None:
    assert parse_extra_server_args(
        [
            "cuda-graph-max-bs-decode=64",
            "--disable_radix_cache=true",
            "kv_cache_dtype=fp8_e4m3",
            "x=[1, 2]",
            "y=",
        ]
    ) == (
        ("cuda_graph_max_bs_decode", 64),
        ("disable_radix_cache", True),
        ("kv_cache_dtype", "fp8_e4m3"),
        ("x", [1, 2]),
        ("y", ""),
    )
    with pytest.raises(ValueError, match="NAME=VALUE"):
        parse_extra_server_args(["no_value"])


def test_flag_mapping_table_names_sglang_fields(server_fields: dict[str, str]) -> None:
    for _ours, theirs, _note in FLAG_MAPPING:
        for token in theirs.replace("+", " ").split():
            name = token.split("=")[0]
            if name.isidentifier() and name.islower() and name != "NAME":
                assert name in server_fields, name


def test_ragged_verify_modes_and_profiler_env_exist(sg_root: Path) -> None:
    enum = (sg_root / "srt" / "speculative" / "ragged_verify.py").read_text()
    for mode in ("static", "compact", "cap-accept"):
        assert f'= "{mode}"' in enum
    environ = (sg_root / "srt" / "environ.py").read_text()
    assert 'SGLANG_RAGGED_VERIFY_MODE = EnvStr("static")' in environ  # default: verify everything
    for name in PROFILE_ENV:
        assert f"    {name} = Env" in environ, name


# ---- sampling parameters: accepted by SGLang's own SamplingParams ----------------------------


@pytest.fixture(scope="module")
def sg_sampling(sg_root: Path) -> types.ModuleType:
    return _import_sglang(sg_root, "sglang.srt.sampling.sampling_params")


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=17),
        SamplingParams(
            temperature=0.7,
            top_p=0.9,
            top_k=0,
            seed=123,
            max_tokens=5,
            stop=("\n\n", "END"),
            stop_token_ids=(9, 4),
        ),
        SamplingParams(temperature=1.3, top_k=-1, ignore_eos=True, stop_token_ids=(2,)),
        SamplingParams(temperature=1.0, top_k=40),
    ],
)
def test_sampling_params_mapping(params: SamplingParams, sg_sampling: types.ModuleType) -> None:
    eos = (2, 7)
    d = sampling_params_to_sglang(params, eos)
    assert d["max_new_tokens"] == params.max_tokens and d["temperature"] == params.temperature
    assert d["top_p"] == params.top_p and d["ignore_eos"] == params.ignore_eos
    assert d["top_k"] == (params.top_k if params.top_k > 0 else -1)
    want_stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
    assert set(d.get("stop_token_ids", ())) == want_stop
    assert d.get("sampling_seed") == params.seed
    assert "stop" not in d  # matched by us: SGLang runs without a tokenizer
    sp = sg_sampling.SamplingParams(**d)
    sp.verify(vocab_size=100)
    sp.normalize(None)  # skip_tokenizer_init: SGLang's own check that nothing needs a tokenizer
    if params.temperature == 0.0:
        assert sp.top_k == 1  # SGLang's greedy
    elif params.top_k <= 0:
        assert sp.top_k == sg_sampling.TOP_K_ALL
    if params.stop:
        with_stops = sampling_params_to_sglang(params, eos, include_stop_strings=True)
        assert with_stops["stop"] == list(params.stop)
        with pytest.raises(ValueError, match="skip_tokenizer_init"):
            sg_sampling.SamplingParams(**with_stops).normalize(None)


# ---- meta_info -> our speculative counters ---------------------------------------------------

GAMMA = 4


@pytest.fixture(scope="module")
def spec_metrics_fn(sg_root: Path) -> Any:
    """SGLang's ``TokenizerManager._calculate_spec_decoding_metrics`` (the meta_info writer)."""
    env = {
        "get_spec": lambda: types.SimpleNamespace(speculative_num_draft_tokens=GAMMA + 1),
        "_ragged_verify_cap_accept": lambda: False,
        "Dict": dict,
        "Any": Any,
        "Union": Union,
    }
    ns = _compile_defs(
        sg_root / "srt" / "managers" / "tokenizer_manager.py",
        {"_calculate_spec_decoding_metrics"},
        env,
        cls="TokenizerManager",
    )
    return ns["_calculate_spec_decoding_metrics"]


def _scheduler_record(rounds: list[tuple[int, int]], completion_tokens: int, ragged: bool) -> Any:
    """What SGLang's scheduler accumulates for one request over (verify_len, accepted) rounds
    (batch_result_processor: verify count, correct drafts, their histogram, cap lengths)."""
    acc_hist: list[int] = []
    cap_hist: list[int] = []
    for vlen, acc in rounds:
        acc_hist.extend([0] * (acc + 1 - len(acc_hist)))
        acc_hist[acc] += 1
        cap_hist.extend([0] * (vlen + 1 - len(cap_hist)))
        cap_hist[vlen] += 1
    return types.SimpleNamespace(
        spec_verify_ct=[len(rounds)],
        spec_num_correct_drafts=[sum(a for _, a in rounds)],
        completion_tokens=[completion_tokens],
        spec_correct_drafts_histogram=[acc_hist],
        spec_num_cap_tokens=[sum(v for v, _ in rounds) if ragged else 0],
        spec_cap_lens_histogram=[cap_hist if ragged else []],
        spec_num_block_accept_tokens=[0],
    )


def _sglang_meta(fn: Any, rounds: list[tuple[int, int]], completion_tokens: int, ragged: bool) -> dict:
    meta = {
        "finish_reason": {"type": "length", "length": completion_tokens},
        "prompt_tokens": 5,
        "completion_tokens": completion_tokens,
    }
    fn(None, meta, _scheduler_record(rounds, completion_tokens, ragged), 0)
    return meta


def _random_rounds(rng: np.random.Generator, ragged: bool) -> list[tuple[int, int]]:
    rounds = []
    for _ in range(int(rng.integers(1, 30))):
        drafts = int(rng.integers(0, GAMMA + 1)) if ragged else GAMMA
        rounds.append((drafts + 1, int(rng.integers(0, drafts + 1))))
    return rounds


@pytest.mark.parametrize("ragged", [True, False])
def test_meta_info_to_spec_counts(spec_metrics_fn: Any, ragged: bool) -> None:
    rng = np.random.default_rng(3 if ragged else 4)
    for _ in range(40):
        rounds = _random_rounds(rng, ragged)
        emitted = sum(a + 1 for _, a in rounds)
        completion = 1 + emitted - int(rng.integers(0, rounds[-1][1] + 1))  # last round cut by a stop
        meta = _sglang_meta(spec_metrics_fn, rounds, completion, ragged)
        assert meta["spec_verify_ct"] == len(rounds)
        c = spec_counts_from_meta_info(meta, GAMMA, completion)
        assert c.rounds == len(rounds) and c.draft_tokens == len(rounds) * GAMMA
        assert c.accepted_tokens == sum(a for _, a in rounds)
        assert c.verified_tokens == sum(v - 1 for v, _ in rounds)
        assert c.emitted_tokens == completion - 1
        assert list(c.accepted_per_position) == [sum(a > j for _, a in rounds) for j in range(GAMMA)]
        assert list(c.verified_per_position) == [sum(v - 1 > j for v, _ in rounds) for j in range(GAMMA)]
        assert sum(n for _, n in c.round_lengths) == len(rounds)
        stats = c.to_spec_stats()
        assert stats.mean_acceptance_length == pytest.approx((completion - 1) / len(rounds))


def test_meta_info_without_speculation_and_finish_reasons() -> None:
    assert spec_counts_from_meta_info({"completion_tokens": 9}, GAMMA, 9).rounds == 0
    assert finish_from_meta_info({"finish_reason": None}) == (None, None)
    assert finish_from_meta_info({"finish_reason": {"type": "stop", "matched": 2}}) == ("stop", None)
    assert finish_from_meta_info({"finish_reason": {"type": "length", "length": 3}}) == ("length", None)
    reason, err = finish_from_meta_info({"finish_reason": {"type": "abort", "message": "OOM"}})
    assert reason == "abort" and "OOM" in (err or "")


# ---- refusing to run without CUDA / SGLang ---------------------------------------------------


def test_refuses_without_cuda(tiny_model: Path) -> None:
    with pytest.raises(SGLangUnavailableError, match="needs an NVIDIA GPU") as e:
        require_sglang_runtime(cuda=(False, "torch 2.13.0+cpu is a CPU-only build"))
    assert "--backend native" in str(e.value) and "CPU-only" in str(e.value)
    if not torch.cuda.is_available():  # the CI machine: the real check, and the backend itself
        with pytest.raises(SGLangUnavailableError, match="needs an NVIDIA GPU"):
            require_sglang_runtime()
        with pytest.raises(SGLangUnavailableError, match="needs an NVIDIA GPU"):
            SGLangBackend(SGLangConfig(model_path=str(tiny_model), spec_mode="off"))


def test_refuses_without_sglang() -> None:
    with pytest.raises(SGLangUnavailableError, match=r"not installed: pip install 'dspark-server\[sglang\]'"):
        require_sglang_runtime(cuda=(True, "H200"), find_spec=lambda _: None)

    def broken(_: str) -> None:
        raise ModuleNotFoundError("No module named 'orjson'")

    with pytest.raises(SGLangUnavailableError, match="does not import.*orjson"):
        require_sglang_runtime(cuda=(True, "H200"), find_spec=lambda _: object(), import_module=broken)


# ---- the drafter checkpoint through SGLang's runtime checks ----------------------------------

_DFLASH_STUBS = (
    "sglang.kernels.ops.sampling.renorm",
    "sglang.kernels.ops.speculative.verify_sampling",
    "sglang.srt.layers.quantization.unquant",
    "sglang.srt.layers.sampler",
    "sglang.srt.managers.schedule_batch",
    "sglang.srt.model_executor.runner_utils.pool",
    "sglang.srt.runtime_context",
    "sglang.srt.speculative.spec_utils",
    "sglang.srt.utils",
    "sglang.srt.arg_groups.overrides",
)


@pytest.fixture(scope="module")
def sg_dspark_config(sg_root: Path) -> types.ModuleType:
    return _import_sglang(sg_root, "sglang.srt.speculative.dspark_components.dspark_config", _DFLASH_STUBS)


@pytest.fixture(scope="module")
def drafters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sglang_drafters")
    return {
        "markov": build_tiny_drafter(tiny_model, root / "markov", gamma=4, markov_rank=16),
        "none": build_tiny_drafter(tiny_model, root / "none", gamma=4, head_type="none"),
    }


def test_sglang_runtime_config_from_our_drafter(
    sg_dspark_config: types.ModuleType, tiny_model: Path, drafters: dict[str, Path]
) -> None:
    raw = json.loads((drafters["markov"] / "config.json").read_text())
    target = json.loads((tiny_model / "config.json").read_text())
    mask_id = Tokenizer(tiny_model).token_id("<|mask|>")
    rt = sg_dspark_config.resolve_runtime_config(
        draft_hf_config=raw, speculative_num_draft_tokens=None, target_vocab_size=target["vocab_size"]
    )
    assert (rt.gamma, rt.verify_num_draft_tokens, rt.mask_token_id) == (4, 5, mask_id)
    # --gamma 3: SGLang derives speculative_num_draft_tokens = block size + 1 from our kwarg
    kw = build_server_kwargs(
        SGLangConfig(model_path=str(tiny_model), draft_path=str(drafters["markov"]), gamma=3)
    )
    rt = sg_dspark_config.resolve_runtime_config(
        draft_hf_config=raw,
        speculative_num_draft_tokens=kw["speculative_dspark_block_size"] + 1,
        target_vocab_size=target["vocab_size"],
    )
    assert rt.gamma == 3
    assert sg_dspark_config.get_dspark_sample_from_anchor(raw) is True
    # our target is not mistaken for a checkpoint with a bundled drafter (--draft is used)
    assert not sg_dspark_config.checkpoint_bundles_dspark_draft(target)
    assert (
        check_draft_for_sglang(SGLangConfig(model_path=str(tiny_model), draft_path=str(drafters["markov"])))
        == 4
    )


def test_drafters_sglang_rejects_are_refused_before_start(
    sg_dspark_config: types.ModuleType, tiny_model: Path, drafters: dict[str, Path]
) -> None:
    raw = json.loads((drafters["none"] / "config.json").read_text())
    with pytest.raises(ValueError, match="markov_rank > 0"):
        sg_dspark_config.resolve_runtime_config(
            draft_hf_config=raw, speculative_num_draft_tokens=None, target_vocab_size=10_000
        )
    with pytest.raises(ValueError, match="Markov head"):
        check_draft_for_sglang(SGLangConfig(model_path=str(tiny_model), draft_path=str(drafters["none"])))
    with pytest.raises(ValueError, match="block size 4"):
        check_draft_for_sglang(
            SGLangConfig(model_path=str(tiny_model), draft_path=str(drafters["markov"]), gamma=6)
        )


def test_shipped_demo_drafter_parses_in_sglang(sg_dspark_config: types.ModuleType) -> None:
    from dspark_server.assets import DEMO_DRAFT, DEMO_TARGET

    if not (DEMO_DRAFT / "config.json").is_file():
        pytest.skip("the demo drafter is not built in this checkout")
    raw = json.loads((DEMO_DRAFT / "config.json").read_text())
    vocab = json.loads((DEMO_TARGET / "config.json").read_text())["vocab_size"]
    rt = sg_dspark_config.resolve_runtime_config(
        draft_hf_config=raw, speculative_num_draft_tokens=None, target_vocab_size=vocab
    )
    assert rt.gamma == raw["block_size"]


# ---- the synchronous planner next to SGLang's budget -----------------------------------------


@pytest.fixture(scope="module")
def sg_budget(sg_root: Path) -> types.SimpleNamespace:
    comp = sg_root / "srt" / "speculative" / "dspark_components"
    sps = _import_sglang(sg_root, "sglang.srt.speculative.dspark_components.dspark_sps")
    env = {"torch": torch, "msgspec": msgspec, "Optional": Optional, "Union": Union, **vars(sps)}
    planner = _compile_defs(
        comp / "dspark_planner.py",
        {
            "DSparkScheduleConfig",
            "VerifyBudgetDecision",
            "compute_verify_token_budget",
            "_lookup_sps_tensor",
            "_additive_step_time_tensor",
        },
        env,
    )
    return types.SimpleNamespace(
        sps=sps, **{k: planner[k] for k in ("DSparkScheduleConfig", "compute_verify_token_budget")}
    )


def _theta_path(survival: torch.Tensor, table: SpsCostTable) -> np.ndarray:
    r = survival.shape[0]
    values = np.sort(survival.numpy().reshape(-1).astype(np.float64))[::-1]
    tau = r + np.concatenate(([0.0], np.cumsum(values)))
    return tau * np.array([table.lookup(r + k) for k in range(tau.size)])


def test_sync_planner_agrees_with_sglang_budget_when_theta_is_unimodal(
    sg_budget: types.SimpleNamespace,
) -> None:
    rng = np.random.default_rng(21)
    unimodal = 0
    for _ in range(600):
        r, gamma = int(rng.integers(1, 24)), int(rng.integers(1, 8))
        top = r * (gamma + 1)
        probes = sorted({1, *(int(x) for x in rng.integers(2, top + 1, size=int(rng.integers(1, 6))))})
        sps = np.sort(rng.uniform(5.0, 100.0, size=len(probes)))[::-1]
        table = SpsCostTable(tuple(probes), tuple(float(s) for s in sps), top)
        conf = torch.from_numpy(np.clip(rng.beta(4, 1, size=(r, gamma)), 0.3, 1.0)).float()
        survival = prefix_survival(conf)
        theta = _theta_path(survival, table)
        peak = int(np.argmax(theta))
        if not (np.all(np.diff(theta[: peak + 1]) > 0) and np.all(np.diff(theta[peak:]) <= 0)):
            continue
        unimodal += 1
        ours = make_planner(PlannerConfig(mode="dspark", gamma=gamma), table).plan_detailed(conf)
        theirs = sg_budget.compute_verify_token_budget(
            history_survival_probs=survival,
            sps_table=sg_budget.sps.SpsCostTable(
                sample_batch_tokens=probes, sample_steps_per_sec=[float(s) for s in sps], max_batch_tokens=top
            ),
            cfg=sg_budget.DSparkScheduleConfig(gamma=gamma),
        )
        assert ours.batch_tokens - r == theirs.budget
        assert ours.expected_throughput == pytest.approx(theirs.predicted_theta, rel=1e-9)
    assert unimodal >= 60, unimodal


def test_sync_planner_stops_where_sglang_budget_looks_past_a_dip(sg_budget: types.SimpleNamespace) -> None:
    # One request, survival (0.5, 0.5): Theta = 1 x 10, 1.5 x 6 = 9 (a dip), 2 x 6 = 12.
    conf = torch.tensor([[0.5, 1.0]])
    table = SpsCostTable((1, 2), (10.0, 6.0), 3)
    ours = make_planner(PlannerConfig(mode="dspark", gamma=2), table).plan_detailed(conf)
    theirs = sg_budget.compute_verify_token_budget(
        history_survival_probs=prefix_survival(conf),
        sps_table=sg_budget.sps.SpsCostTable(
            sample_batch_tokens=[1, 2], sample_steps_per_sec=[10.0, 6.0], max_batch_tokens=3
        ),
        cfg=sg_budget.DSparkScheduleConfig(gamma=2),
    )
    assert ours.verify_lens.tolist() == [0] and ours.expected_throughput == pytest.approx(10.0)
    assert theirs.budget == 2 and theirs.predicted_theta == pytest.approx(12.0)


# ---- the profiler wrapper --------------------------------------------------------------------


def test_profiler_interface_we_call_exists(sg_root: Path) -> None:
    tree = ast.parse((sg_root / "benchmark" / "dspark_sps_profiler.py").read_text())
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    profile_all = defs["profile_all"]
    assert {a.arg for a in profile_all.args.kwonlyargs} == {
        "base_url",
        "batch_sizes",
        "settings",
        "out",
        "max_batch_tokens",
        "repeats",
        "self_check",
        "local_tokenizer_path",
        "fracs",
        "plot",
    }
    settings = {s.target.id for s in defs["RoundSettings"].body if isinstance(s, ast.AnnAssign)}
    assert {
        "input_len",
        "temperature",
        "min_steady_steps",
        "min_steady_seconds",
        "round_timeout_seconds",
    } <= settings
    assert "build_request_count_sweep" in defs
    src = ast.unparse(tree)
    assert "get_tokenizer(context.tokenizer_path)" in src  # the module global we replace
    assert "REQUIRED_SIMULATE_ACC_LEN = 1.0" in src and PROFILE_ENV["SGLANG_SIMULATE_ACC_LEN"] == "1.0"
    assert "SGLANG_DSPARK_ENABLE_SPS_RECORD=1" in src and "SGLANG_RAGGED_VERIFY_MODE=static" in src


def test_profile_server_kwargs(tmp_path: Path) -> None:
    server = SGLangConfig(
        model_path="/m/t",
        draft_path="/m/d",
        spec_mode="fixed",
        max_running=16,
        sps_table_path="s.json",
        sts_path="c.json",
        gamma=5,
    )
    kw = profile_server_kwargs(SGLangProfileConfig(server=server, max_batch_size=96), 30123)
    assert kw["speculative_algorithm"] == "DSPARK" and kw["speculative_dspark_block_size"] == 5
    assert kw["max_running_requests"] == 96 and kw["cuda_graph_max_bs_decode"] == 96
    assert (kw["host"], kw["port"]) == ("127.0.0.1", 30123)
    assert "speculative_dspark_sps_table_path" not in kw
    assert "speculative_dspark_confidence_sts_path" not in kw
    with pytest.raises(ValueError, match="drafter"):
        SGLangProfileConfig(server=SGLangConfig(model_path="/m/t", spec_mode="off"))
    assert default_sglang_profile_path("/x/demo-target", "NVIDIA H200", 2) == Path(
        "profiles/demo-target__sglang__nvidia-h200__tp2.json"
    )


def test_sglang_fitted_table_converts(tmp_path: Path, sg_budget: types.SimpleNamespace) -> None:
    fitted = sg_budget.sps.profile_sps_table(probes=[(8, 240.0), (64, 180.5), (512, 41.0)])
    path = tmp_path / "table.json"
    path.write_text(fitted.to_json())
    ours = convert_sglang_table(path)
    assert ours == SpsCostTable((8, 64, 512), (240.0, 180.5, 41.0), 512)
    additive = sg_budget.sps.SpsAdditiveCostTable(
        bias_seconds=0.01,
        bs_probes=[1, 8],
        alpha_seconds=[0.0, 0.001],
        m_probes=[8, 64],
        theta_seconds=[0.0, 0.002],
    )
    path.write_text(additive.to_json())
    with pytest.raises(ValueError, match="additive"):
        convert_sglang_table(path)


# ---- the backend against a fake engine speaking SGLang's stream format -----------------------


class FakeTokenizerManager:
    incremental_streaming_output = False

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.aborted: list[str] = []

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.aborted.append(rid)
        self.engine.abort_events.setdefault(rid, asyncio.Event()).set()


class FakeEngine:
    """Emits ``script`` tokens like SGLang's TokenizerManager in non-incremental streaming mode:
    cumulative ``output_ids``, the first token alone (prefill), then one chunk per speculative
    round of (accepted + 1) tokens; stops at ``stop_token_ids`` / ``max_new_tokens`` like the
    scheduler; the last chunk carries ``finish_reason`` and the spec metrics SGLang computes."""

    def __init__(
        self,
        script: list[int],
        accepted: list[int],
        spec_fn: Any,
        *,
        sglang_abort_after: int | None = None,
        **kwargs: Any,
    ) -> None:
        self.kwargs = kwargs
        self.script, self.accepted, self.spec_fn = script, accepted, spec_fn
        self.sglang_abort_after = sglang_abort_after
        self.tokenizer_manager = FakeTokenizerManager(self)
        self.calls: list[dict] = []
        self.abort_events: dict[str, asyncio.Event] = {}
        self.shut = False

    def shutdown(self) -> None:
        self.shut = True

    async def async_generate(
        self, *, input_ids: list[int], sampling_params: dict, stream: bool, rid: str
    ) -> AsyncIterator[dict]:
        assert stream is True
        self.calls.append({"input_ids": input_ids, "sampling_params": sampling_params, "rid": rid})
        return self._run(rid, sampling_params)

    async def _run(self, rid: str, sp: dict) -> AsyncIterator[dict]:
        out: list[int] = []
        rounds: list[tuple[int, int]] = []
        stops = set(sp.get("stop_token_ids") or ())
        aborted = self.abort_events.setdefault(rid, asyncio.Event())
        sizes = [1] + [a + 1 for a in self.accepted]
        finish: dict | None = None
        for i, size in enumerate(sizes):
            await asyncio.sleep(0)
            if aborted.is_set() or (self.sglang_abort_after is not None and i > self.sglang_abort_after):
                finish = {
                    "type": "abort",
                    "message": "Aborted" if aborted.is_set() else "KV pool exhausted",
                    "status_code": None,
                }
                break
            if i:
                rounds.append((GAMMA + 1, size - 1))
            for tok in self.script[len(out) : len(out) + size]:
                out.append(tok)
                if tok in stops:
                    finish = {"type": "stop", "matched": tok}
                    break
                if len(out) >= sp["max_new_tokens"]:
                    finish = {"type": "length", "length": len(out)}
                    break
            if finish is None and len(out) >= len(self.script):
                finish = {"type": "stop", "matched": out[-1]}
            if finish is not None:
                break
            yield {
                "output_ids": out,
                "meta_info": {"id": rid, "finish_reason": None, "completion_tokens": len(out)},
            }
        meta = {"id": rid, "finish_reason": finish, "completion_tokens": len(out), "prompt_tokens": 3}
        if rounds:
            self.spec_fn(None, meta, _scheduler_record(rounds, len(out), ragged=True), 0)
        yield {"output_ids": list(out), "meta_info": meta}


@pytest.fixture
def make_backend(tiny_model: Path, drafters: dict[str, Path], spec_metrics_fn: Any) -> Iterator:
    backends: list[SGLangBackend] = []

    def make(text: str, accepted: list[int], **cfg: Any) -> tuple[SGLangBackend, FakeEngine, list[int]]:
        tok = Tokenizer(tiny_model)
        script = tok.encode(text)
        holder: list[FakeEngine] = []
        engine_kw = {k: cfg.pop(k) for k in ("sglang_abort_after",) if k in cfg}

        def factory(**kwargs: Any) -> FakeEngine:
            holder.append(FakeEngine(script, accepted, spec_metrics_fn, **engine_kw, **kwargs))
            return holder[0]

        settings = {"draft_path": str(drafters["markov"]), "max_running": 2, "max_queued": 1, **cfg}
        b = SGLangBackend(SGLangConfig(model_path=str(tiny_model), **settings), engine_factory=factory)
        b.start()
        backends.append(b)
        return b, holder[0], script

    yield make
    for b in backends:
        b.shutdown()


async def _collect(stream: Any) -> list[Any]:
    return [out async for out in stream]


def test_stream_text_usage_and_stats(make_backend: Any, tiny_model: Path) -> None:
    text = "def add(a, b):\n    return a + b\n\nThe quick brown fox jumps over the lazy dog."
    b, engine, script = make_backend(text, accepted=[3, 0, 2, 4, 1, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4])
    assert engine.kwargs["speculative_algorithm"] == "DSPARK" and engine.kwargs["skip_tokenizer_init"]
    params = SamplingParams(temperature=0.0, max_tokens=20)
    outs = asyncio.run(_collect(b.generate("req-1", [1, 2, 3], params)))
    tokens = [t for o in outs for t in o.new_token_ids]
    assert tokens == script[:20]
    assert "".join(o.new_text for o in outs) == Tokenizer(tiny_model).decode(script[:20])
    last = outs[-1]
    assert last.finished and last.finish_reason == "length" and last.completion_tokens == 20
    assert all(not o.finished for o in outs[:-1]) and len(outs) > 3  # streamed round by round
    call = engine.calls[0]
    assert call["input_ids"] == [1, 2, 3] and len(call["rid"]) == 32
    assert call["sampling_params"] == sampling_params_to_sglang(params, b.eos_token_ids)
    # rounds 3+1, 0+1, 2+1, 4+1, 1+1, 4+1: 19 tokens after the prefill one; the last round is cut
    spec = last.spec
    assert spec.rounds == 6 and spec.accepted_tokens == 14 and spec.draft_tokens == 6 * GAMMA
    assert spec.verified_tokens == 6 * GAMMA and spec.emitted_tokens == 19
    s = b.stats
    assert (s.prompt_tokens, s.generation_tokens, s.finished_requests) == (3, 20, 1)
    assert s.finished_by_reason == {"length": 1} and s.spec_rounds == 6 and s.spec_accepted_tokens == 14
    assert s.accepted_per_position == [5, 4, 3, 2] and s.verified_per_position == [6, 6, 6, 6]
    assert b.load().admitted == 0 and b.can_accept()
    snap = b.spec_snapshot()
    assert snap is not None and (snap.mode, snap.gamma) == ("dspark", GAMMA)


def test_stop_string_ends_locally_and_aborts_sglang(make_backend: Any) -> None:
    b, engine, _ = make_backend(
        "alpha beta STOP gamma delta epsilon zeta eta theta", accepted=[1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]
    )
    outs = asyncio.run(_collect(b.generate("r", [5], SamplingParams(max_tokens=50, stop=("STOP",)))))
    text = "".join(o.new_text for o in outs)
    assert text == "alpha beta " and outs[-1].finish_reason == "stop"
    assert engine.tokenizer_manager.aborted == [engine.calls[0]["rid"]]
    assert outs[-1].spec.rounds >= 1  # counters from SGLang's final (abort) meta_info
    assert b.stats.finished_by_reason == {"stop": 1} and b.load().admitted == 0


def test_closing_early_aborts_and_releases(make_backend: Any) -> None:
    b, engine, _ = make_backend("one two three four five six seven eight nine ten", accepted=[0] * 20)

    async def first_then_close() -> None:
        stream = b.generate("r", [5], SamplingParams(max_tokens=30))
        first = await stream.__anext__()
        assert not first.finished and first.new_token_ids
        assert b.load().admitted == 1
        stream.close()
        stream.close()  # idempotent
        assert [o async for o in stream] == []
        await asyncio.sleep(0.01)

    asyncio.run(first_then_close())
    assert engine.tokenizer_manager.aborted == [engine.calls[0]["rid"]]
    assert b.load().admitted == 0 and b.stats.finished_by_reason == {"abort": 1}


def test_sglang_side_abort_is_an_error(make_backend: Any) -> None:
    b, _, _ = make_backend("one two three four five six", accepted=[0] * 10, sglang_abort_after=2)
    outs = asyncio.run(_collect(b.generate("r", [5], SamplingParams(max_tokens=30))))
    assert outs[-1].finished and "KV pool exhausted" in (outs[-1].error or "")
    assert b.stats.finished_by_reason == {"error": 1} and b.load().admitted == 0


def test_admission_and_validation(make_backend: Any) -> None:
    b, _, _ = make_backend("x y z", accepted=[0], max_model_len=64)
    with pytest.raises(InvalidRequestError, match="maximum context length is 64"):
        b.generate("r", [1] * 60, SamplingParams(max_tokens=10))
    with pytest.raises(InvalidRequestError, match="prompt token ids"):
        b.generate("r", [10**6], SamplingParams(max_tokens=1))

    async def fill() -> None:
        streams = [b.generate(f"r{i}", [1], SamplingParams(max_tokens=2)) for i in range(3)]
        assert not b.can_accept() and b.load().admitted == 3
        with pytest.raises(QueueFullError):
            b.generate("r4", [1], SamplingParams(max_tokens=2))
        for s in streams:
            s.close()
        assert b.can_accept()

    asyncio.run(fill())


def test_backend_refuses_mismatched_calibration(
    tiny_model: Path, drafters: dict[str, Path], tmp_path: Path
) -> None:
    from dspark_server.planner import StsCalibration, save_sts_calibration

    save_sts_calibration(StsCalibration((1.0, 2.0)), tmp_path / "sts.json")
    cfg = SGLangConfig(
        model_path=str(tiny_model), draft_path=str(drafters["markov"]), sts_path=str(tmp_path / "sts.json")
    )
    with pytest.raises(ValueError, match="gamma=2"):
        SGLangBackend(cfg, engine_factory=lambda **_: None)


def test_default_calibration_and_profile_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dspark_server.backends.sglang_runtime import with_default_files
    from dspark_server.planner import StsCalibration, save_sts_calibration

    draft = tmp_path / "draft"
    save_sts_calibration(StsCalibration((1.0,) * 4), draft / "sts_calibration.json")
    monkeypatch.chdir(tmp_path)
    table = default_sglang_profile_path("/models/demo-target", "NVIDIA H200", 1)
    (tmp_path / table).parent.mkdir(parents=True)
    (tmp_path / table).write_text(json.dumps(SpsCostTable((1, 8), (100.0, 90.0), 8).to_dict()))
    cfg = SGLangConfig(model_path="/models/demo-target", draft_path=str(draft))
    got = with_default_files(cfg, "NVIDIA H200")
    assert got.sts_path == str(draft / "sts_calibration.json") and got.sps_table_path == str(table)
    assert with_default_files(cfg, "NVIDIA A100").sps_table_path is None  # another GPU's table
    assert (
        with_default_files(replace_cfg(cfg, sps_table_path="mine.json"), "NVIDIA H200").sps_table_path
        == "mine.json"
    )
    fixed = with_default_files(replace_cfg(cfg, spec_mode="fixed"), "NVIDIA H200")
    assert fixed.sps_table_path is None  # static verification reads no table


def replace_cfg(cfg: SGLangConfig, **changes: Any) -> SGLangConfig:
    from dataclasses import replace

    return replace(cfg, **changes)


def test_openai_api_over_the_sglang_backend(make_backend: Any) -> None:
    from dspark_server.server.app import create_app

    b, _, _ = make_backend("The quick brown fox jumps over the lazy dog.", accepted=[2] * 30)
    app = create_app(b, ServerConfig(), "demo")

    async def call() -> list[dict]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            body = {
                "model": "demo",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 8,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]

    chunks = asyncio.run(call())
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 8 and usage["spec"]["rounds"] >= 2
    assert usage["spec"]["mean_acceptance_length"] == pytest.approx(7 / usage["spec"]["rounds"])
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text.startswith("The quick")


def test_sigterm_stays_ours_after_sglang_starts_its_loop(make_backend: Any) -> None:
    """SGLang's TokenizerManager installs its own SIGTERM handler on the serving loop when it
    starts its output task; the server's drain handler must survive that."""
    import signal

    b, engine, _ = make_backend("a b c", accepted=[0])
    sglang_handler_calls: list[int] = []

    class LoopStartingTM(FakeTokenizerManager):
        event_loop = None

        def auto_create_handle_loop(self) -> None:  # what SGLang does (tokenizer_manager.py)
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGTERM, lambda: sglang_handler_calls.append(1))
            self.event_loop = loop

    tm = LoopStartingTM(engine)
    engine.tokenizer_manager = tm

    def drain_handler(signum: int, frame: Any) -> None:
        pass

    previous = signal.signal(signal.SIGTERM, drain_handler)
    try:
        outs = asyncio.run(_collect(b.generate("r", [5], SamplingParams(max_tokens=3))))
        assert outs[-1].finished and tm.event_loop is not None
        assert signal.getsignal(signal.SIGTERM) is drain_handler
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _no_sglang_in_sys_modules() -> Iterator[None]:
    yield
    assert not any(k == "sglang" or k.startswith("sglang.") for k in sys.modules)


def test_loading_sglang_source_leaves_no_trace(sg_root: Path) -> None:
    with _no_sglang_in_sys_modules():
        _import_sglang(sg_root, "sglang.srt.speculative.dspark_components.dspark_sts")


@pytest.mark.parametrize(
    "flag", [["--no-draft-gate"], ["--sps-only-cost"], ["--greedy-calibration", "g.json"]]
)
def test_native_only_flags_are_refused_with_the_sglang_backend(flag: list[str]) -> None:
    from dspark_server.cli import _sglang_config, build_parser

    args = build_parser().parse_args(["serve", "--backend", "sglang", *flag])
    with pytest.raises(SystemExit, match="only apply to the native engine"):
        _sglang_config(args)
