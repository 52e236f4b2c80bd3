"""Offline batch generation through the engine (``dspark generate``)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from tqdm import tqdm

from dspark_server.engine.engine import LLMEngine
from dspark_server.engine.request import RequestOutput, SamplingParams


@dataclass(frozen=True)
class GenerateConfig:
    prompts: str
    limit: int | None = None
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    concurrency: int = 1
    progress: bool = True


def read_prompts(path: str | Path, limit: int | None = None) -> list[str]:
    """First user turn of each line of a ``{"turns": [...]}`` JSONL file."""
    prompts = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                turns = json.loads(line)["turns"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{line_no}: expected a JSON object with 'turns'") from exc
            prompts.append(str(turns[0]))
            if limit is not None and len(prompts) >= limit:
                break
    return prompts


@dataclass
class _Result:
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    spec: dict
    prompt_tokens: int
    seconds: float


def generate(engine: LLMEngine, cfg: GenerateConfig) -> Iterator[dict]:
    """Yield one result dict per prompt, in prompt order, keeping ``concurrency`` in flight."""
    prompts = read_prompts(cfg.prompts, cfg.limit)
    tokenized = [engine.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    done: dict[int, _Result] = {}
    started: dict[int, float] = {}
    parts: dict[int, list[RequestOutput]] = {}
    next_submit = next_emit = 0
    finished = 0
    bar = tqdm(total=len(prompts), desc="generate", unit="req", disable=not cfg.progress, file=sys.stderr)

    def sink_for(i: int) -> Callable[[RequestOutput], None]:
        def sink(out: RequestOutput) -> None:
            parts.setdefault(i, []).append(out)
            if out.finished:
                nonlocal finished
                finished += 1
                outs = parts.pop(i)
                done[i] = _Result(
                    i,
                    [t for o in outs for t in o.new_token_ids],
                    "".join(o.new_text for o in outs),
                    out.finish_reason,
                    out.spec.as_dict(),
                    out.prompt_tokens,
                    time.perf_counter() - started[i],
                )
                bar.update(1)

        return sink

    while next_emit < len(prompts):
        while next_submit < len(prompts) and next_submit - finished < cfg.concurrency:
            i = next_submit
            seed = None if cfg.seed is None else cfg.seed + i
            params = SamplingParams(
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                top_k=cfg.top_k,
                seed=seed,
                max_tokens=cfg.max_tokens,
            )
            started[i] = time.perf_counter()
            engine.add_request(f"gen-{i}", tokenized[i], params, sink_for(i))
            next_submit += 1
        engine.step()
        while next_emit in done:
            r = done.pop(next_emit)
            yield {
                "index": r.index,
                "token_ids": r.token_ids,
                "text": r.text,
                "finish_reason": r.finish_reason,
                "prompt_tokens": r.prompt_tokens,
                "seconds": round(r.seconds, 4),
                "spec": r.spec,
            }
            next_emit += 1
    bar.close()


def write_jsonl(results: Iterator[dict], out: TextIO) -> None:
    for r in results:
        out.write(json.dumps(r, ensure_ascii=False) + "\n")
        out.flush()
