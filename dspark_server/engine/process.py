"""The native engine in a process of its own (the default for ``dspark serve``).

In one process the HTTP event loop and the engine share one GIL: every token the server streams
(detokenised text, a JSON chunk, a socket write) runs while the engine waits to dispatch its next
operator, so a served step costs more than the same step offline. Here the engine runs in a
child process, as SGLang's scheduler and vLLM's engine core do, and the two talk through pipes:

  server -> engine   ("add", request_id, prompt_ids, params, arrival_time), ("abort", id), ("stop",)
  engine -> server   ("ready", EngineInfo) or ("failed", traceback), then one ("step", StepReport)
                     after every engine step

A step report carries the step's deltas, the statistics the step observed (histogram samples
and counters, replayed into this process's ``EngineStats``, which the metrics layer reads) and
the live load. The engine polls its pipe between steps and blocks on it while idle, so it has no
thread of its own; on this side one reader thread hands each report's deltas to their event loop
in one call. Admission is counted here, as in the threaded backend. When the engine process ends
(a crash, or the server's own shutdown) every open stream ends with an error and the backend
stops being ready. The engine ignores SIGINT and SIGTERM (a terminal's Ctrl-C, ``timeout`` or a
container runtime signal the whole process group; the server drains first, then stops it) and
exits when the server's end of its pipe closes.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from dspark_server.config import EngineConfig
from dspark_server.engine.admission import AdmissionCounter, validate_prompt
from dspark_server.engine.backend import LoadSnapshot, SpecSnapshot, native_spec_snapshot
from dspark_server.engine.request import InvalidRequestError, RequestOutput, SamplingParams, SpecStats
from dspark_server.engine.stats import EngineStats
from dspark_server.engine.stream import TokenStream
from dspark_server.machine import available_cpus, engine_threads
from dspark_server.models.tokenizer import Tokenizer

if TYPE_CHECKING:
    from dspark_server.engine.engine import LLMEngine

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.5  # an idle engine wakes this often (a closed pipe wakes it at once)
SPEC_SNAPSHOT_EVERY_S = 0.5  # the planner's live inputs, for metrics, at most this often
START_POLL_S = 1.0

# EngineStats fields the engine process owns and reports after each step (the observers and the
# per-step scratch counters stay on their side).
_REPORTED_STATS = tuple(
    f.name
    for f in dataclasses.fields(EngineStats)
    if f.name not in ("observers", "started_at") and not f.name.startswith("_")
)


@dataclass(frozen=True)
class EngineInfo:
    """What the server needs to know of a loaded engine."""

    max_model_len: int
    vocab_size: int
    kv_total_pages: int
    spec: SpecSnapshot | None


@dataclass(frozen=True)
class StepReport:
    outputs: list[RequestOutput]
    observed: list[tuple[str, float]]  # EngineStats.observe calls, in order
    stats: dict[str, Any]  # the _REPORTED_STATS fields after the step
    running: int
    waiting: int
    kv_free_pages: int
    spec: SpecSnapshot | None  # None: unchanged since the last report


def main(argv: list[str] | None = None) -> None:
    """The engine process (``python -m dspark_server.engine.process --requests-fd R --reports-fd W``,
    started by ``EngineProcessBackend``): the first message on the requests pipe is its
    ``EngineConfig``."""
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--requests-fd", type=int, required=True)
    p.add_argument("--reports-fd", type=int, required=True)
    a = p.parse_args(argv)
    # Signals sent to the whole process group (a terminal's Ctrl-C, `timeout`, a container
    # runtime) are the server's to handle: it drains, then says stop, or its pipe end closes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    requests = Connection(a.requests_fd, writable=False)
    reports = Connection(a.reports_fd, readable=False)
    try:
        kind, cfg = requests.recv()
    except EOFError:
        return
    assert kind == "config"
    serve_engine(cfg, requests, reports)


def serve_engine(cfg: EngineConfig, requests: Connection, reports: Connection) -> None:
    """Load, report ready (or the failure), then serve the pipe until told to stop or until the
    server's end closes."""
    import torch

    from dspark_server.engine.engine import LLMEngine

    try:
        engine = LLMEngine(cfg)
    except BaseException:
        reports.send(("failed", traceback.format_exc()))
        return
    info = EngineInfo(
        max_model_len=engine.max_model_len,
        vocab_size=engine.runner.target.config.vocab_size,
        kv_total_pages=engine.runner.allocator.capacity_pages,
        spec=native_spec_snapshot(engine),
    )
    reports.send(("ready", info))
    with torch.inference_mode():  # once for the loop's life, not per step (LLMEngine.step)
        _EngineServer(engine, requests, reports).run()


class _EngineServer:
    """The engine process's loop: requests from the pipe between steps, a report after each."""

    def __init__(self, engine: LLMEngine, requests: Connection, reports: Connection) -> None:
        self.engine = engine
        self.requests = requests
        self.reports = reports
        self.outputs: list[RequestOutput] = []
        self.observed: list[tuple[str, float]] = []
        engine.stats.observers.append(lambda name, value: self.observed.append((name, value)))
        self.snapshot_at = 0.0

    def run(self) -> None:
        while True:
            busy = self.engine.has_work()
            if self.requests.poll(0.0 if busy else IDLE_POLL_S) and not self.take_requests():
                return
            stepped = self.engine.has_work()
            if stepped:
                self.engine.step()
            if stepped or self.outputs:
                self.report(idle=not self.engine.has_work())

    def collect(self, out: RequestOutput) -> None:  # every request's sink
        self.outputs.append(out)

    def take_requests(self) -> bool:
        """Everything in the pipe; False when the server said stop or its end closed."""
        while self.requests.poll(0.0):
            try:
                msg = self.requests.recv()
            except (EOFError, OSError):
                return False
            if msg[0] == "add":
                _, request_id, prompt_ids, params, arrival = msg
                try:
                    self.engine.add_request(request_id, prompt_ids, params, self.collect, arrival)
                except InvalidRequestError as exc:  # the server validates first; this is a guard
                    self.outputs.append(_failed(request_id, len(prompt_ids), str(exc)))
            elif msg[0] == "abort":
                self.engine.abort(msg[1])
            else:
                return False
        return True

    def report(self, idle: bool) -> None:
        now = time.monotonic()
        spec = None
        if idle or now - self.snapshot_at >= SPEC_SNAPSHOT_EVERY_S:
            spec = native_spec_snapshot(self.engine)
            self.snapshot_at = now
        stats = self.engine.stats
        report = StepReport(
            outputs=self.outputs,
            observed=self.observed,
            stats={name: getattr(stats, name) for name in _REPORTED_STATS},
            running=len(self.engine.scheduler.running),
            waiting=len(self.engine.scheduler.waiting),
            kv_free_pages=self.engine.runner.allocator.free_pages,
            spec=spec,
        )
        self.outputs, self.observed = [], []
        self.reports.send(("step", report))


def _failed(request_id: str, prompt_tokens: int, error: str) -> RequestOutput:
    return RequestOutput(request_id, (), "", True, "error", prompt_tokens, 0, SpecStats(), error=error)


@dataclass
class _Open:
    stream: TokenStream
    last_delivery: float | None = None


class EngineProcessBackend:
    """The native engine behind the ``Backend`` interface, run in a child process."""

    def __init__(self, cfg: EngineConfig) -> None:
        if cfg.num_threads is None:  # the HTTP process needs a core of its own
            cfg = dataclasses.replace(cfg, num_threads=engine_threads(cfg.model_dir))
            if cfg.wide_step_threads is None:  # it streams nothing while one prompt prefills
                cfg = dataclasses.replace(cfg, wide_step_threads=available_cpus())
        self.cfg = cfg
        self.tokenizer = Tokenizer(cfg.model_dir)
        self.stats = EngineStats()
        self.max_model_len = cfg.max_model_len
        self.max_running = cfg.max_running
        self.max_queued = cfg.max_queued
        self.admission = AdmissionCounter(self.max_running, self.max_queued)
        self._info: EngineInfo | None = None
        self._spec: SpecSnapshot | None = None
        self._load = (0, 0, 0)  # running, waiting, free KV pages after the last step
        self._open: dict[str, _Open] = {}
        self._send_lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._requests: Connection | None = None
        self._reader: threading.Thread | None = None
        self._alive = False
        self._stopping = False

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine process and wait until it has loaded (model, drafter, SPS profile)."""
        # A fresh interpreter (not a fork, which would copy the server's threads, nor
        # multiprocessing's spawn, which re-imports the caller's __main__).
        engine_requests, ours_w = os.pipe()
        ours_r, engine_reports = os.pipe()
        cmd = [sys.executable, "-m", "dspark_server.engine.process"]
        cmd += ["--requests-fd", str(engine_requests), "--reports-fd", str(engine_reports)]
        self._process = subprocess.Popen(cmd, pass_fds=(engine_requests, engine_reports))
        os.close(engine_requests)  # the child holds these ends; closing ours makes EOF visible
        os.close(engine_reports)
        self._requests = Connection(ours_w, readable=False)
        reports = Connection(ours_r, writable=False)
        self._send(("config", self.cfg))
        while not reports.poll(START_POLL_S):
            if self._process.poll() is not None:
                code = self._process.returncode
                raise RuntimeError(f"the engine process exited while loading (exit code {code})")
        try:
            kind, payload = reports.recv()
        except EOFError:
            raise RuntimeError("the engine process exited while loading") from None
        if kind != "ready":
            self._process.wait(5.0)
            raise RuntimeError(f"the engine failed to load:\n{payload}")
        info: EngineInfo = payload
        self._info, self._spec = info, info.spec
        self.max_model_len = info.max_model_len
        self.stats.kv_total_pages = info.kv_total_pages
        self._load = (0, 0, info.kv_total_pages)
        self._alive = True
        self._reader = threading.Thread(
            target=self._read, args=(reports,), name="dspark-engine-reports", daemon=True
        )
        self._reader.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._send(("stop",))
        if self._process is not None:
            try:
                self._process.wait(10.0)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(5.0)
        if self._reader is not None:
            self._reader.join(5.0)
        if self._requests is not None:
            self._requests.close()

    @property
    def ready(self) -> bool:
        return self._alive

    # ---- requests ----------------------------------------------------------------------------

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if self._info is None:
            raise RuntimeError("the engine process has not started")
        validate_prompt(prompt_ids, params, self._info.vocab_size, self.max_model_len)

    def can_accept(self) -> bool:
        return self.admission.can_accept()

    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> TokenStream:
        self.validate(prompt_ids, params)
        if request_id in self._open:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if not self._alive:
            raise RuntimeError("the engine process is not running")
        self.admission.admit()
        stream = TokenStream(request_id, self.abort)
        self._open[request_id] = _Open(stream)
        if not self._send(("add", request_id, list(prompt_ids), params, time.monotonic())):
            self._open.pop(request_id, None)
            self.admission.release()
            raise RuntimeError("the engine process is not running")
        return stream

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def _send(self, msg: tuple) -> bool:
        if self._requests is None:
            return False
        try:
            with self._send_lock:
                self._requests.send(msg)
        except (OSError, ValueError):  # the engine process is gone (or the pipe already closed)
            return False
        return True

    # ---- live figures ------------------------------------------------------------------------

    def load(self) -> LoadSnapshot:
        running, waiting, free = self._load
        return LoadSnapshot(
            running=running,
            waiting=waiting,
            admitted=self.admission.admitted,
            max_running=self.max_running,
            max_queued=self.max_queued,
            kv_total_pages=self.stats.kv_total_pages,
            kv_free_pages=free,
        )

    def spec_snapshot(self) -> SpecSnapshot | None:
        return self._spec

    # ---- the reader thread -------------------------------------------------------------------

    def _read(self, reports: Connection) -> None:
        while True:
            try:
                kind, report = reports.recv()
            except (EOFError, OSError):
                break
            if kind == "step":
                self._apply(report)
        self._alive = False
        if not self._stopping:
            code = self._process.poll() if self._process is not None else None
            log.error("the engine process exited (exit code %s)", code)
        self._end_all("the engine process exited")

    def _apply(self, report: StepReport) -> None:
        stats = self.stats
        for name, value in report.stats.items():
            setattr(stats, name, value)
        for name, value in report.observed:
            stats.observe(name, value)
        self._load = (report.running, report.waiting, report.kv_free_pages)
        if report.spec is not None:
            self._spec = report.spec
        now = time.monotonic()
        batches: dict[asyncio.AbstractEventLoop, list[tuple[TokenStream, RequestOutput]]] = {}
        for out in report.outputs:
            entry = self._open.get(out.request_id)
            if entry is None:
                continue
            if out.new_token_ids:
                if entry.last_delivery is not None:
                    stats.record_inter_token(now - entry.last_delivery)
                entry.last_delivery = now
            if out.finished:
                del self._open[out.request_id]
                self.admission.release()
            batches.setdefault(entry.stream.loop, []).append((entry.stream, out))
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_push_all, items)
            except RuntimeError:  # that event loop is gone: its requests were abandoned
                for stream, out in items:
                    if not out.finished:
                        self.abort(stream.request_id)

    def _end_all(self, error: str) -> None:
        for request_id in list(self._open):
            entry = self._open.pop(request_id, None)
            if entry is None:
                continue
            self.admission.release()
            entry.stream.push_threadsafe(_failed(request_id, 0, error))


def _push_all(items: list[tuple[TokenStream, RequestOutput]]) -> None:
    for stream, out in items:
        stream.push(out)


if __name__ == "__main__":  # run through the module's own name, so what it pickles unpickles here
    from dspark_server.engine import process

    process.main()
