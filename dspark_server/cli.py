"""The ``dspark`` command: parses flags and hands frozen configs to the modules that do the work."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dspark_server.config import EngineConfig, ServerConfig
from dspark_server.config_args import HelpFormatter, add_engine_args, engine_config_from_args, field_default

if TYPE_CHECKING:
    from dspark_server.backends.sglang_args import SGLangConfig
    from dspark_server.offline import GenerateConfig


DESCRIPTION = """\
An OpenAI-compatible LLM server with DSpark speculative decoding: a drafter proposes blocks of
tokens with confidences and a load-aware planner decides how many each request verifies.
Without --model, the bundled demo model pair is used (runs on a CPU, no download).

  dspark serve                      serve http://127.0.0.1:8000/v1 (chat and completions)
  dspark generate --prompts F       complete a JSONL file of prompts offline
  dspark COMMAND --help             the flags of one command
"""


def _backend_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--backend",
        choices=("native", "sglang"),
        default="native",
        help="native: the built-in engine (CPU); sglang: SGLang 0.5.23's engine on NVIDIA "
        "GPUs (docs/sglang.md)",
    )
    g = p.add_argument_group("SGLang backend (--backend sglang)")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs")
    g.add_argument(
        "--mem-fraction",
        type=float,
        default=None,
        help="GPU memory share for weights + KV cache (SGLang's mem_fraction_static)",
    )
    g.add_argument(
        "--attention-backend", default=None, help="SGLang attention backend (fa3, flashinfer, triton, ...)"
    )
    g.add_argument("--random-seed", type=int, default=None, help="SGLang's server-wide random seed")
    g.add_argument(
        "--deterministic",
        action="store_true",
        help="SGLang deterministic inference (per-request seeds take effect)",
    )
    g.add_argument("--sglang-metrics", action="store_true", help="also enable SGLang's own sglang:* metrics")
    g.add_argument(
        "--sglang-arg",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="any other SGLang ServerArgs field (repeatable)",
    )


def _sglang_config(a: argparse.Namespace, spec_mode: str | None = None) -> SGLangConfig:
    from dspark_server.assets import default_draft, default_target
    from dspark_server.backends.sglang_args import SGLangConfig, parse_extra_server_args

    flags = (
        ("--no-draft-gate", getattr(a, "no_draft_gate", False)),
        ("--sps-only-cost", getattr(a, "sps_only_cost", False)),
        ("--no-prompt-lookup", getattr(a, "no_prompt_lookup", False)),
        ("--no-online-calibration", getattr(a, "no_online_calibration", False)),
        ("--greedy-calibration", getattr(a, "greedy_calibration", None)),
    )
    native_only = [flag for flag, on in flags if on]
    if native_only:
        raise SystemExit(
            f"error: {', '.join(native_only)} only apply to the native engine: SGLang plans "
            "with its own SPS cost model and one STS file (docs/sglang.md)"
        )
    model = a.model or default_target()
    draft = a.draft if a.draft else (default_draft() if a.model is None else None)
    mode = spec_mode or getattr(a, "spec_mode", None) or ("dspark" if draft else "off")
    try:
        return SGLangConfig(
            model_path=model,
            draft_path=draft if mode != "off" else None,
            spec_mode=mode,
            gamma=a.gamma,
            sps_table_path=getattr(a, "profile", None),
            sts_path=getattr(a, "calibration", None),
            tp_size=a.tp,
            dtype=a.dtype or "auto",
            max_model_len=a.max_model_len,
            max_running=a.max_running,
            max_queued=getattr(a, "max_queued", field_default(EngineConfig, "max_queued")),
            mem_fraction_static=a.mem_fraction,
            attention_backend=a.attention_backend,
            random_seed=a.random_seed,
            deterministic=a.deterministic,
            enable_metrics=a.sglang_metrics,
            prefix_cache=not getattr(a, "no_prefix_cache", False),
            extra_server_args=parse_extra_server_args(a.sglang_arg),
        )
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None


def _require_sglang() -> None:
    """Refuse before the port opens, with one line instead of a traceback."""
    from dspark_server.backends.sglang_runtime import SGLangUnavailableError, require_sglang_runtime

    try:
        require_sglang_runtime()
    except SGLangUnavailableError as exc:
        raise SystemExit(f"error: {exc}") from None


def _engine_config(a: argparse.Namespace) -> EngineConfig:
    try:
        return engine_config_from_args(a, variant=getattr(a, "variant", None))
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None


# ServerConfig fields with a flag of their own: (flag, field, type, help); defaults from the dataclass.
_SERVER_LIMITS: tuple[tuple[str, str, type, str], ...] = (
    (
        "--max-prompt-chars",
        "max_prompt_chars",
        int,
        "prompts with more characters get 413 before tokenizing (default: only the model's bound, "
        "max-model-len x the longest token, a 400)",
    ),
    ("--header-timeout", "header_timeout_s", float, "seconds a request's headers may take (then 408)"),
    ("--body-timeout", "body_timeout_s", float, "seconds a request's body may take after its headers"),
    ("--idle-timeout", "idle_timeout_s", float, "seconds a kept-alive connection may sit idle"),
    ("--max-connections", "max_connections", int, "open connections beyond this get 503"),
    ("--sse-keepalive", "sse_keepalive_s", float, "seconds between SSE keep-alive comments while idle"),
    (
        "--queue-timeout",
        "queue_timeout_s",
        float,
        "seconds a request may wait for its first token (then it ends with a queue_timeout error)",
    ),
)


def cmd_serve(a: argparse.Namespace) -> None:
    from dspark_server.server.serve import run_server

    if a.max_running < 1 or a.max_queued < 0 or a.max_model_len < 2 or a.max_body_bytes < 1024:
        raise SystemExit(
            "error: need --max-running >= 1, --max-queued >= 0, --max-model-len >= 2 "
            "and --max-body-bytes >= 1024"
        )
    cfg = _engine_config(a) if a.backend == "native" else None
    server_cfg = ServerConfig(
        host=a.host,
        port=a.port,
        api_key=a.api_key or os.environ.get("DSPARK_API_KEY") or None,
        served_model_name=a.served_model_name,
        drain_timeout_s=a.drain_timeout,
        max_body_bytes=a.max_body_bytes,
        **{name: getattr(a, name) for _, name, _, _ in _SERVER_LIMITS},
    )
    if a.backend == "sglang":
        scfg = _sglang_config(a)
        _require_sglang()

        def make_sglang_backend():  # loader thread, like the native one
            from dspark_server.backends.sglang import SGLangBackend

            return SGLangBackend(scfg)

        run_server(make_sglang_backend, server_cfg, a.served_model_name or Path(scfg.model_path).name)
        return
    assert cfg is not None
    name = a.served_model_name or Path(cfg.model_dir).name

    def make_backend():  # runs on a loader thread while the port is already open (/ready: 503)
        if a.engine_process:
            from dspark_server.engine.process import EngineProcessBackend

            return EngineProcessBackend(cfg)
        from dspark_server.engine.engine import LLMEngine
        from dspark_server.engine.loop import NativeBackend

        return NativeBackend(LLMEngine(cfg))

    run_server(make_backend, server_cfg, name)


def cmd_generate(a: argparse.Namespace) -> None:
    from dspark_server.engine.engine import LLMEngine
    from dspark_server.offline import generate, write_jsonl

    engine = LLMEngine(_engine_config(a))
    write_jsonl(generate(engine, _generate_config(a)), sys.stdout)


def _generate_config(a: argparse.Namespace) -> GenerateConfig:
    from dspark_server.offline import GenerateConfig

    return GenerateConfig(
        prompts=a.prompts,
        limit=a.limit,
        max_tokens=a.max_tokens,
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=a.top_k,
        seed=a.seed,
        concurrency=a.concurrency,
        progress=not a.quiet,
    )


def cmd_profile(a: argparse.Namespace) -> None:
    if a.backend == "sglang":
        from dspark_server.jobs.profile_sglang import SGLangProfileConfig, run_sglang_profile

        scfg = _sglang_config(a, spec_mode="dspark")  # SGLang's table times its DSpark verify step
        _require_sglang()
        sizes = tuple(int(x) for x in a.batch_sizes.split(",")) if a.batch_sizes else None
        table, out = run_sglang_profile(
            SGLangProfileConfig(
                server=scfg,
                out=a.out,
                max_batch_size=a.max_running,
                batch_sizes=sizes,
                repeats=a.repeats or 1,
                min_steady_seconds=a.min_steady_seconds,
            )
        )
    else:
        from dspark_server.jobs.profile import ProfileConfig, run_profile

        table, out = run_profile(
            ProfileConfig(
                engine=_engine_config(a),
                out=a.out,
                max_batch_tokens=a.max_batch_tokens,
                repeats=a.repeats or 7,
            )
        )
    top = table.max_batch_tokens
    print(
        f"wrote {out} ({len(table.sample_batch_tokens)} probes, SPS(1) = {table.lookup(1):.1f}, "
        f"SPS({top}) = {table.lookup(top):.1f})"
    )


def cmd_calibrate(a: argparse.Namespace) -> None:
    from dspark_server.jobs.calibrate import CalibrateConfig, run_calibration, run_evaluation

    cfg = CalibrateConfig(
        engine=_engine_config(a), generate=_generate_config(a), out=a.out, evaluate=a.evaluate
    )
    if cfg.evaluate is not None:
        run_evaluation(cfg)
    else:
        run_calibration(cfg)


def cmd_eval_acceptance(a: argparse.Namespace) -> None:
    import json

    from dspark_server.jobs.acceptance import AcceptanceConfig, run_acceptance

    result = run_acceptance(
        AcceptanceConfig(engine=_engine_config(a), generate=_generate_config(a), out_dir=a.out)
    )
    print(json.dumps(result, indent=2))


def cmd_bench(a: argparse.Namespace) -> None:
    from dspark_server.bench.main import run_bench_command

    raise SystemExit(run_bench_command(a))


TRAIN_MODULES = {"target": "target_train", "draft": "draft_train", "demo": "demo", "widen": "widen"}


def cmd_train(a: argparse.Namespace) -> None:
    import importlib

    code = importlib.import_module(f"dspark_server.training.{TRAIN_MODULES[a.what]}").main(a.args)
    raise SystemExit(code or 0)


def _generation_args(p: argparse.ArgumentParser, max_tokens: int = 128, concurrency: int = 1) -> None:
    g = p.add_argument_group("generation")
    g.add_argument("--prompts", required=True, help='JSONL file with {"turns": [...]} per line')
    g.add_argument("--limit", type=int, default=None, help="first N prompts only (default: all)")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens generated per prompt at most")
    g.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature; 0 is greedy. Note: the server's default, like OpenAI's, is 1",
    )
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    g.add_argument("--top-k", type=int, default=0, help="sample from the K likeliest tokens (0: off)")
    g.add_argument("--seed", type=int, default=None, help="seed of request i is SEED + i (default: random)")
    g.add_argument("--concurrency", type=int, default=concurrency, help="prompts in flight together")
    g.add_argument("--quiet", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description=DESCRIPTION, formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(parent: Any, name: str, doc: str, **kw: Any) -> argparse.ArgumentParser:
        return parent.add_parser(name, help=doc, description=doc, formatter_class=HelpFormatter, **kw)

    serve = command(sub, "serve", "OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions)")
    add_engine_args(serve)
    serve.add_argument("--host", default=field_default(ServerConfig, "host"), help="address to listen on")
    serve.add_argument(
        "--port", type=int, default=field_default(ServerConfig, "port"), help="port to listen on"
    )
    serve.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the native engine in a process of its own, apart from the HTTP event loop "
        "(--no-engine-process: on a thread of the server's process)",
    )
    serve.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' (or set DSPARK_API_KEY)"
    )
    serve.add_argument(
        "--served-model-name", default=None, help="model name clients send (default: the model directory's)"
    )
    serve.add_argument(
        "--drain-timeout",
        type=float,
        default=field_default(ServerConfig, "drain_timeout_s"),
        help="seconds in-flight requests get to finish after SIGTERM",
    )
    serve.add_argument(
        "--max-body-bytes",
        type=int,
        default=field_default(ServerConfig, "max_body_bytes"),
        help="larger request bodies get 413",
    )
    for flag, name, type_, doc in _SERVER_LIMITS:
        serve.add_argument(flag, dest=name, type=type_, default=field_default(ServerConfig, name), help=doc)
    _backend_args(serve)
    serve.set_defaults(func=cmd_serve)

    gen = command(sub, "generate", "offline batch generation: one JSON line per prompt on stdout")
    add_engine_args(gen)
    _generation_args(gen)
    gen.set_defaults(func=cmd_generate)

    prof = command(sub, "profile", "measure the SPS cost table of the target on this machine")
    add_engine_args(prof, speculation="gamma", serving=False)
    prof.add_argument("--out", default=None, help="table JSON (default: profiles/MODEL__CPU__Nt.json)")
    prof.add_argument("--repeats", type=int, default=None, help="default: 7 (native), 1 (sglang)")
    _backend_args(prof)
    prof.add_argument(
        "--batch-sizes",
        default=None,
        help="sglang: running-request counts to sweep, e.g. 1,4,16 (default: SGLang's sweep "
        "up to --max-running)",
    )
    prof.add_argument(
        "--min-steady-seconds",
        type=float,
        default=10.0,
        help="sglang: seconds each batch size is held at steady state",
    )
    prof.set_defaults(func=cmd_profile, spec_mode="off")

    cal = command(sub, "calibrate", "fit STS confidence temperatures from full-γ rounds")
    add_engine_args(cal, speculation="gamma", serving=False)
    _generation_args(cal, max_tokens=96, concurrency=8)
    cal.add_argument(
        "--out",
        required=True,
        help="calibration JSON (a reliability PNG goes beside it); with --evaluate: the report JSON",
    )
    cal.add_argument(
        "--evaluate",
        metavar="CALIBRATION",
        default=None,
        help="fit nothing: measure this calibration file's per-position ECE on the rounds "
        "(prompts it was not fit on), merged per temperature into the report at --out",
    )
    cal.set_defaults(func=cmd_calibrate)

    ev = command(sub, "eval", "offline evaluations")
    ev_sub = ev.add_subparsers(dest="evaluation", required=True)
    acc = command(ev_sub, "acceptance", "τ and per-position acceptance, one request at a time")
    add_engine_args(acc, speculation="gamma", serving=False)
    _generation_args(acc)
    acc.add_argument(
        "--variant",
        choices=("markov", "rnn", "none"),
        default=None,
        help="bundled demo drafter variant (default: the shipped drafter)",
    )
    acc.add_argument("--out", default=None, help="directory for acceptance.json and acceptance.png")
    acc.set_defaults(func=cmd_eval_acceptance)

    bench = command(
        sub, "bench", "benchmarks: TPS vs concurrency by mode, peers, oracle replay (docs/benchmarks.md)"
    )
    add_engine_args(bench)  # for --self-host servers and the in-process suites
    from dspark_server.bench.main import add_bench_args

    add_bench_args(bench)
    bench.set_defaults(func=cmd_bench)

    train = command(sub, "train", "train the demo models (see docs/models.md)")
    train_sub = train.add_subparsers(dest="what", required=True)
    for what, doc in (
        ("target", "the demo target (corpus, tokenizer and Qwen3 model)"),
        ("draft", "a DSpark drafter against a frozen target (self-distillation)"),
        ("demo", "the whole demo pair, end to end"),
        ("widen", "a K-times wider twin of a target and drafter with the same outputs"),
    ):
        t = train_sub.add_parser(what, help=doc, add_help=False)
        t.add_argument("args", nargs=argparse.REMAINDER, help="options of the training module")
        t.set_defaults(func=cmd_train)
    return parser


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) >= 2 and argv[0] == "train" and argv[1] in TRAIN_MODULES:
        # The training modules own their flags (`dspark train draft --help` shows them).
        cmd_train(argparse.Namespace(what=argv[1], args=argv[2:]))
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
