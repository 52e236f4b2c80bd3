"""The server's shared state: the backend once loaded, the drain flags, the in-flight count, and
the one-shot signals that wake waiting requests when a drain starts or cuts streams off."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from dspark_server.config import ServerConfig
from dspark_server.engine.backend import Backend
from dspark_server.server.metrics import Metrics


class Broadcast:
    """A one-shot flag that coroutines on any event loop can wait for (``asyncio.Event`` binds
    to the first loop that waits on it; test clients run one loop per request)."""

    def __init__(self) -> None:
        self.is_set = False
        self._waiters: set[asyncio.Future[None]] = set()

    def set(self) -> None:
        self.is_set = True
        for fut in list(self._waiters):
            fut.get_loop().call_soon_threadsafe(_resolve, fut)

    async def wait(self) -> None:
        if self.is_set:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.add(fut)
        try:
            await fut
        finally:
            self._waiters.discard(fut)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


@dataclass
class ServerState:
    cfg: ServerConfig
    model_name: str
    metrics: Metrics
    backend: Backend | None = None
    in_flight: int = 0  # /v1/* requests whose body has arrived and that are being handled
    drain_started: Broadcast = field(default_factory=Broadcast)  # SIGTERM: refuse new work
    streams_cut: Broadcast = field(default_factory=Broadcast)  # drain timeout: end what is left

    @property
    def draining(self) -> bool:
        return self.drain_started.is_set

    @draining.setter
    def draining(self, value: bool) -> None:
        if value:
            self.drain_started.set()

    @property
    def ready(self) -> bool:
        return self.backend is not None and self.backend.ready and not self.draining

    def attach(self, backend: Backend) -> None:
        self.backend = backend
        self.metrics.attach(backend)
