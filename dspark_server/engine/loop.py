"""The engine on its own thread, with asyncio token streams for callers (the native backend)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from dspark_server.engine.admission import AdmissionCounter
from dspark_server.engine.backend import LoadSnapshot, SpecSnapshot
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
        if self._thread.is_alive():
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


class NativeStream:
    """One request's deltas as an async iterator. The engine thread pushes through ``_sink``;
    the event loop reads. ``close()`` (or ``aclose()``) aborts an unfinished request: the engine
    frees its KV at the start of its next step."""

    def __init__(self, backend: NativeBackend, request_id: str) -> None:
        self.request_id = request_id
        self._backend = backend
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._done = False  # the final delta was handed to the reader
        self._closed = False
        self._last_delivery: float | None = None

    def _sink(self, out: RequestOutput) -> None:  # engine thread
        if out.new_token_ids:
            now = time.monotonic()
            if self._last_delivery is not None:
                self._backend.stats.record_inter_token(now - self._last_delivery)
            self._last_delivery = now
        if out.finished:
            self._backend._release()
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, out)
        except RuntimeError:  # the caller's event loop is gone; the request was abandoned
            if not out.finished:
                self._backend.engine.abort(self.request_id)

    def __aiter__(self) -> NativeStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done or self._closed:
            raise StopAsyncIteration
        out = await self._queue.get()
        if out.finished:
            self._done = True
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._done:
            self._backend.engine.abort(self.request_id)

    async def aclose(self) -> None:
        self.close()


class NativeBackend:
    """The native PyTorch engine behind the ``Backend`` interface.

    Admission is counted here, synchronously on the caller's thread: at most
    ``max_running + max_queued`` requests are held at once (running, waiting, or still in the
    engine's inbox); the next one gets ``QueueFullError`` at once instead of queueing unboundedly.
    A request stops counting when the engine emits its final delta (finished, aborted or failed).
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.stats = engine.stats
        self.max_model_len = engine.max_model_len
        self.max_running = engine.cfg.max_running
        self.max_queued = engine.cfg.max_queued
        self.admission = AdmissionCounter(self.max_running, self.max_queued)
        self._thread = EngineThread(engine)
        self._started = False

    @property
    def ready(self) -> bool:
        return self._started

    def can_accept(self) -> bool:
        return self.admission.can_accept()

    def _release(self) -> None:
        self.admission.release()

    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> NativeStream:
        self.admission.admit()
        stream = NativeStream(self, request_id)
        try:
            self.engine.add_request(request_id, prompt_ids, params, stream._sink)
        except BaseException:
            self._release()
            raise
        return stream

    def load(self) -> LoadSnapshot:
        sched, alloc = self.engine.scheduler, self.engine.runner.allocator
        admitted = self.admission.admitted
        return LoadSnapshot(
            running=len(sched.running),
            waiting=len(sched.waiting),
            admitted=admitted,
            max_running=self.max_running,
            max_queued=self.max_queued,
            kv_total_pages=alloc.capacity_pages,
            kv_free_pages=alloc.free_pages,
        )

    def spec_snapshot(self) -> SpecSnapshot | None:
        spec = self.engine.spec
        if spec is None:
            return None
        curve = spec.live_sps.curve() if spec.live_sps is not None else []
        rates = spec.gate.rates() if spec.gate is not None else {}
        return SpecSnapshot(
            mode=self.engine.cfg.spec.mode,
            gamma=spec.gamma,
            sps_curve=curve,
            drift=spec.drift.summary(),
            gate_rates={1 << (bucket - 1): r for bucket, r in rates.items()},
        )

    def start(self) -> None:
        self._thread.start()
        self._started = True

    def shutdown(self) -> None:
        self._started = False
        self._thread.stop()
