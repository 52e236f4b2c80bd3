"""Serving benchmark: closed-loop concurrency sweeps (and Poisson open loop) over the OpenAI
streaming API, modes side by side.

    dspark bench --self-host --modes off,fixed,threshold,dspark --concurrency 1,16,64 \\
        --prompts humaneval.jsonl,mt-bench.jsonl --rounds 2 --out runs/bench
    dspark bench --url http://127.0.0.1:8000 --concurrency 1,4 --prompts p.jsonl

What it measures, per (prompt set, mode, concurrency):
  * output tokens/s and requests/s over the run's wall time (first request sent to last one
    finished, prefill included), median over ``--rounds``; a run sends max(prompts, 2 × concurrency)
    requests (prompts cycled) unless ``--num-requests`` says otherwise;
  * TTFT / TPOT / ITL / end-to-end latency p50/p90/p99 seen by the client (ITL: time between
    successive content chunks; a speculative round that emits several tokens is one chunk);
  * from ``/metrics`` deltas: mean acceptance length (tokens emitted per round), mean verified
    drafts per request per step (Σℓ / rounds), mean verification budget per step (Σℓ per step).

Output tokens are counted from the server's ``usage.completion_tokens`` (token ids), never from
text; with a self-hosted server the harness also checks that they add up to the server's
``dspark_generation_tokens_total`` delta. Any failed request (HTTP error, an error event, a
stream without usage or ``[DONE]``) stops the sweep with :class:`BenchError`.

``--self-host`` starts one ``dspark serve`` per mode on a loopback port and interleaves the modes
(A B C D, then rotated, per round and concurrency) so machine drift hits every mode alike. Idle
servers cost no CPU, so by default all of them stay up for the whole sweep; ``--server-policy
restart`` starts one at a time instead (interleaving then happens per round).
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dspark_server.bench.common import (
    BenchError,
    PromptSet,
    latency_stats,
    load_prompt_sets,
    machine_info,
    write_json,
)
from dspark_server.bench.load_client import RequestResult, chat_payload, run_load
from dspark_server.bench.managed_server import ManagedServer, available_memory
from dspark_server.bench.server_metrics import (
    COUNTERS,
    derived_from_deltas,
    detect_mode,
    metric_deltas,
    scrape,
)
from dspark_server.bench.serving_config import REQUESTS_PER_SLOT, ServingConfig

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# The sweep


@dataclass
class _Target:
    mode: str
    base_url: str
    server: ManagedServer | None = None


def _schedule(
    cfg: ServingConfig, sets: Sequence[PromptSet], modes: Sequence[str]
) -> Iterator[tuple[int, PromptSet, int, str]]:
    """(round, prompt set, concurrency, mode), modes innermost and rotated by round."""
    for rnd in range(cfg.rounds):
        order = list(modes[rnd % len(modes) :]) + list(modes[: rnd % len(modes)])
        for ps in sets:
            for c in cfg.concurrency:
                for mode in order:
                    yield rnd, ps, c, mode


def _restart_schedule(
    cfg: ServingConfig, sets: Sequence[PromptSet], modes: Sequence[str]
) -> Iterator[tuple[int, PromptSet, int, str]]:
    """One server at a time: (round, mode) outermost, mode order rotated by round."""
    for rnd in range(cfg.rounds):
        order = list(modes[rnd % len(modes) :]) + list(modes[: rnd % len(modes)])
        for mode in order:
            for ps in sets:
                for c in cfg.concurrency:
                    yield rnd, ps, c, mode


def run_serving(cfg: ServingConfig) -> dict[str, Any]:
    """The whole sweep; writes ``out/results.json`` (+ results.md and PNGs) and returns it."""
    return asyncio.run(_run_serving(cfg))


async def _run_serving(cfg: ServingConfig) -> dict[str, Any]:
    import httpx
    from tqdm import tqdm

    if cfg.rounds < 1:
        raise BenchError("--rounds must be >= 1")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    if not cfg.concurrency or min(cfg.concurrency) < 1:
        raise BenchError("--concurrency needs values >= 1")
    sets = load_prompt_sets(cfg.prompt_files, cfg.limit)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
    limits = httpx.Limits(
        max_connections=max(cfg.concurrency) + 8, max_keepalive_connections=max(cfg.concurrency) + 8
    )
    timeout = httpx.Timeout(cfg.request_timeout_s, connect=30.0)
    machine = machine_info()
    targets: dict[str, _Target] = {}
    self_host = not cfg.urls
    policy = cfg.server_policy
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers) as client:
        try:
            if self_host:
                modes = list(cfg.modes)
                if len(set(modes)) != len(modes):
                    raise BenchError(f"--modes lists a mode twice: {modes}")
                if policy == "auto":
                    avail = available_memory()
                    policy = "all" if avail is None or avail > len(modes) * (2 << 30) else "restart"
                if policy == "all":
                    # One after another: a dspark server may profile SPS at start-up, which must not
                    # share the CPU with the others loading.
                    for mode in modes:
                        server = ManagedServer(mode, cfg.server_args, out / "logs")
                        targets[mode] = _Target(mode, server.base_url, server)
                        server.wait_ready()
                        await _warm_up(client, targets[mode], sets[0], cfg, headers)
            else:
                urls = [u.rstrip("/").removesuffix("/v1") for u in cfg.urls]
                labels = list(cfg.modes) if cfg.modes and len(cfg.modes) == len(urls) else []
                if cfg.modes and not labels:
                    log.warning(
                        "--modes has %d labels for %d --url values: detecting modes from /metrics instead",
                        len(cfg.modes),
                        len(urls),
                    )
                for i, url in enumerate(urls):
                    try:
                        samples = await scrape(client, url)
                    except httpx.HTTPError as exc:
                        raise BenchError(f"cannot read {url}/metrics: {type(exc).__name__}: {exc}") from exc
                    mode = labels[i] if labels else detect_mode(samples)
                    if mode in targets:
                        mode = f"{mode}-{i}"
                    targets[mode] = _Target(mode, url)
                modes = list(targets)
            schedule = list(
                _restart_schedule(cfg, sets, modes)
                if policy == "restart" and self_host
                else _schedule(cfg, sets, modes)
            )
            counts = {(ps.name, c): _num_requests(cfg, ps, c) for ps in sets for c in cfg.concurrency}
            total = sum(counts[(ps.name, c)] for _, ps, c, _ in schedule)
            round_runs: list[dict[str, Any]] = []
            per_request: dict[tuple[str, str, int], list[RequestResult]] = {}
            with tqdm(
                total=total,
                desc="bench",
                unit="req",
                disable=not cfg.progress,
                file=sys.stderr,
                dynamic_ncols=True,
            ) as bar:
                for rnd, ps, c, mode in schedule:
                    target = targets.get(mode)
                    if target is None:  # restart policy: this mode's server is not up yet
                        for other in list(targets.values()):
                            if other.server:
                                other.server.stop()
                        targets.clear()
                        server = ManagedServer(mode, cfg.server_args, out / "logs")
                        target = targets[mode] = _Target(mode, server.base_url, server)
                        server.wait_ready()
                        await _warm_up(client, target, sets[0], cfg, headers)
                    bar.set_postfix_str(f"round {rnd + 1}/{cfg.rounds} {ps.name} {mode} c={c}")
                    n = counts[(ps.name, c)]
                    payloads = [chat_payload(ps.prompts[i % len(ps.prompts)], cfg, i) for i in range(n)]
                    before = await scrape(client, target.base_url)
                    results, t0, t1 = await run_load(
                        client,
                        target.base_url,
                        payloads,
                        c,
                        cfg.request_rate,
                        cfg.seed + rnd,
                        headers,
                        on_done=lambda _r: bar.update(1),
                    )
                    after = await scrape(client, target.base_url)
                    run = _round_summary(
                        rnd, ps, mode, c, cfg, results, t1 - t0, metric_deltas(before, after)
                    )
                    round_runs.append(run)
                    per_request.setdefault((ps.name, mode, c), []).extend(results)
                    _check_run(run, results, out, self_host)
        finally:
            for t in targets.values():
                if t.server:
                    t.server.stop()
    runs = _aggregate(round_runs, per_request, cfg)
    result = {
        "machine": machine,
        "config": {
            "command": cfg.command,
            "self_host": self_host,
            "server_policy": policy if self_host else None,
            "server_args": list(cfg.server_args),
            "urls": list(cfg.urls),
            "modes": modes,
            "concurrency": list(cfg.concurrency),
            "prompt_sets": {ps.name: ps.path for ps in sets},
            "prompts_per_set": {ps.name: len(ps.prompts) for ps in sets},
            "limit": cfg.limit,
            "num_requests": cfg.num_requests,
            "max_tokens": cfg.max_tokens,
            "temperature": cfg.temperature,
            "ignore_eos": cfg.ignore_eos,
            "request_rate": cfg.request_rate,
            "rounds": cfg.rounds,
            "seed": cfg.seed,
        },
        "runs": runs,
        "round_runs": round_runs,
    }
    write_json(out / "results.json", result)
    from dspark_server.bench.render import plot_serving, serving_markdown

    (out / "results.md").write_text(serving_markdown(result))
    if cfg.plots:
        plot_serving(result, out)
    return result


def _num_requests(cfg: ServingConfig, ps: PromptSet, concurrency: int) -> int:
    return cfg.num_requests or max(len(ps.prompts), REQUESTS_PER_SLOT * concurrency)


async def _warm_up(
    client: Any, target: _Target, ps: PromptSet, cfg: ServingConfig, headers: dict[str, str] | None
) -> None:
    """A few short requests so that first-call costs (allocations, the planner's first SPS
    refresh) do not land in the first measured run."""
    if cfg.warmup_requests <= 0:
        return
    from dataclasses import replace

    short = replace(cfg, max_tokens=min(16, cfg.max_tokens))
    payloads = [chat_payload(ps.prompts[i % len(ps.prompts)], short, i) for i in range(cfg.warmup_requests)]
    results, _, _ = await run_load(client, target.base_url, payloads, 2, None, 0, headers)
    bad = [r for r in results if not r.ok]
    if bad:
        raise BenchError(
            f"warm-up request to the {target.mode} server failed: {bad[0].error}"
            + (f"\nserver log:\n{target.server.log_tail()}" if target.server else "")
        )


def _round_summary(
    rnd: int,
    ps: PromptSet,
    mode: str,
    c: int,
    cfg: ServingConfig,
    results: list[RequestResult],
    duration: float,
    deltas: dict[str, Any],
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    tokens = sum(r.completion_tokens for r in ok)
    return {
        "round": rnd,
        "prompt_set": ps.name,
        "mode": mode,
        "concurrency": c,
        "request_rate": cfg.request_rate,
        "num_requests": len(results),
        "errors": len(results) - len(ok),
        "duration_s": duration,
        "output_tokens": tokens,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "output_tokens_per_s": tokens / duration if duration > 0 else math.nan,
        "requests_per_s": len(ok) / duration if duration > 0 else math.nan,
        "usage_spec_rounds": sum(int((r.spec or {}).get("rounds", 0)) for r in ok),
        "usage_spec_verified_tokens": sum(int((r.spec or {}).get("verified_tokens", 0)) for r in ok),
        "metrics": deltas,
        **derived_from_deltas(deltas),
    }


def _check_run(run: dict[str, Any], results: list[RequestResult], out: Path, self_host: bool) -> None:
    """Fail loudly: any failed request, or (self-hosted) token counts that do not add up."""
    bad = [r for r in results if not r.ok]
    if bad:
        write_json(
            out / "errors.json",
            {
                "run": {k: v for k, v in run.items() if k != "metrics"},
                "errors": [{"index": r.index, "status": r.status, "error": r.error} for r in bad],
            },
        )
        raise BenchError(
            f"{len(bad)} of {len(results)} requests failed ({run['prompt_set']}, mode "
            f"{run['mode']}, concurrency {run['concurrency']}); first: {bad[0].error} "
            f"(all errors in {out / 'errors.json'})"
        )
    if self_host:
        server_tokens = run["metrics"]["generation_tokens"]
        if int(server_tokens) != run["output_tokens"]:
            raise BenchError(
                f"token count mismatch ({run['mode']}, concurrency {run['concurrency']}): "
                f"usage says {run['output_tokens']}, the server's "
                f"dspark_generation_tokens_total grew by {server_tokens:.0f}"
            )
        if int(run["metrics"]["spec_rounds"]) != run["usage_spec_rounds"]:
            raise BenchError(
                f"speculative round count mismatch ({run['mode']}, concurrency "
                f"{run['concurrency']}): usage {run['usage_spec_rounds']}, /metrics "
                f"{run['metrics']['spec_rounds']:.0f}"
            )


def _aggregate(
    round_runs: list[dict[str, Any]],
    per_request: dict[tuple[str, str, int], list[RequestResult]],
    cfg: ServingConfig,
) -> list[dict[str, Any]]:
    rows = []
    keys = list(dict.fromkeys((r["prompt_set"], r["mode"], r["concurrency"]) for r in round_runs))
    for ps, mode, c in keys:
        rs = [r for r in round_runs if (r["prompt_set"], r["mode"], r["concurrency"]) == (ps, mode, c)]
        reqs = [r for r in per_request[(ps, mode, c)] if r.ok]
        summed: dict[str, Any] = {k: sum(r["metrics"][k] for r in rs) for k in COUNTERS}
        for key in ("accepted_per_position", "verified_per_position"):
            width = max(len(r["metrics"][key]) for r in rs)
            summed[key] = [
                sum(r["metrics"][key][i] for r in rs if i < len(r["metrics"][key])) for i in range(width)
            ]
        tps = [r["output_tokens_per_s"] for r in rs]
        row = {
            "prompt_set": ps,
            "mode": mode,
            "concurrency": c,
            "request_rate": cfg.request_rate,
            "rounds": len(rs),
            "num_requests": sum(r["num_requests"] for r in rs),
            "errors": sum(r["errors"] for r in rs),
            "output_tokens": sum(r["output_tokens"] for r in rs),
            "duration_s": sum(r["duration_s"] for r in rs),
            "output_tokens_per_s": statistics.median(tps),
            "output_tokens_per_s_rounds": tps,
            "output_tokens_per_s_spread": (
                (max(tps) - min(tps)) / statistics.median(tps) if len(tps) > 1 else 0.0
            ),
            "requests_per_s": statistics.median(r["requests_per_s"] for r in rs),
            "mean_output_tokens_per_request": (
                sum(r.completion_tokens for r in reqs) / len(reqs) if reqs else math.nan
            ),
            **latency_stats("ttft", [r.ttft for r in reqs if r.ttft is not None]),
            **latency_stats("tpot", [t for r in reqs if (t := r.tpot) is not None]),
            **latency_stats("itl", [x for r in reqs for x in r.itl]),
            **latency_stats("e2e", [r.e2e for r in reqs if r.e2e is not None]),
            **derived_from_deltas(summed),
            "server_generation_tokens": summed["generation_tokens"],
            "engine_steps": summed["engine_steps"],
            "preemptions": summed["preemptions"],
        }
        rows.append(row)
    for row in rows:
        for base in ("off", "fixed"):
            ref = next(
                (
                    r
                    for r in rows
                    if r["mode"] == base
                    and r["prompt_set"] == row["prompt_set"]
                    and r["concurrency"] == row["concurrency"]
                ),
                None,
            )
            row[f"speedup_vs_{base}"] = (
                row["output_tokens_per_s"] / ref["output_tokens_per_s"]
                if ref and ref["output_tokens_per_s"]
                else None
            )
    return rows


def server_args_from_namespace(a: Any, max_concurrency: int) -> list[str]:
    """`dspark serve` flags for self-hosted servers from `dspark bench`'s engine flags."""
    args: list[str] = []
    for flag, attr in (
        ("--model", "model"),
        ("--draft", "draft"),
        ("--gamma", "gamma"),
        ("--threshold", "threshold"),
        ("--profile", "profile"),
        ("--calibration", "calibration"),
        ("--dtype", "dtype"),
        ("--weight-dtype", "weight_dtype"),
        ("--max-model-len", "max_model_len"),
        ("--max-queued", "max_queued"),
        ("--max-batch-tokens", "max_batch_tokens"),
        ("--prefill-chunk", "prefill_chunk"),
        ("--page-size", "page_size"),
        ("--num-pages", "num_pages"),
        ("--threads", "threads"),
    ):
        v = getattr(a, attr, None)
        if v is not None:
            args += [flag, str(v)]
    running = getattr(a, "max_running", None) or 64
    if running < max_concurrency:
        log.info(
            "raising the servers' --max-running from %d to the highest concurrency %d",
            running,
            max_concurrency,
        )
        running = max_concurrency
    args += ["--max-running", str(running)]
    return args + list(getattr(a, "server_arg", None) or [])
