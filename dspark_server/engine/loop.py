"""The engine on a thread of the server's process, with asyncio token streams for callers (the
native backend in one process; ``engine/process.py`` runs it in a process of its own)."""

from __future__ import annotations

import logging
import threading
import time

import torch

from dspark_server.engine.admission import AdmissionCounter
from dspark_server.engine.backend import LoadSnapshot, SpecSnapshot, native_spec_snapshot
from dspark_server.engine.engine import LLMEngine
from dspark_server.engine.request import RequestOutput, SamplingParams
from dspark_server.engine.stream import TokenStream

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

    @torch.inference_mode()  # once for the thread's life, not per forward (LLMEngine.step)
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

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.engine.validate(prompt_ids, params)

    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> TokenStream:
        self.admission.admit()
        stream = TokenStream(request_id, self.engine.abort)
        last_delivery: list[float] = []

        def sink(out: RequestOutput) -> None:  # engine thread
            if out.new_token_ids:
                now = time.monotonic()
                if last_delivery:
                    self.stats.record_inter_token(now - last_delivery[0])
                last_delivery[:] = [now]
            if out.finished:
                self._release()
            stream.push_threadsafe(out)

        try:
            self.engine.add_request(request_id, prompt_ids, params, sink)
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
        return native_spec_snapshot(self.engine)

    def start(self) -> None:
        self._thread.start()
        self._started = True

    def shutdown(self) -> None:
        self._started = False
        self._thread.stop()
