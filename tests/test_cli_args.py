"""The `dspark` flags: defaults come from the config dataclasses, every flag explains itself and
shows its default, and each command lists only the engine flags that apply to it."""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from dspark_server.cli import build_parser
from dspark_server.config import EngineConfig, SpeculativeConfig
from dspark_server.config_args import HelpFormatter, add_engine_args, engine_config_from_args, field_default


def _subparsers(parser: argparse.ArgumentParser, prefix: str = "") -> dict[str, argparse.ArgumentParser]:
    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out[prefix + name] = sub
                out.update(_subparsers(sub, prefix + name + " "))
    return out


COMMANDS = _subparsers(build_parser())


def test_no_flags_build_the_dataclass_defaults() -> None:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    cfg = engine_config_from_args(p.parse_args(["--model", "/m", "--spec-mode", "off"]))
    assert cfg == EngineConfig(model_dir="/m", spec=SpeculativeConfig(mode="off"))
    for f in fields(EngineConfig):
        if f.name not in ("model_dir", "spec", "num_threads"):
            assert getattr(cfg, f.name) == field_default(EngineConfig, f.name)


def test_flags_reach_the_config() -> None:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    flags = "--model /m --draft /d --gamma 3 --threshold 0.3 --max-running 5 --page-size 32"
    more = "--no-draft-gate --sps-only-cost --profile p.json --greedy-calibration g.json --no-fused-forward"
    more += " --weight-dtype bfloat16 --no-prefix-cache"
    ns = p.parse_args([*flags.split(), *more.split()])
    cfg = engine_config_from_args(ns)
    assert (cfg.draft_dir, cfg.max_running, cfg.page_size) == ("/d", 5, 32)
    assert not cfg.prefix_cache and engine_config_from_args(p.parse_args(flags.split())).prefix_cache
    assert (cfg.fused_forward, cfg.layer_kernels, cfg.weight_dtype) == (False, True, "bfloat16")
    assert engine_config_from_args(p.parse_args(flags.split())).weight_dtype == "auto"
    assert cfg.spec == SpeculativeConfig(
        mode="dspark",
        gamma=3,
        threshold=0.3,
        profile_path="p.json",
        greedy_calibration_path="g.json",
        draft_gate=False,
        price_step_overhead=False,
    )
    with pytest.raises(ValueError, match="needs a drafter"):
        engine_config_from_args(p.parse_args(["--model", "/m", "--spec-mode", "fixed"]))


def test_parser_defaults_are_the_dataclass_defaults() -> None:
    ns = build_parser().parse_args(["serve"])
    for name in (
        "max_model_len",
        "max_running",
        "max_queued",
        "max_batch_tokens",
        "prefill_chunk",
        "page_size",
    ):
        assert getattr(ns, name) == field_default(EngineConfig, name)
    assert ns.threshold == field_default(SpeculativeConfig, "threshold")


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_flag_has_help_and_shows_its_default(name: str) -> None:
    parser = COMMANDS[name]
    if name.startswith("train "):
        return  # the training modules own their flags
    assert parser.formatter_class is HelpFormatter or name == "train"
    formatter = HelpFormatter(parser.prog)
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        assert action.help, f"dspark {name} {action.option_strings[0]} has no help"
        shown = formatter._get_help_string(action) % {"default": action.default}
        if action.default not in (None, False, [], argparse.SUPPRESS) and not action.required:
            assert "default" in shown, f"dspark {name} {action.option_strings[0]}: {shown!r}"


@pytest.mark.parametrize("name", ["profile", "calibrate", "eval acceptance"])
def test_forced_mode_commands_list_only_the_flags_that_apply(name: str) -> None:
    flags = {s for a in COMMANDS[name]._actions for s in a.option_strings}
    assert {"--model", "--draft", "--gamma", "--max-batch-tokens"} <= flags
    for flag in (
        "--spec-mode",
        "--threshold",
        "--profile",
        "--calibration",
        "--no-draft-gate",
        "--max-queued",
    ):
        assert flag not in flags, f"dspark {name} lists {flag}, which does not apply to it"


def test_help_says_generate_and_the_server_default_temperatures_differ() -> None:
    text = " ".join(COMMANDS["generate"].format_help().split())
    assert "0 is greedy" in text and "server's default" in text
    top = build_parser().format_help()
    assert "OpenAI-compatible" in top and "ArgumentParser" not in top


def test_auto_weight_dtype_follows_the_environment_then_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """ "auto" (the default) serves bf16 weights where the CPU computes bf16 natively and the fused
    forward runs; $DSPARK_WEIGHT_DTYPE overrides it (the test suite pins float32); an explicit
    choice is kept."""
    import dspark_server.config as config

    monkeypatch.delenv("DSPARK_WEIGHT_DTYPE", raising=False)
    monkeypatch.delenv("DSPARK_KV_CACHE_DTYPE", raising=False)
    auto = EngineConfig(model_dir="/m")
    monkeypatch.setattr(config, "cpu_flags", lambda: "fpu sse avx512f avx512_bf16 avx512_vnni")
    assert auto.resolved_weight_dtype() == "bfloat16"
    assert auto.serving_dtype() == "float32+bfloat16-weights+bfloat16-kv"  # auto: the cache follows
    assert EngineConfig(model_dir="/m", fused_forward=False).resolved_weight_dtype() == "float32"
    assert EngineConfig(model_dir="/m", weight_dtype="float32").resolved_weight_dtype() == "float32"
    monkeypatch.setattr(config, "cpu_flags", lambda: "fpu sse avx2 avx512f")
    assert auto.resolved_weight_dtype() == "float32"
    assert auto.serving_dtype() == "float32"
    assert EngineConfig(model_dir="/m", weight_dtype="bfloat16").resolved_weight_dtype() == "bfloat16"
    monkeypatch.setenv("DSPARK_WEIGHT_DTYPE", "bfloat16")
    assert auto.resolved_weight_dtype() == "bfloat16"
