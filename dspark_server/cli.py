"""The ``dspark`` command: parses flags and hands frozen configs to the modules that do the work."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from dspark_server.config import SPEC_MODES, EngineConfig, ServerConfig, SpeculativeConfig

if TYPE_CHECKING:
    from dspark_server.backends.sglang_args import SGLangConfig
    from dspark_server.offline import GenerateConfig


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="target model directory (default: bundled demo)")
    p.add_argument("--draft", default=None, help="DSpark drafter directory (default: bundled demo)")
    p.add_argument(
        "--spec-mode",
        choices=SPEC_MODES,
        default=None,
        help="speculation: off | fixed | threshold | dspark (default: dspark with a drafter, off without)",
    )
    p.add_argument("--gamma", type=int, default=None, help="draft block size (default: drafter's)")
    p.add_argument("--threshold", type=float, default=0.5, help="threshold mode's survival cut-off")
    p.add_argument("--profile", default=None, help="SPS cost table JSON")
    p.add_argument("--calibration", default=None, help="STS calibration JSON (sampled requests)")
    p.add_argument(
        "--greedy-calibration",
        default=None,
        help="STS calibration JSON for temperature-0 requests (default: the drafter's "
        "sts_calibration_greedy.json, else --calibration)",
    )
    p.add_argument(
        "--no-draft-gate",
        action="store_true",
        help="dspark mode: always draft, even at loads where plain steps measure faster",
    )
    p.add_argument(
        "--sps-only-cost",
        action="store_true",
        help="dspark mode: price a step by SPS(B) alone (the paper's cost model), leaving out "
        "the measured draft and bookkeeping time",
    )
    p.add_argument("--dtype", default=None, help="default: float32 (native), auto (sglang)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--max-queued", type=int, default=256)
    p.add_argument("--max-batch-tokens", type=int, default=512)
    p.add_argument("--prefill-chunk", type=int, default=256)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")


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
    mode = spec_mode or a.spec_mode or ("dspark" if draft else "off")
    try:
        return SGLangConfig(
            model_path=model,
            draft_path=draft if mode != "off" else None,
            spec_mode=mode,
            gamma=a.gamma,
            sps_table_path=a.profile,
            sts_path=a.calibration,
            tp_size=a.tp,
            dtype=a.dtype or "auto",
            max_model_len=a.max_model_len,
            max_running=a.max_running,
            max_queued=a.max_queued,
            mem_fraction_static=a.mem_fraction,
            attention_backend=a.attention_backend,
            random_seed=a.random_seed,
            deterministic=a.deterministic,
            enable_metrics=a.sglang_metrics,
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
    from dspark_server.assets import default_draft, default_target

    model = a.model or default_target()
    draft = a.draft if a.draft else (default_draft(getattr(a, "variant", None)) if a.model is None else None)
    mode = a.spec_mode or ("dspark" if draft else "off")
    if mode != "off" and not draft:
        raise SystemExit(f"error: --spec-mode {mode} needs a drafter (--draft DIR)")
    spec = SpeculativeConfig(
        mode=mode,
        gamma=a.gamma,
        draft_gate=not a.no_draft_gate,
        price_step_overhead=not a.sps_only_cost,
        threshold=a.threshold,
        profile_path=a.profile,
        calibration_path=a.calibration,
        greedy_calibration_path=a.greedy_calibration,
    )
    return EngineConfig(
        model_dir=model,
        draft_dir=draft if mode != "off" else None,
        dtype=a.dtype or "float32",
        page_size=a.page_size,
        num_pages=a.num_pages,
        max_model_len=a.max_model_len,
        max_running=a.max_running,
        max_queued=a.max_queued,
        max_batch_tokens=a.max_batch_tokens,
        prefill_chunk=a.prefill_chunk,
        num_threads=a.threads,
        spec=spec,
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
    from dspark_server.jobs.calibrate import CalibrateConfig, run_calibration

    run_calibration(CalibrateConfig(engine=_engine_config(a), generate=_generate_config(a), out=a.out))


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
    p.add_argument("--prompts", required=True, help='JSONL with {"turns": [...]} per line')
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--concurrency", type=int, default=concurrency)
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' (or set DSPARK_API_KEY)"
    )
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGTERM",
    )
    serve.add_argument(
        "--max-body-bytes",
        type=int,
        default=ServerConfig.max_body_bytes,
        help="larger request bodies get 413",
    )
    _backend_args(serve)
    serve.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="offline batch generation from a prompts JSONL file")
    _engine_args(gen)
    _generation_args(gen)
    gen.set_defaults(func=cmd_generate)

    prof = sub.add_parser("profile", help="measure the SPS cost table of the target on this machine")
    _engine_args(prof)
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

    cal = sub.add_parser("calibrate", help="fit STS confidence temperatures from full-γ rounds")
    _engine_args(cal)
    _generation_args(cal, max_tokens=96, concurrency=8)
    cal.add_argument("--out", required=True, help="calibration JSON (a reliability PNG goes beside it)")
    cal.set_defaults(func=cmd_calibrate)

    ev = sub.add_parser("eval", help="offline evaluations")
    ev_sub = ev.add_subparsers(dest="evaluation", required=True)
    acc = ev_sub.add_parser("acceptance", help="τ and per-position acceptance, one request at a time")
    _engine_args(acc)
    _generation_args(acc)
    acc.add_argument(
        "--variant",
        choices=("markov", "rnn", "none"),
        default=None,
        help="bundled demo drafter variant (default: the shipped drafter)",
    )
    acc.add_argument("--out", default=None, help="directory for acceptance.json and acceptance.png")
    acc.set_defaults(func=cmd_eval_acceptance)

    bench = sub.add_parser(
        "bench",
        help="benchmarks: TPS vs concurrency by mode, peers, oracle replay, "
        "paper figures (docs/benchmarks.md)",
    )
    _engine_args(bench)  # for --self-host servers and the in-process suites
    from dspark_server.bench.main import add_bench_args

    add_bench_args(bench)
    bench.set_defaults(func=cmd_bench)

    train = sub.add_parser("train", help="train the demo models (see docs/models.md)")
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
