"""Client half of deploy/gpu-check.sh: greedy equality (speculative vs --spec-mode off) through our
OpenAI API with the official ``openai`` client, then an output-throughput bench at several
concurrencies on both servers. Prints a summary, writes it as JSON, exits 1 on a mismatch
(or on any failed request).

    python deploy/gpu_check.py --spec http://127.0.0.1:8001 --off http://127.0.0.1:8002 \
        --prompts prompts.jsonl --n 8 --max-tokens 128 --concurrency 1,16,64 --out result.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI


def load_prompts(path: str, limit: int | None = None) -> list[str]:
    prompts = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            prompts.append(str(json.loads(line)["turns"][0]))
        if limit and len(prompts) >= limit:
            break
    if not prompts:
        raise SystemExit(f"no prompts in {path}")
    return prompts


def client(base_url: str) -> AsyncOpenAI:
    return AsyncOpenAI(
        base_url=base_url.rstrip("/") + "/v1", api_key="gpu-check", max_retries=0, timeout=300.0
    )


async def model_name(c: AsyncOpenAI) -> str:
    return (await c.models.list()).data[0].id


async def chat(c: AsyncOpenAI, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    r = await c.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        temperature=0.0,
        max_tokens=max_tokens,
        seed=0,
    )
    usage = r.usage
    spec = (usage.model_extra or {}).get("spec") if usage is not None else None
    return {
        "text": r.choices[0].message.content or "",
        "finish": r.choices[0].finish_reason,
        "completion_tokens": usage.completion_tokens if usage else 0,
        "spec": spec,
        "seconds": time.perf_counter() - t0,
    }


def first_difference(a: str, b: str) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))


async def equality(spec: AsyncOpenAI, off: AsyncOpenAI, prompts: list[str], max_tokens: int) -> dict:
    ms, mo = await model_name(spec), await model_name(off)
    rows = []
    for i, p in enumerate(prompts):
        a, b = await asyncio.gather(chat(spec, ms, p, max_tokens), chat(off, mo, p, max_tokens))
        diff = first_difference(a["text"], b["text"])
        rows.append(
            {
                "prompt": i,
                "equal": diff < 0,
                "first_diff_char": diff,
                "spec_tokens": a["completion_tokens"],
                "off_tokens": b["completion_tokens"],
                "spec_usage": a["spec"],
                "spec_excerpt": a["text"][max(0, diff - 20) : diff + 40] if diff >= 0 else "",
                "off_excerpt": b["text"][max(0, diff - 20) : diff + 40] if diff >= 0 else "",
            }
        )
    return {"pairs": len(rows), "equal": sum(r["equal"] for r in rows), "rows": rows}


async def bench_level(
    c: AsyncOpenAI, prompts: list[str], concurrency: int, requests: int, max_tokens: int
) -> dict:
    model = await model_name(c)
    sem = asyncio.Semaphore(concurrency)
    results: list[dict] = []
    errors: list[str] = []

    async def one(i: int) -> None:
        async with sem:
            try:
                results.append(await chat(c, model, prompts[i % len(prompts)], max_tokens))
            except Exception as exc:  # reported, not raised: the bench continues
                errors.append(f"{type(exc).__name__}: {exc}")

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(requests)))
    wall = time.perf_counter() - t0
    tokens = sum(r["completion_tokens"] for r in results)
    specs = [r["spec"] for r in results if r["spec"] and r["spec"].get("rounds")]
    rounds = sum(s["rounds"] for s in specs)
    return {
        "concurrency": concurrency,
        "requests": requests,
        "ok": len(results),
        "errors": errors[:3],
        "wall_s": round(wall, 3),
        "output_tokens": tokens,
        "output_tok_per_s": round(tokens / wall, 1) if wall > 0 else 0.0,
        "latency_p50_s": round(statistics.median(r["seconds"] for r in results), 3) if results else None,
        "mean_accept_len": round(sum(s["mean_acceptance_length"] * s["rounds"] for s in specs) / rounds, 3)
        if rounds
        else None,
        "mean_verified_per_round": round(sum(s["verified_tokens"] for s in specs) / rounds, 3)
        if rounds
        else None,
    }


def spec_metrics(base_url: str) -> dict[str, float]:
    with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(dspark_(?:spec_decode_num_\w+?|generation_tokens|prompt_tokens)_total) (\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


async def main_async(a: argparse.Namespace) -> int:
    prompts = load_prompts(a.prompts)
    spec, off = client(a.spec), client(a.off)
    eq = await equality(spec, off, prompts[: a.n], a.max_tokens)
    levels = [int(x) for x in a.concurrency.split(",") if x]
    bench = {"spec": [], "off": []}
    for level in levels:
        n = max(a.min_requests, a.requests_per_slot * level)
        for name, c in (("spec", spec), ("off", off)):
            bench[name].append(await bench_level(c, prompts, level, n, a.bench_max_tokens))
    result = {"equality": eq, "bench": bench, "spec_metrics": spec_metrics(a.spec)}
    print_summary(result)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2))
    failed = any(r["errors"] for rows in bench.values() for r in rows)
    return 0 if eq["equal"] == eq["pairs"] and not failed else 1


def print_summary(result: dict) -> None:
    eq = result["equality"]
    print(f"\n== greedy equality (speculative vs off): {eq['equal']}/{eq['pairs']} identical")
    for r in eq["rows"]:
        if not r["equal"]:
            print(
                f"   prompt {r['prompt']}: first difference at char {r['first_diff_char']}\n"
                f"     spec: {r['spec_excerpt']!r}\n     off:  {r['off_excerpt']!r}"
            )
    print("\n== throughput (output tokens/s)")
    print(
        f"   {'conc':>4} {'spec tok/s':>11} {'off tok/s':>10} {'speedup':>8} {'accept len':>10} "
        f"{'verified/rnd':>12} {'p50 s':>7}"
    )
    for s, o in zip(result["bench"]["spec"], result["bench"]["off"], strict=True):
        speed = s["output_tok_per_s"] / o["output_tok_per_s"] if o["output_tok_per_s"] else float("nan")
        print(
            f"   {s['concurrency']:>4} {s['output_tok_per_s']:>11} {o['output_tok_per_s']:>10} "
            f"{speed:>8.2f} {s['mean_accept_len']!s:>10} {s['mean_verified_per_round']!s:>12} "
            f"{s['latency_p50_s']!s:>7}"
        )
        for err in s["errors"] + o["errors"]:
            print(f"   error: {err}")
    print("\n== spec server /metrics")
    for k, v in sorted(result["spec_metrics"].items()):
        print(f"   {k} {v:g}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", required=True, help="base URL of the speculative server")
    p.add_argument("--off", required=True, help="base URL of the --spec-mode off server")
    p.add_argument("--prompts", required=True, help='JSONL, {"turns": [...]} per line')
    p.add_argument("--n", type=int, default=8, help="prompts in the equality check")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--requests-per-slot", type=int, default=2)
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--bench-max-tokens", type=int, default=128)
    p.add_argument("--out", default=None, help="JSON result file")
    sys.exit(asyncio.run(main_async(p.parse_args())))


if __name__ == "__main__":
    main()
