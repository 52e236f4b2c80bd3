"""The engine on its own thread, with asyncio token streams for callers (the native backend)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator

from dspark_server.engine.engine import LLMEngine
from dspark_server.engine.request import RequestOutput, SamplingParams

log = logging.getLogger(__name__)


class EngineThread:
    """Runs ``engine.step()`` whenever there is work; sleeps on an event otherwise."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dspark-engine", daemon=True)
        engine.on_step = self._wake.set

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.engine.has_work():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                self.engine.step()
            except Exception:  # step() already fails requests; this guards the loop itself
                log.exception("engine loop iteration failed")


class NativeBackend:
    """The native PyTorch engine behind the ``Backend`` interface."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.stats = engine.stats
        self.max_model_len = engine.max_model_len
        self._thread = EngineThread(engine)
        self._started = False

    @property
    def ready(self) -> bool:
        return self._started

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.engine.validate(prompt_ids, params)

    def can_accept(self) -> bool:
        return len(self.engine.scheduler.waiting) < self.engine.cfg.max_queued

    def start(self) -> None:
        self._thread.start()
        self._started = True

    def shutdown(self) -> None:
        self._started = False
        self._thread.stop()

    async def generate(self, request_id: str, prompt_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def sink(out: RequestOutput) -> None:
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, out)
            except RuntimeError:  # the caller's event loop is gone; the request was abandoned
                self.engine.abort(request_id)

        self.engine.add_request(request_id, prompt_ids, params, sink)
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.engine.abort(request_id)
