"""The load generator's client side: one streamed OpenAI chat completion per request, timed
(TTFT, inter-token latencies, end to end), in a closed loop or with Poisson arrivals."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dspark_server.bench.serving_config import ServingConfig


@dataclass
class RequestResult:
    index: int
    start: float  # perf_counter when sent
    ok: bool = False
    error: str | None = None
    status: int | None = None
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    chunks: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    spec: dict[str, Any] | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.completion_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)


def chat_payload(prompt: str, cfg: ServingConfig, index: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": cfg.max_tokens,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "seed": cfg.seed + index,
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    return body


def completion_payload(prompt_ids: list[int], cfg: ServingConfig, index: int) -> dict[str, Any]:
    """A streamed /v1/completions request of token ids: every server gets the same input tokens
    (e.g. the llama.cpp peer, whose own chat template and tokenizer could differ)."""
    body = chat_payload("", cfg, index)
    del body["messages"]
    body["prompt"] = prompt_ids
    return body


def endpoint_of(payload: dict[str, Any]) -> str:
    """The OpenAI endpoint a payload is for: chat (messages) or completions (prompt)."""
    return "/v1/chat/completions" if "messages" in payload else "/v1/completions"


async def send_request(
    client: Any, base_url: str, payload: dict[str, Any], index: int, headers: dict[str, str] | None = None
) -> RequestResult:
    """POST one streaming chat completion (or completion, for a ``prompt`` payload); timestamps
    every SSE chunk as it arrives."""
    import httpx

    res = RequestResult(index=index, start=time.perf_counter())
    last_content: float | None = None
    done = usage_seen = False
    try:
        async with client.stream(
            "POST", base_url + endpoint_of(payload), json=payload, headers=headers
        ) as resp:
            res.status = resp.status_code
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {body[:500]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                now = time.perf_counter()
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    res.e2e = now - res.start
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = f"error event: {json.dumps(chunk['error'])[:500]}"
                    return res
                if chunk.get("usage"):
                    usage_seen = True
                    u = chunk["usage"]
                    res.prompt_tokens = int(u["prompt_tokens"])
                    res.completion_tokens = int(u["completion_tokens"])
                    res.spec = u.get("spec")
                for choice in chunk.get("choices") or ():
                    if res.ttft is None:  # the first chunk (role) is sent with the first token
                        res.ttft = now - res.start
                    if (choice.get("delta") or {}).get("content") or choice.get("text"):
                        res.chunks += 1
                        if last_content is not None:
                            res.itl.append(now - last_content)
                        last_content = now
                    if choice.get("finish_reason"):
                        res.finish_reason = choice["finish_reason"]
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, ValueError, TypeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    if not done:
        res.error = "stream ended without data: [DONE]"
    elif not usage_seen:
        res.error = "stream had no usage chunk (stream_options.include_usage was ignored?)"
    elif res.ttft is None:
        res.error = "stream had no choices chunk"
    else:
        res.ok = True
    return res


async def run_load(
    client: Any,
    base_url: str,
    payloads: Sequence[dict[str, Any]],
    concurrency: int,
    request_rate: float | None,
    seed: int,
    headers: dict[str, str] | None = None,
    on_done: Callable[[RequestResult], None] | None = None,
) -> tuple[list[RequestResult], float, float]:
    """Closed loop (``request_rate`` None: ``concurrency`` requests always in flight) or open loop
    (Poisson arrivals at ``request_rate``/s, at most ``concurrency`` in flight). Returns the
    results in payload order and the run's (start, end) perf_counter times."""
    arrivals = [0.0] * len(payloads)
    if request_rate:
        rng = random.Random(seed)
        t = 0.0
        for i in range(len(payloads)):
            arrivals[i] = t
            t += rng.expovariate(request_rate)
    sem = asyncio.Semaphore(concurrency)
    t0 = time.perf_counter()

    async def one(i: int) -> RequestResult:
        if request_rate:
            delay = t0 + arrivals[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
        async with sem:
            r = await send_request(client, base_url, payloads[i], i, headers)
        if on_done:
            on_done(r)
        return r

    results = await asyncio.gather(*(one(i) for i in range(len(payloads))))
    return list(results), t0, time.perf_counter()
