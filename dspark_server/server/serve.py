"""Run the HTTP server: build the backend, the app, and a uvicorn server that drains on SIGTERM."""

from __future__ import annotations

import logging
from types import FrameType

import uvicorn

from dspark_server.config import ServerConfig
from dspark_server.engine.backend import Backend
from dspark_server.server.app import create_app

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT: mark the app draining (``/ready`` -> 503), then let uvicorn finish
    in-flight requests within ``timeout_graceful_shutdown`` before exiting."""

    def __init__(self, config: uvicorn.Config, on_drain: callable) -> None:  # type: ignore[valid-type]
        super().__init__(config)
        self._on_drain = on_drain

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._on_drain()
        super().handle_exit(sig, frame)


def run_server(backend: Backend, cfg: ServerConfig, model_name: str) -> None:
    app = create_app(backend, cfg, model_name)
    state = app.state.dspark

    def drain() -> None:
        if not state.draining:
            log.info("draining: no new requests; finishing in-flight ones")
        state.draining = True

    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="info",
                            timeout_graceful_shutdown=int(cfg.drain_timeout_s))
    server = DrainingServer(config, drain)
    backend.start()
    try:
        server.run()
    finally:
        backend.shutdown()
