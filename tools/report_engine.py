"""Markdown for the engine-level measurements (no HTTP): continuous-batching decode throughput,
speculation modes side by side offline, draft-step timing, and an SPS profile."""

from __future__ import annotations

from typing import Any

from dspark_server.bench.render import fmt, machine_line, table


def _head(title: str, result: dict[str, Any]) -> list[str]:
    return [
        f"## {title}",
        "",
        machine_line(result["machine"]),
        "",
        f"Command: `{result.get('config', {}).get('command', '')}`",
        "",
    ]


def decode_throughput_markdown(result: dict[str, Any]) -> str:
    out = _head("Continuous batching (plain decoding)", result)
    out += [
        f"A random {result['model_parameters'] / 1e6:.1f}M-parameter Qwen3, "
        f"{result['config'].get('prompt_len', '?')}-token prompts, {result['new_tokens']} new tokens "
        f"per request, greedy, prefill excluded; median of {result['config'].get('rounds', '?')} "
        f"interleaved rounds, {result['machine'].get('torch_threads', '?')} torch thread(s).",
        "",
    ]
    out.append(
        table(
            ["concurrent requests", "decode tokens/s", "× concurrency 1"],
            [
                [str(r["concurrency"]), fmt(r["tokens_per_s"], 1), fmt(r["ratio_vs_1"])]
                for r in result["runs"]
            ],
        )
    )
    return "\n".join(out) + "\n"


def generate_modes_markdown(result: dict[str, Any]) -> str:
    out = _head(f"Speculation modes offline, concurrency {result['concurrency']}", result)
    out += [
        f"In-process engine (no HTTP), first {result['limit']} prompts per file, {result['max_tokens']} "
        f"new tokens, temperature {result['temperature']}, {result['rounds']} rotated rounds (median); "
        "tokens counted from token ids, wall time includes prefill.",
        "",
    ]
    rows = [
        [
            r["prompts"],
            r["mode"],
            fmt(r["tokens_per_s"], 1),
            fmt(r["ratio_vs_off"]),
            fmt(r["mean_acceptance_length"]),
            fmt(r["verified_per_round"]),
            str(r.get("output_equals_off", "–")),
        ]
        for r in result["runs"]
    ]
    out.append(
        table(
            ["prompts", "mode", "tokens/s", "× off", "τ", "drafts verified / round", "output equals off"],
            rows,
        )
    )
    return "\n".join(out) + "\n"


def draft_timing_markdown(result: dict[str, Any]) -> str:
    out = _head("Draft step: the sequential head's share", result)
    out += [
        f"One draft step over a {result['config'].get('context', '?')}-token context, greedy, min of "
        f"repeats: backbone (block pass + base logits for all γ positions), the sequential head loop "
        "(γ Markov / RNN steps + argmax), the confidence head; the target's verification forward of "
        "the same requests × (γ + 1) tokens for scale.",
        "",
    ]
    rows = [
        [
            r.get("label") or r["head"],
            str(r["requests"]),
            fmt(r["backbone_ms"]),
            fmt(r["sequential_ms"]),
            fmt(r["confidence_ms"]),
            fmt(r["total_ms"]),
            f"{100 * r['sequential_share']:.1f}%",
            fmt(r["verify_ms"]),
            f"{100 * r['round_share']:.1f}%",
        ]
        for r in result["rows"]
    ]
    out.append(
        table(
            [
                "drafter",
                "requests",
                "backbone ms",
                "sequential ms",
                "confidence ms",
                "draft step ms",
                "sequential share",
                "verify ms",
                "share of round",
            ],
            rows,
        )
    )
    return "\n".join(out) + "\n"


def sps_markdown(result: dict[str, Any]) -> str:
    probes = result["sample_batch_tokens"]
    sps = result["sample_steps_per_sec"]
    machine = result.get("machine", {})
    out = [
        "## SPS profile",
        "",
        machine_line(machine) if machine else "",
        "",
        f"Command: `{result.get('command', 'dspark profile')}`; {len(probes)} probes up to "
        f"{result['max_batch_tokens']} batch tokens, {result.get('repeats', '?')} repeats each (median), "
        "monotone envelope.",
        "",
    ]
    picks = [b for b in (1, 8, 16, 64, 128, 256, 512) if b in probes]
    out.append(
        table(
            ["batch tokens"] + [str(b) for b in picks],
            [
                ["steps/s"] + [fmt(sps[probes.index(b)], 1) for b in picks],
                ["ms / step"] + [fmt(1e3 / sps[probes.index(b)], 2) for b in picks],
            ],
        )
    )
    return "\n".join(out) + "\n"
