"""llama.cpp as a peer: our `dspark serve` against llama.cpp's `llama-server` on the same weights.

    dspark bench --suite peers --llama-server /path/llama.cpp/build/bin/llama-server \\
        --prompts humaneval.jsonl,mt-bench.jsonl --concurrency 1,16,64 --max-tokens 128 \\
        --ignore-eos [--temperature 1] [--rounds 2] [--model DIR --draft DIR]

The bench converts the target (and the drafter, with ``--target-model-dir``) to float32 GGUF with
the converter of the llama.cpp tree the binary was built in (``gguf_convert``), then starts every
system at once, each on its own loopback port:

  * ``ours-MODE`` for each of ``--modes`` (default off, dspark): ``dspark serve``;
  * ``llama-plain``: ``llama-server -m target.gguf``;
  * ``llama-dspark``: the same with ``-md draft.gguf --spec-type draft-dspark
    --spec-draft-n-max GAMMA`` (llama.cpp's DSpark: a fixed draft length, no planner).

llama-server gets ``-t`` = our engine's threads, ``-np`` = the highest concurrency (one slot per
in-flight request) and ``-c`` = slots x our ``--max-model-len``. Every request is a streamed
``/v1/completions`` call whose prompt is the same token ids for every system (the target's chat
template applied by our tokenizer), so inputs are identical token for token; llama.cpp requests
also carry ``top_k 0, top_p 1, min_p 0`` (plain temperature sampling, as ours; llama.cpp's
defaults would truncate the distribution) and ``cache_prompt false`` (the bench repeats prompts
across rounds; our engine keeps no prefix cache). Each (prompt set, concurrency) point runs the
systems one after another, the order rotated per round, so drifts of the machine fall on all
alike. Reported: output tokens/s (usage token counts over wall time), median TTFT and TPOT, and
ours / llama.cpp ratios. With ``--ignore-eos`` the bench checks that every system generated the
same number of tokens per request.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dspark_server.bench.common import (
    BenchError,
    SuiteConfig,
    concurrency_axis,
    latency_stats,
    load_prompt_sets,
    machine_info,
    pyplot,
    save_figure,
    write_result,
)
from dspark_server.bench.gguf_convert import convert_to_gguf, find_converter
from dspark_server.bench.load_client import RequestResult, completion_payload, run_load
from dspark_server.bench.managed_server import ManagedServer, ServerProcess
from dspark_server.bench.serving_config import REQUESTS_PER_SLOT, ServingConfig

# What llama.cpp requests add: plain temperature sampling (its defaults are top_k 40, top_p 0.95,
# min_p 0.05) and no reuse of a previous request's KV prefix.
LLAMA_REQUEST_FIELDS: dict[str, Any] = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "cache_prompt": False}


@dataclass(frozen=True)
class LlamaPeerConfig:
    suite: SuiteConfig
    server_binary: str
    converter: str | None = None  # None: convert_hf_to_gguf.py of the binary's source tree
    pre_tokenizer: str = "qwen2"
    outtype: str = "f32"  # GGUF weight type (f32, bf16, f16, q8_0): match --dtype for a like-for-like run
    concurrency: tuple[int, ...] = (1, 16, 64)
    modes: tuple[str, ...] = ("off", "dspark")
    server_args: tuple[str, ...] = ()  # flags for our `dspark serve`
    warmup_requests: int = 2


class LlamaServer(ServerProcess):
    """``llama-server`` on a loopback port, its log in a file; ready when /health answers."""

    ready_path = "/health"

    def __init__(self, name: str, argv: list[str], log_dir: Path) -> None:
        super().__init__(name, name, log_dir)
        self._start([*argv, "--host", "127.0.0.1", "--port", str(self.port)])


def llama_argv(
    binary: str, target_gguf: Path, draft_gguf: Path | None, gamma: int, threads: int, slots: int, ctx: int
) -> list[str]:
    """llama-server's command line (host and port added by LlamaServer)."""
    argv = [binary, "-m", str(target_gguf), "-t", str(threads), "-np", str(slots), "-c", str(slots * ctx)]
    if draft_gguf is not None:
        argv += ["-md", str(draft_gguf), "--spec-type", "draft-dspark", "--spec-draft-n-max", str(gamma)]
    return argv


def run_llama_peers(cfg: LlamaPeerConfig) -> dict[str, Any]:
    """The whole comparison; writes OUT/llama_cpp.{json,md,png} and returns the result."""
    return asyncio.run(_run(cfg))


def _systems(cfg: LlamaPeerConfig, out: Path) -> dict[str, ServerProcess]:
    import os

    from dspark_server.models.drafter_checkpoint import read_draft_config

    eng = cfg.suite.engine
    converter = Path(cfg.converter) if cfg.converter else find_converter(cfg.server_binary)
    gguf_dir = out / "gguf"
    target = convert_to_gguf(eng.model_dir, gguf_dir, converter, cfg.pre_tokenizer, outtype=cfg.outtype)
    draft = gamma = None
    if eng.draft_dir is not None:
        pre, kind, tgt = cfg.pre_tokenizer, cfg.outtype, eng.model_dir
        draft = convert_to_gguf(eng.draft_dir, gguf_dir, converter, pre, target_dir=tgt, outtype=kind)
        gamma = eng.spec.gamma or read_draft_config(eng.draft_dir).gamma
    threads = eng.num_threads or len(os.sched_getaffinity(0))
    slots, ctx = max(cfg.concurrency), eng.max_model_len
    plan: list[tuple[str, list[str] | None]] = [(f"ours-{m}", None) for m in cfg.modes]
    plan.append(("llama-plain", llama_argv(cfg.server_binary, target, None, 0, threads, slots, ctx)))
    if draft is not None and gamma is not None:
        plan.append(
            ("llama-dspark", llama_argv(cfg.server_binary, target, draft, gamma, threads, slots, ctx))
        )
    systems: dict[str, ServerProcess] = {}
    try:
        for name, argv in plan:  # one at a time: a dspark server profiles SPS at start-up
            server: ServerProcess
            if argv is None:
                server = ManagedServer(name.removeprefix("ours-"), cfg.server_args, out / "logs")
            else:
                server = LlamaServer(name, argv, out / "logs")
            systems[name] = server
            server.wait_ready()
    except BaseException:
        for s in systems.values():
            s.stop()
        raise
    return systems


async def _run(cfg: LlamaPeerConfig) -> dict[str, Any]:
    import httpx
    from tqdm import tqdm

    from dspark_server.models.tokenizer import Tokenizer

    a = cfg.suite
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    out = Path(a.out)
    sets = load_prompt_sets(a.prompt_files, a.limit)
    tokenizer = Tokenizer(a.engine.model_dir)
    ids = {
        ps.name: [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in ps.prompts] for ps in sets
    }
    shape = ServingConfig(
        prompt_files=a.prompt_files,
        concurrency=cfg.concurrency,
        out=a.out,
        max_tokens=a.max_tokens,
        temperature=a.temperature,
        ignore_eos=a.ignore_eos,
        seed=a.seed,
    )
    systems = _systems(cfg, out)
    names = list(systems)
    counts = {
        (ps.name, c): max(len(ps.prompts), REQUESTS_PER_SLOT * c) for ps in sets for c in cfg.concurrency
    }
    rows: list[dict[str, Any]] = []
    per_request: dict[tuple[str, int, str], list[RequestResult]] = {}

    def payloads(set_name: str, n: int, system: str) -> list[dict[str, Any]]:
        extra = LLAMA_REQUEST_FIELDS if system.startswith("llama") else {}
        prompts = ids[set_name]
        return [{**completion_payload(prompts[i % len(prompts)], shape, i), **extra} for i in range(n)]

    limits = httpx.Limits(max_connections=max(cfg.concurrency) + 8)
    total = a.rounds * len(names) * sum(counts.values())
    try:
        async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(900.0, connect=30.0)) as client:
            for name in names:  # warm-up, not measured
                warm = payloads(sets[0].name, cfg.warmup_requests, name)
                await run_load(client, systems[name].base_url, warm, 2, None, 0)
            with tqdm(
                total=total, desc="llama.cpp peers", unit="req", disable=not a.progress, file=sys.stderr
            ) as bar:
                for rnd in range(a.rounds):
                    order = names[rnd % len(names) :] + names[: rnd % len(names)]
                    for ps in sets:
                        for c in cfg.concurrency:
                            for name in order:
                                bar.set_postfix_str(f"round {rnd + 1} {ps.name} c={c} {name}")
                                body = payloads(ps.name, counts[(ps.name, c)], name)
                                results, t0, t1 = await run_load(
                                    client,
                                    systems[name].base_url,
                                    body,
                                    c,
                                    None,
                                    a.seed + rnd,
                                    on_done=lambda _r: bar.update(1),
                                )
                                _check(results, name, ps.name, c)
                                per_request.setdefault((ps.name, c, name), []).extend(results)
                                tokens = sum(r.completion_tokens for r in results)
                                rows.append(
                                    {
                                        "round": rnd,
                                        "prompt_set": ps.name,
                                        "concurrency": c,
                                        "system": name,
                                        "output_tokens": tokens,
                                        "duration_s": t1 - t0,
                                        "output_tokens_per_s": tokens / (t1 - t0),
                                    }
                                )
    finally:
        for s in systems.values():
            s.stop()
    if a.ignore_eos:
        _check_same_lengths(per_request, names)
    points = _aggregate(rows, per_request, names)
    result = {
        "kind": "llama_cpp_peers",
        "machine": machine_info(),
        "config": {
            "command": a.command,
            "model": a.engine.model_dir,
            "draft": a.engine.draft_dir,
            "server_binary": cfg.server_binary,
            "pre_tokenizer": cfg.pre_tokenizer,
            "gguf_type": cfg.outtype,
            "systems": names,
            "concurrency": list(cfg.concurrency),
            "prompt_sets": {ps.name: ps.path for ps in sets},
            "max_tokens": a.max_tokens,
            "temperature": a.temperature,
            "ignore_eos": a.ignore_eos,
            "rounds": a.rounds,
            "llama_request_fields": LLAMA_REQUEST_FIELDS,
        },
        "points": points,
        "round_runs": rows,
    }
    write_result(result, out, "llama_cpp", llama_markdown, _plot, a.plots)
    return result


def _check(results: list[RequestResult], system: str, set_name: str, c: int) -> None:
    bad = [r for r in results if not r.ok]
    if bad:
        raise BenchError(
            f"{len(bad)} of {len(results)} requests to {system} failed ({set_name}, c={c}): {bad[0].error}"
        )


def _check_same_lengths(
    per_request: dict[tuple[str, int, str], list[RequestResult]], names: list[str]
) -> None:
    for (ps, c, name), results in per_request.items():
        ref = per_request[(ps, c, names[0])]
        got = sorted(r.completion_tokens for r in results)
        if got != sorted(r.completion_tokens for r in ref):
            raise BenchError(
                f"{name} generated other token counts than {names[0]} ({ps}, c={c}) under --ignore-eos"
            )


def _aggregate(
    rows: list[dict[str, Any]], per_request: dict[tuple[str, int, str], list[RequestResult]], names: list[str]
) -> list[dict[str, Any]]:
    """One entry per (prompt set, concurrency): every system's median tokens/s, TTFT and TPOT,
    and the ours / llama.cpp ratios."""
    points = []
    for ps, c in dict.fromkeys((r["prompt_set"], r["concurrency"]) for r in rows):
        point: dict[str, Any] = {"prompt_set": ps, "concurrency": c, "systems": {}}
        for name in names:
            tps = [
                r["output_tokens_per_s"]
                for r in rows
                if (r["prompt_set"], r["concurrency"], r["system"]) == (ps, c, name)
            ]
            reqs = per_request[(ps, c, name)]
            point["systems"][name] = {
                "output_tokens_per_s": statistics.median(tps),
                "output_tokens_per_s_rounds": tps,
                **latency_stats("ttft", [r.ttft for r in reqs if r.ttft is not None]),
                **latency_stats("tpot", [t for r in reqs if (t := r.tpot) is not None]),
            }
        point["ratios"] = ratios(point["systems"])
        points.append(point)
    return points


def ratios(systems: dict[str, dict[str, Any]]) -> dict[str, float]:
    """ours-X / llama-Y tokens/s for every pair, and ours-X / the best llama.cpp system."""
    tps = {k: v["output_tokens_per_s"] for k, v in systems.items()}
    ours = [k for k in tps if k.startswith("ours-")]
    llama = [k for k in tps if k.startswith("llama-")]
    out = {f"{o} / {p}": tps[o] / tps[p] for o in ours for p in llama if tps[p] > 0}
    if llama:
        best = max(tps[p] for p in llama)
        out.update({f"{o} / best llama.cpp": tps[o] / best for o in ours if best > 0})
    return out


def llama_markdown(result: dict[str, Any]) -> str:
    cfg = result["config"]
    names = cfg["systems"]
    keys = list(result["points"][0]["ratios"]) if result["points"] else []
    lines = [
        "# Our engine vs llama.cpp (llama-server), same weights, same prompt tokens",
        "",
        f"`{cfg['command']}`",
        "",
        f"{cfg['max_tokens']} output tokens per request (ignore_eos {cfg['ignore_eos']}), temperature "
        f"{cfg['temperature']}, {cfg['rounds']} round(s), median output tokens/s; llama.cpp's "
        f"pre-tokenizer set to `{cfg['pre_tokenizer']}` for the conversion, GGUF weights "
        f"{cfg.get('gguf_type', 'f32')}.",
        "",
        "| prompts | c | " + " | ".join(names) + " | " + " | ".join(keys) + " |",
        "| --- | --- | " + " | ".join("---" for _ in names + keys) + " |",
    ]
    for p in result["points"]:
        tps = " | ".join(f"{p['systems'][n]['output_tokens_per_s']:.0f}" for n in names)
        rat = " | ".join(f"{p['ratios'][k]:.2f}" for k in keys)
        lines.append(f"| {p['prompt_set']} | {p['concurrency']} | {tps} | {rat} |")
    lines += ["", "Median TTFT / TPOT (ms):", "", "| prompts | c | " + " | ".join(names) + " |"]
    lines.append("| --- | --- | " + " | ".join("---" for _ in names) + " |")
    for p in result["points"]:
        cells = []
        for n in names:
            s = p["systems"][n]
            cells.append(f"{1e3 * s['ttft_p50_s']:.0f} / {1e3 * s['tpot_p50_s']:.1f}")
        lines.append(f"| {p['prompt_set']} | {p['concurrency']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    sets = list(dict.fromkeys(p["prompt_set"] for p in result["points"]))
    fig, axes = plt.subplots(1, len(sets), figsize=(4.5 * len(sets), 3.6), squeeze=False)
    for ax, ps in zip(axes[0], sets, strict=True):
        pts = [p for p in result["points"] if p["prompt_set"] == ps]
        for name in result["config"]["systems"]:
            ys = [p["systems"][name]["output_tokens_per_s"] for p in pts]
            style = "-o" if name.startswith("ours") else "--s"
            ax.plot([p["concurrency"] for p in pts], ys, style, label=name)
        ax.set_ylabel("output tokens/s")
        ax.set_title(ps)
        concurrency_axis(ax)
    save_figure(fig, path)
