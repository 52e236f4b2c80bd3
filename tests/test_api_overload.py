"""Overload, client disconnects and graceful shutdown on a real `dspark serve` process with a
tiny admission limit (--max-running 2 --max-queued 2)."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from test_api_support import LoggedServer, scrape, start, value, wait_for, wait_idle

MAX_RUNNING, MAX_QUEUED = 2, 2
LONG = 3900  # tokens: a request that stays in flight for seconds (900 ended too soon on a fast engine)


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[LoggedServer]:
    s = start(
        [
            "--model",
            str(tiny_model),
            "--max-model-len",
            "4096",
            "--num-pages",
            "640",
            "--max-running",
            str(MAX_RUNNING),
            "--max-queued",
            str(MAX_QUEUED),
            "--drain-timeout",
            "60",
        ]
    )
    yield s
    s.stop()


def _admitted(base_url: str) -> float:
    return value(scrape(base_url), "dspark_num_requests_admitted")


class StreamingClient(threading.Thread):
    """A streaming completion in a thread: keeps every event, the usage and any error."""

    def __init__(self, base_url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.base_url = base_url
        self.max_tokens = max_tokens
        self.status: int | None = None
        self.events: list[str] = []
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        body = {
            "prompt": "def add",
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        try:
            with httpx.stream("POST", f"{self.base_url}/v1/completions", json=body, timeout=120) as r:
                self.status = r.status_code
                self.events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        except BaseException as exc:  # recorded; the test asserts there is none
            self.error = exc

    def usage(self) -> dict[str, Any]:
        assert self.error is None, self.error
        assert self.status == 200 and self.events[-1] == "[DONE]", self.events[-3:]
        chunks = [json.loads(e) for e in self.events[:-1]]
        reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert reasons[-1] == "length"
        return chunks[-1]["usage"]


def test_overload_is_refused_fast_and_every_accepted_request_completes(server: LoggedServer) -> None:
    wait_idle(server.base_url)
    # two long requests run; two short ones wait behind them: the server is full for seconds
    holders = [StreamingClient(server.base_url, LONG) for _ in range(MAX_RUNNING)]
    wait_for(lambda: _admitted(server.base_url) == MAX_RUNNING, 20, "the long requests admitted")
    holders += [StreamingClient(server.base_url, 20) for _ in range(MAX_QUEUED)]
    wait_for(lambda: _admitted(server.base_url) == MAX_RUNNING + MAX_QUEUED, 20, "all 4 admitted")
    c = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=10)
    model = c.models.list().data[0].id
    results: list[tuple[float, BaseException | None, Any]] = []

    def one() -> None:
        t0 = time.monotonic()
        try:
            r = c.completions.create(model=model, prompt="x", max_tokens=5)
            results.append((time.monotonic() - t0, None, r))
        except BaseException as exc:
            results.append((time.monotonic() - t0, exc, None))

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(results) == 8
    for seconds, exc, _ in results:
        assert isinstance(exc, openai.RateLimitError), exc
        assert exc.status_code == 429 and exc.response.headers["retry-after"] == "1"
        assert exc.response.json()["error"]["code"] == "queue_full"
        assert seconds < 5, seconds  # refused at once, not after waiting for capacity
    for h in holders:
        h.join(120)
        assert not h.is_alive(), "an accepted request hung"
        assert h.usage()["completion_tokens"] == h.max_tokens
    # capacity is given back: a new request is accepted and completes
    r = c.completions.create(model=model, prompt="x", max_tokens=5)
    assert r.usage.completion_tokens == 5
    assert (
        value(wait_idle(server.base_url), "dspark_requests_total", endpoint="/v1/completions", status="429")
        >= 8
    )


def test_non_streaming_disconnect_aborts_and_frees_kv(server: LoggedServer) -> None:
    before = wait_idle(server.base_url)
    aborted0 = value(before, "dspark_request_success_total", finished_reason="abort")
    generated0 = value(before, "dspark_generation_tokens_total")
    body = json.dumps({"prompt": "def add", "max_tokens": LONG}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:  # a client that hangs up
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        wait_for(lambda: _admitted(server.base_url) == 1, 10, "the request to be admitted")
    took = wait_for(lambda: _admitted(server.base_url) == 0, 10, "the abandoned request to be aborted")
    after = wait_idle(server.base_url)
    assert value(after, "dspark_request_success_total", finished_reason="abort") == aborted0 + 1
    assert value(after, "dspark_generation_tokens_total") - generated0 < LONG  # cut short
    assert value(after, "dspark_kv_cache_free_pages") == value(before, "dspark_kv_cache_free_pages")
    assert took < 5


def test_sigterm_drains_in_flight_requests_then_exits_zero(server: LoggedServer) -> None:
    """Last in this module: it stops the server."""
    wait_idle(server.base_url)
    # long enough to be in flight together whatever the engine's speed (400 tokens each ended
    # before the third was admitted once the float32 kernel got faster)
    holders = [StreamingClient(server.base_url, max_tokens=LONG) for _ in range(3)]
    wait_for(lambda: _admitted(server.base_url) == 3, 20, "3 requests admitted")
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: httpx.get(f"{server.base_url}/ready").status_code == 503, 5, "/ready to turn 503")
    ready = httpx.get(f"{server.base_url}/ready")
    assert ready.json()["error"]["code"] == "server_draining"
    refused = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert refused.status_code == 503 and refused.headers["retry-after"]
    assert refused.json()["error"]["type"] == "service_unavailable"
    for h in holders:
        h.join(60)
        assert h.usage()["completion_tokens"] == LONG  # none truncated
    assert server.proc.wait(30) == 0
    assert time.monotonic() - t0 < 60
    assert "draining" in server.log()
