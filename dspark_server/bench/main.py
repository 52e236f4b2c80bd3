"""`dspark bench`: flags and dispatch to the suites. Light at import time (the CLI imports it to
build its parser); each suite imports torch / httpx / transformers only when it runs.

Suites (--suite):
  serving          TPS / latency / acceptance vs concurrency, modes side by side (default)
  peers            transformers generate() (plain, assisted, prompt lookup) vs our engine, concurrency 1;
                   with --llama-server: llama.cpp's server (plain, DSpark) vs ours at --concurrency
  oracle           record full-γ rounds, replay them through the planners and an oracle

The paper's figures and the docs page are repository tools, in a source checkout:
`python -m tools.paper --help`, `python -m tools.report --help` (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any, cast

from dspark_server.bench.common import BenchError, SuiteConfig, command_line, split_ints, split_list
from dspark_server.config import SPEC_MODES, EngineConfig, SpecMode

DEFAULT_MODES = ("off", "fixed", "threshold", "dspark")
SUITES = ("serving", "peers", "oracle")

log = logging.getLogger(__name__)


def add_bench_args(p: argparse.ArgumentParser, suites: tuple[str, ...] = SUITES) -> None:
    """Flags of `dspark bench` beyond the engine flags (``config_args.add_engine_args``)."""
    p.description = "Benchmarks. " + __doc__.split("\n\n", 1)[1]
    p.epilog = "Commands for every figure: benchmarks/README.md"
    g = p.add_argument_group("bench")
    g.add_argument("--suite", choices=suites, default=suites[0], help="what to measure")
    where = g.add_mutually_exclusive_group()
    where.add_argument(
        "--url",
        action="append",
        default=None,
        help="drive running server(s) (repeat or comma-separate; --modes labels them)",
    )
    where.add_argument(
        "--self-host",
        action="store_true",
        help="start one `dspark serve` per mode on loopback ports (default without --url)",
    )
    g.add_argument(
        "--modes",
        default=None,
        help="comma-separated spec modes (default: off,fixed,threshold,dspark; with --url: "
        "labels for the servers, default read from their /metrics)",
    )
    g.add_argument("--concurrency", default="1,4,16,64", help="comma-separated concurrency levels")
    g.add_argument(
        "--prompts",
        action="append",
        default=None,
        help='JSONL with {"turns": [...]} per line (repeat or comma-separate for several sets)',
    )
    g.add_argument("--limit", type=int, default=None, help="prompts per file")
    g.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="requests per run (default: max(prompts, 2 x concurrency); prompts are cycled)",
    )
    g.add_argument("--max-tokens", type=int, default=128, help="tokens generated per request at most")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every request")
    g.add_argument("--ignore-eos", action="store_true", help="every request generates --max-tokens")
    g.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="open loop: Poisson arrivals per second (--concurrency caps requests in flight)",
    )
    g.add_argument("--rounds", type=int, default=1, help="interleaved repetitions of the whole sweep")
    g.add_argument("--seed", type=int, default=0, help="seed of the request schedule and sampling")
    g.add_argument("--warmup", type=int, default=2, help="warm-up requests per server (not measured)")
    g.add_argument("--out", default=None, help="output directory (default: runs/bench/SUITE)")
    g.add_argument(
        "--server-policy",
        choices=("auto", "all", "restart"),
        default="auto",
        help="self-host: keep every mode's server up (all) or one at a time (restart)",
    )
    g.add_argument(
        "--server-arg",
        action="append",
        default=None,
        help="extra flag for the self-hosted `dspark serve` (repeat; e.g. --server-arg=--x)",
    )
    g.add_argument("--api-key", default=None, help="Bearer key for --url servers")
    g.add_argument("--request-timeout", type=float, default=900.0, help="seconds one request may take")
    g.add_argument("--no-plots", action="store_true", help="write no PNG figures")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g.add_argument("--no-assisted", action="store_true", help="peers: skip assisted generation")
    g.add_argument(
        "--assistant-layers",
        type=int,
        default=1,
        help="peers: layers of the assistant truncated from the target",
    )
    g.add_argument(
        "--record-concurrency",
        type=int,
        default=8,
        help="oracle / threshold-sweep: requests in flight while recording full-γ rounds",
    )
    g.add_argument("--rounds-file", default=None, help="oracle: replay a recorded rounds.json")
    g.add_argument(
        "--llama-server",
        default=None,
        help="peers: llama.cpp's llama-server binary; compares our servers with it at --concurrency "
        "(plain, and DSpark with the drafter) instead of transformers",
    )
    g.add_argument(
        "--llama-converter",
        default=None,
        help="peers: llama.cpp's convert_hf_to_gguf.py (default: the one of the binary's source tree)",
    )
    g.add_argument(
        "--llama-outtype",
        choices=("f32", "bf16", "f16", "q8_0"),
        default=None,
        help="peers: GGUF weight type for llama.cpp (default: the weights our engine serves, bf16 or "
        "f32, for a like-for-like comparison)",
    )
    g.add_argument(
        "--llama-pre-tokenizer",
        default="qwen2",
        help="peers: BPE pre-tokenizer the GGUF converter is told the tokenizer uses",
    )


def _prompt_files(a: argparse.Namespace) -> list[str]:
    files = [f for item in (a.prompts or []) for f in split_list(item)]
    if not files:
        raise BenchError(f"--suite {a.suite} needs --prompts FILE.jsonl")
    return files


def _out(a: argparse.Namespace, name: str) -> str:
    return a.out or f"runs/bench/{name}"


def serving_config(a: argparse.Namespace, out: str | None = None) -> Any:
    from dspark_server.bench.serving import ServingConfig, server_args_from_namespace

    concurrency = split_ints(a.concurrency)
    urls = [u for item in (a.url or []) for u in split_list(item)]
    modes = split_list(a.modes) if a.modes else ([] if urls else list(DEFAULT_MODES))
    if not urls:
        bad = [m for m in modes if m not in SPEC_MODES]
        if bad or not modes:
            raise BenchError(f"--modes must be a comma-separated subset of {SPEC_MODES}, got {a.modes!r}")
    return ServingConfig(
        prompt_files=tuple(_prompt_files(a)),
        concurrency=tuple(concurrency),
        out=out or _out(a, "serving"),
        modes=tuple(modes),
        urls=tuple(urls),
        limit=a.limit,
        num_requests=a.num_requests,
        max_tokens=a.max_tokens,
        temperature=a.temperature,
        ignore_eos=a.ignore_eos,
        request_rate=a.request_rate,
        rounds=a.rounds,
        seed=a.seed,
        warmup_requests=a.warmup,
        server_args=tuple(server_args_from_namespace(a, max(concurrency))) if not urls else (),
        server_policy=a.server_policy,
        api_key=a.api_key,
        request_timeout_s=a.request_timeout,
        progress=not a.quiet,
        plots=not a.no_plots,
        command=command_line(getattr(a, "argv", None)),
    )


def run_bench_command(a: argparse.Namespace) -> int:
    """Entry point of `dspark bench`; returns the exit code (1 with a message on BenchError)."""
    try:
        _dispatch(a)
    except BenchError as exc:
        print(f"dspark bench: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _dispatch(a: argparse.Namespace) -> None:
    suite = a.suite
    if suite == "serving":
        from dspark_server.bench.render import serving_markdown
        from dspark_server.bench.serving import run_serving

        cfg = serving_config(a)
        result = run_serving(cfg)
        print(serving_markdown(result))
        print(f"wrote {cfg.out}/results.json", file=sys.stderr)
    elif suite == "peers" and a.llama_server:
        from dspark_server.bench.llama_cpp import LlamaPeerConfig, run_llama_peers
        from dspark_server.bench.serving import server_args_from_namespace

        concurrency = tuple(split_ints(a.concurrency))
        run_llama_peers(
            LlamaPeerConfig(
                suite=suite_config(a, "peers"),
                server_binary=a.llama_server,
                converter=a.llama_converter,
                pre_tokenizer=a.llama_pre_tokenizer,
                outtype=a.llama_outtype or _gguf_type_of_ours(a),
                concurrency=concurrency,
                modes=_spec_modes(a.modes, ("off", "dspark")),
                server_args=tuple(server_args_from_namespace(a, max(concurrency))),
                warmup_requests=a.warmup,
            )
        )
    elif suite == "peers":
        from dspark_server.bench.peers import PeersConfig, run_peers

        run_peers(
            PeersConfig(
                suite=suite_config(a, "peers"),
                modes=_spec_modes(a.modes, ("off", "dspark")),
                assisted=not a.no_assisted,
                assistant_layers=a.assistant_layers,
            )
        )
    elif suite == "oracle":
        from dspark_server.bench.oracle import OracleConfig, run_oracle

        cfg = suite_config(a, "oracle", prompts=not a.rounds_file)
        run_oracle(
            OracleConfig(suite=cfg, concurrency=tuple(split_ints(a.concurrency)), rounds_file=a.rounds_file)
        )


def _spec_modes(text: str | None, default: tuple[SpecMode, ...]) -> tuple[SpecMode, ...]:
    modes = split_list(text)
    bad = [m for m in modes if m not in SPEC_MODES]
    if bad:
        raise BenchError(f"--modes must be a comma-separated subset of {SPEC_MODES}, got {text!r}")
    return tuple(cast(SpecMode, m) for m in modes) or default


def suite_config(a: argparse.Namespace, name: str, prompts: bool = True, **engine: Any) -> SuiteConfig:
    """The typed settings of an in-process suite from `dspark bench` flags (``engine``: overrides
    passed to ``engine_config_from_args``, e.g. ``spec_mode``)."""
    from dspark_server.config_args import engine_config_from_args

    try:
        engine_cfg = engine_config_from_args(a, **engine)
    except ValueError as exc:
        raise BenchError(str(exc)) from None
    return SuiteConfig(
        engine=engine_cfg,
        prompt_files=tuple(_prompt_files(a)) if prompts else (),
        out=_out(a, name),
        limit=a.limit,
        max_tokens=a.max_tokens,
        temperature=a.temperature,
        seed=a.seed,
        rounds=a.rounds,
        ignore_eos=a.ignore_eos,
        record_concurrency=a.record_concurrency,
        progress=not a.quiet,
        plots=not a.no_plots,
        command=command_line(getattr(a, "argv", None)),
    )


def bench_parser(prog: str = "dspark bench", suites: tuple[str, ...] = SUITES) -> argparse.ArgumentParser:
    from dspark_server.config_args import HelpFormatter, add_engine_args

    p = argparse.ArgumentParser(prog=prog, formatter_class=HelpFormatter)
    add_engine_args(p)
    add_bench_args(p, suites)
    return p


def main(argv: list[str]) -> int:
    """`dspark bench ARGS` in-process (tests): the command line is recorded as given."""
    a = bench_parser().parse_args(argv)
    a.argv = ["bench", *argv]
    return run_bench_command(a)


def _gguf_type_of_ours(a: argparse.Namespace) -> str:
    """The GGUF weight type of the weights our servers will serve (--weight-dtype, resolved)."""
    ours = EngineConfig(model_dir=a.model or "", weight_dtype=a.weight_dtype or "auto")
    return "bf16" if ours.resolved_weight_dtype() == "bfloat16" else "f32"
