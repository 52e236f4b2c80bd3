"""Run the HTTP server: listen at once, load the engine in the background, drain on SIGTERM.

Lifecycle:
  * start: the port opens immediately; ``/health``, ``/ready`` and ``/v1/*`` are 503 until
    the backend has been built (model load, SPS profiling) and started. A failed load exits 1.
  * SIGTERM / SIGINT: ``/ready`` turns 503 and new ``/v1/*`` requests get 503 (Retry-After) while
    the port stays open, as do requests still sending their body (which never count as in
    flight); in-flight requests run to completion. After ``drain_timeout_s`` what is left is cut:
    streams end with an error event and ``[DONE]``, JSON requests get 503. Then uvicorn stops
    listening, closes connections and the process exits 0. A second signal skips the wait.
  * Slow clients: headers must arrive within ``header_timeout_s``, a body within
    ``body_timeout_s`` (guard.py), idle kept-alive connections close after ``idle_timeout_s``,
    and at most ``max_connections`` are open at once (http_protocol.py).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

import uvicorn

from dspark_server.config import ServerConfig
from dspark_server.engine.backend import Backend
from dspark_server.server.app import create_app
from dspark_server.server.http_protocol import protocol_class
from dspark_server.server.state import ServerState

log = logging.getLogger(__name__)

DRAIN_POLL_S = 0.05
CUT_GRACE_S = 3.0  # after the drain timeout: time for cut responses to send their last event


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout_s = drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_started = False
        self.failed = False

    async def startup(self, sockets: list | None = None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_started or self._loop is None:
            super().handle_exit(sig, frame)  # second signal (or not serving yet): stop now
            return
        self._drain_started = True
        self.state.draining = True
        log.info(
            "signal %d: draining (no new requests; %d in flight, up to %.0f s)",
            sig,
            self.state.in_flight,
            self.drain_timeout_s,
        )
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.drain_timeout_s
        while self.state.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if self.state.in_flight > 0:
            log.warning("drain timeout: %d request(s) still in flight are cut off", self.state.in_flight)
            self.state.streams_cut.set()
            grace = time.monotonic() + CUT_GRACE_S
            while self.state.in_flight > 0 and time.monotonic() < grace:
                await asyncio.sleep(DRAIN_POLL_S)
        left = max(0.0, deadline - time.monotonic())
        # uvicorn's own graceful phase: responses already complete by now, so this is short.
        # Setting should_exit (not handle_exit) leaves no captured signal for uvicorn to re-raise
        # after shutdown, so a completed drain exits 0; a second signal still ends it at once.
        self.config.timeout_graceful_shutdown = max(1, int(left) + 1)
        self.should_exit = True


def run_server(make_backend: Callable[[], Backend] | Backend, cfg: ServerConfig, model_name: str) -> None:
    """Serve ``model_name``; ``make_backend`` builds the backend (called on a loader thread while
    the port is already open) or is a ready backend."""
    app = create_app(None, cfg, model_name)
    state: ServerState = app.state.dspark
    config = uvicorn.Config(
        app,
        host=cfg.host,
        port=cfg.port,
        log_level="info",
        timeout_graceful_shutdown=max(1, int(cfg.drain_timeout_s)),
        http=protocol_class(cfg),
        timeout_keep_alive=cfg.idle_timeout_s,  # type: ignore[arg-type]  # call_later takes floats
    )
    server = DrainingServer(config, state, cfg.drain_timeout_s)
    holder: list[Backend] = []

    def load() -> None:
        try:
            backend = make_backend() if callable(make_backend) else make_backend
            backend.start()
            holder.append(backend)
            if server.should_exit or state.draining:
                return
            state.attach(backend)
            log.info("engine ready: serving %s", model_name)
        except BaseException:
            log.exception("failed to load the engine")
            server.failed = True
            server.should_exit = True

    loader = threading.Thread(target=load, name="dspark-loader", daemon=True)
    loader.start()
    try:
        server.run()
    finally:
        for backend in holder:
            backend.shutdown()
    if server.failed:
        sys.exit(1)
