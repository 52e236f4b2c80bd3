"""SIGTERM with work the drain cannot wait for (issue #17): a request still sending its body is
refused at once (it never counts as in flight), and what is still running at the drain timeout
ends cleanly — a stream with an error event and [DONE], a JSON request with a 503 — before the
process exits 0 with no traceback in its log."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from test_api_support import scrape, start, value, wait_for

from dspark_server.testing.tiny import build_tiny_model

DRAIN_TIMEOUT = 1.5
LONG = 30_000  # tokens the running stream asks for: far more than the tiny model makes by the cut


def test_sigterm_refuses_stalled_bodies_and_cuts_streams_with_a_final_event(tmp_path: Path) -> None:
    # a tiny model with room for a generation that outlasts the drain (4,000 tokens once
    # finished before the cut on a fast run, and the stream ended without its error event)
    model = build_tiny_model(tmp_path / "model", with_eos=False)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = LONG + 1024
    (model / "config.json").write_text(json.dumps(config))
    server = start(
        ["--model", str(model), "--max-model-len", str(LONG + 1024), "--drain-timeout", str(DRAIN_TIMEOUT)]
        + ["--body-timeout", "120", "--max-running", "1"]
    )
    try:
        base = server.base_url
        long = {"prompt": "def add", "max_tokens": LONG, "ignore_eos": True}  # one runs, two wait
        lines: list[str] = []
        plain: list[httpx.Response] = []

        def stream() -> None:
            with httpx.stream(
                "POST", f"{base}/v1/completions", json={**long, "stream": True}, timeout=60
            ) as r:
                lines.extend(line for line in r.iter_lines() if line.startswith("data: "))

        def post() -> None:
            plain.append(httpx.post(f"{base}/v1/completions", json=long, timeout=60))

        threads = [threading.Thread(target=f) for f in (stream, post, post)]
        for t in threads:
            t.start()
            time.sleep(0.2)  # the stream first: it is the one running
        wait_for(lambda: value(scrape(base), "dspark_num_requests_admitted") == 3, 30, "all admitted")
        stalled = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        stalled.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 500\r\n\r\n{"prompt": '
        )
        time.sleep(0.3)
        assert value(scrape(base), "dspark_http_requests_in_flight") == 3  # the stalled one is not
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        stalled.settimeout(DRAIN_TIMEOUT - 1)  # answered when the drain starts, not when it ends
        raw = b""
        while b"\r\n\r\n" not in raw or not raw.rstrip().endswith(b"}"):
            chunk = stalled.recv(65536)
            assert chunk, raw
            raw += chunk
        stalled.close()
        assert raw.startswith(b"HTTP/1.1 503")
        assert json.loads(raw.partition(b"\r\n\r\n")[2])["error"]["code"] == "server_draining"
        for t in threads:
            t.join(30)
        assert server.proc.wait(30) == 0
        took = time.monotonic() - t0
        assert DRAIN_TIMEOUT <= took < DRAIN_TIMEOUT + 15
        # the stream: some tokens, then the error event, then [DONE]
        assert lines[-1] == "data: [DONE]", lines[-3:]
        last: dict[str, Any] = json.loads(lines[-2][6:])
        assert last["error"]["code"] == "server_shutdown" and last["error"]["type"] == "service_unavailable"
        for r in plain:
            assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutdown"
        log = server.log()
        assert "drain timeout" in log
        assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
    finally:
        server.stop()
