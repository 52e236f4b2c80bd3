"""The ``dspark`` command: parses flags and hands frozen configs to the modules that do the work."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from dspark_server.config import SPEC_MODES, EngineConfig, ServerConfig, SpeculativeConfig


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="target model directory (default: bundled demo)")
    p.add_argument("--draft", default=None, help="DSpark drafter directory (default: bundled demo)")
    p.add_argument("--spec-mode", choices=SPEC_MODES, default=None,
                   help="speculation: off | fixed | threshold | dspark (default: dspark with a "
                        "drafter, off without)")
    p.add_argument("--gamma", type=int, default=None, help="draft block size (default: drafter's)")
    p.add_argument("--threshold", type=float, default=0.5, help="threshold mode's survival cut-off")
    p.add_argument("--profile", default=None, help="SPS cost table JSON")
    p.add_argument("--calibration", default=None, help="STS calibration JSON")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--max-queued", type=int, default=256)
    p.add_argument("--max-batch-tokens", type=int, default=512)
    p.add_argument("--prefill-chunk", type=int, default=256)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def _engine_config(a: argparse.Namespace) -> EngineConfig:
    from dspark_server.assets import default_draft, default_target

    model = a.model or default_target()
    draft = a.draft if a.draft else (default_draft() if a.model is None else None)
    mode = a.spec_mode or ("dspark" if draft else "off")
    if mode != "off" and not draft:
        raise SystemExit(f"error: --spec-mode {mode} needs a drafter (--draft DIR)")
    spec = SpeculativeConfig(mode=mode, gamma=a.gamma, threshold=a.threshold,
                             profile_path=a.profile, calibration_path=a.calibration)
    return EngineConfig(model_dir=model, draft_dir=draft if mode != "off" else None, dtype=a.dtype,
                        page_size=a.page_size, num_pages=a.num_pages, max_model_len=a.max_model_len,
                        max_running=a.max_running, max_queued=a.max_queued,
                        max_batch_tokens=a.max_batch_tokens, prefill_chunk=a.prefill_chunk,
                        num_threads=a.threads, spec=spec)


def cmd_serve(a: argparse.Namespace) -> None:
    from dspark_server.engine.engine import LLMEngine
    from dspark_server.engine.loop import NativeBackend
    from dspark_server.server.serve import run_server

    cfg = _engine_config(a)
    server_cfg = ServerConfig(host=a.host, port=a.port,
                              api_key=a.api_key or os.environ.get("DSPARK_API_KEY") or None,
                              served_model_name=a.served_model_name, drain_timeout_s=a.drain_timeout)
    name = a.served_model_name or Path(cfg.model_dir).name
    run_server(NativeBackend(LLMEngine(cfg)), server_cfg, name)


def cmd_generate(a: argparse.Namespace) -> None:
    from dspark_server.engine.engine import LLMEngine
    from dspark_server.offline import GenerateConfig, generate, write_jsonl

    engine = LLMEngine(_engine_config(a))
    gen = GenerateConfig(prompts=a.prompts, limit=a.limit, max_tokens=a.max_tokens,
                         temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed,
                         concurrency=a.concurrency, progress=not a.quiet)
    write_jsonl(generate(engine, gen), sys.stdout)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' "
                                                       "(or set DSPARK_API_KEY)")
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--drain-timeout", type=float, default=30.0,
                       help="seconds in-flight requests get to finish after SIGTERM")
    serve.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="offline batch generation from a prompts JSONL file")
    _engine_args(gen)
    gen.add_argument("--prompts", required=True, help='JSONL with {"turns": [...]} per line')
    gen.add_argument("--limit", type=int, default=None)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--concurrency", type=int, default=1)
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
