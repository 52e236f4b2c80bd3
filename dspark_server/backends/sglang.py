"""SGLang's engine behind our ``Backend`` interface (GPU serving).

``SGLangBackend`` starts ``sglang.Engine`` in-process with DSpark on (``speculative_algorithm=
"DSPARK"``, our drafter, SPS table and STS calibration passed through; see ``sglang_args``) and
serves our OpenAI API on top of it:

* prompts are tokenized by our server (chat template included) and sent as token ids; SGLang runs
  with ``skip_tokenizer_init`` and streams token ids back, which our own ``OutputProcessor``
  detokenizes and checks for stop strings -- the same text, stop and ``max_tokens`` semantics as
  the native engine. A stop string SGLang cannot see ends the request here and aborts it there.
* closing a stream early (client disconnect) aborts the SGLang request
  (``TokenizerManager.abort_request``); SGLang frees its KV at its next scheduling step.
* ``stats`` (our ``dspark_*`` metrics and the ``usage.spec`` extension) is filled from each
  request's final ``meta_info`` (verify count, accepted drafts, accept/verify-length histograms);
  ``load()`` reads SGLang's own per-rank load snapshot (running, waiting, KV tokens).

Nothing here runs without CUDA: construction refuses clearly (``SGLangUnavailableError``) on a
machine without a GPU or without SGLang. Tests inject ``engine_factory`` to run it on CPU against a
fake engine that speaks SGLang's stream format.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from dspark_server.backends.sglang_args import (
    SGLANG_VERSION,
    SGLangConfig,
    build_env,
    build_server_kwargs,
    finish_from_meta_info,
    sampling_params_to_sglang,
    spec_counts_from_meta_info,
)
from dspark_server.backends.sglang_runtime import (
    check_draft_for_sglang,
    cuda_status,
    eos_token_ids,
    require_sglang_runtime,
    sglang_engine,
    with_default_files,
)
from dspark_server.config import ModelConfig
from dspark_server.engine.admission import AdmissionCounter, validate_prompt
from dspark_server.engine.backend import LoadSnapshot, SpecSnapshot
from dspark_server.engine.outputs import OutputProcessor
from dspark_server.engine.request import (
    Request,
    RequestOutput,
    SamplingParams,
    Status,
)
from dspark_server.engine.stats import EngineStats
from dspark_server.models.tokenizer import Tokenizer
from dspark_server.planner import LiveSpsPoint, load_sps_table, load_sts_calibration

log = logging.getLogger(__name__)

# After a stop string ends a request here, wait this long for SGLang's final meta_info (it carries
# the request's speculative counters) before answering without them.
FINAL_META_WAIT_S = 0.5
# SGLang's max_running_requests when speculation is on and none is given (speculative_hook.py).
SGLANG_SPEC_DEFAULT_RUNNING = 48
DEFAULT_RUNNING_NO_SPEC = 256


def _discard(_: RequestOutput) -> None:
    pass


class SGLangStream:
    """One request's deltas. The SGLang request is sent on the first ``__anext__``; ``close()``
    (sync, idempotent) aborts it if unfinished."""

    def __init__(
        self, backend: SGLangBackend, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> None:
        self.request_id = request_id
        self._b = backend
        self._req = Request(request_id, prompt_ids, params, _discard)
        self._req.status = Status.RUNNING
        self._rid = uuid.uuid4().hex  # fixed length: SGLang aborts by rid prefix
        self._sgl: Any = None  # SGLang's async generator of output dicts
        self._consumed = 0
        self._done = False
        self._closed = False
        self._released = False
        self._recorded = False  # the finish was counted in the backend's stats
        self._arrival = time.monotonic()
        self._first_token: float | None = None
        self._last_delivery: float | None = None

    def __aiter__(self) -> SGLangStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done or self._closed:
            raise StopAsyncIteration
        try:
            out = await self._next()
        except Exception as exc:
            log.exception("SGLang request %s failed", self.request_id)
            if self._sgl is not None:
                self._b._abort(self._rid)
            out = self._finish(None, error=f"SGLang backend error: {type(exc).__name__}: {exc}")
        if out.finished:
            self._done = True
        return out

    async def _next(self) -> RequestOutput:
        b = self._b
        if self._sgl is None:
            b._prepare_loop()
            b.stats.prompt_tokens += len(self._req.prompt_ids)
            sp = sampling_params_to_sglang(self._req.params, b.eos_token_ids)
            self._sgl = await b.engine.async_generate(
                input_ids=list(self._req.prompt_ids), sampling_params=sp, stream=True, rid=self._rid
            )
        while True:
            try:
                chunk = await self._sgl.__anext__()
            except StopAsyncIteration:
                return self._finish(None, error="SGLang ended the stream without a finish reason")
            out = await self._on_chunk(chunk)
            if out is not None:
                return out

    async def _on_chunk(self, chunk: Mapping[str, Any]) -> RequestOutput | None:
        b, req = self._b, self._req
        meta = chunk.get("meta_info") or {}
        ids = list(chunk.get("output_ids") or [])
        if b.incremental_output:
            new = ids
            self._consumed += len(ids)
        else:  # cumulative output_ids
            new = ids[self._consumed :]
            self._consumed = max(self._consumed, len(ids))
        reason, error = finish_from_meta_info(meta)
        sglang_done = reason is not None
        if error is not None:
            return self._finish(meta, error=error)
        if new:
            now = time.monotonic()
            if self._first_token is None:
                self._first_token = now
                b.stats.observe("ttft_seconds", now - self._arrival)
            elif self._last_delivery is not None:
                b.stats.record_inter_token(now - self._last_delivery)
            self._last_delivery = now
            b.stats.generation_tokens += b.outputs.append(req, new)
        if req.finish_reason is not None:  # our stop (stop string, EOS, max_tokens) came first
            if not sglang_done:
                meta = await self._abort_and_wait_final_meta() or {}
            return self._finish(meta)
        if sglang_done:
            b.outputs.finish(req, reason or "stop")
            return self._finish(meta)
        delta = b.outputs.delta(req, False)
        return delta if (delta.new_token_ids or delta.new_text) else None

    async def _abort_and_wait_final_meta(self) -> Mapping[str, Any] | None:
        self._b._abort(self._rid)
        deadline = time.monotonic() + FINAL_META_WAIT_S
        try:
            while (left := deadline - time.monotonic()) > 0:
                chunk = await asyncio.wait_for(self._sgl.__anext__(), left)
                meta = chunk.get("meta_info") or {}
                if meta.get("finish_reason") is not None:
                    return meta
        except (StopAsyncIteration, asyncio.TimeoutError):
            pass
        except Exception:  # the abort surfaced as an error: the counters are lost, the text is not
            log.debug("no final meta_info after aborting %s", self.request_id, exc_info=True)
        return None

    def _finish(self, meta: Mapping[str, Any] | None, error: str | None = None) -> RequestOutput:
        b, req = self._b, self._req
        if meta:
            counts = spec_counts_from_meta_info(meta, b.gamma, len(req.output_ids))
            req.spec = counts.to_spec_stats()
            counts.add_to(b.stats)
        req.status = Status.FINISHED
        out = b.outputs.delta(req, True, error=error)
        b._record_finish(self, "error" if error else (req.finish_reason or "stop"))
        self._release()
        return out

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self._b._release()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._done:
            return
        b = self._b
        b._abort(self._rid)
        b.outputs.delta(self._req, True)  # drops the detokenizer state
        b._record_finish(self, "abort")
        self._release()
        if self._sgl is not None:
            b._spawn(_quiet_aclose(self._sgl))

    async def aclose(self) -> None:
        self.close()


async def _quiet_aclose(gen: Any) -> None:
    with contextlib.suppress(Exception):
        await gen.aclose()


class SGLangBackend:
    """``sglang.Engine`` (in this process, its scheduler in child processes) as a ``Backend``."""

    def __init__(self, cfg: SGLangConfig, *, engine_factory: Callable[..., Any] | None = None) -> None:
        if engine_factory is None:
            require_sglang_runtime()
            engine_factory = sglang_engine
            cfg = with_default_files(cfg, cuda_status()[1])
        else:
            cfg = with_default_files(cfg, None)
        self.cfg = cfg
        self._factory = engine_factory
        self.tokenizer = Tokenizer(cfg.model_path)
        model_cfg = ModelConfig.from_dir(cfg.model_path)
        self.vocab_size = model_cfg.vocab_size
        self.eos_token_ids = eos_token_ids(cfg.model_path, model_cfg, self.tokenizer)
        self.max_model_len = cfg.max_model_len or model_cfg.max_position_embeddings
        self.gamma = check_draft_for_sglang(cfg) if cfg.speculative else 0
        self.sps_table = None
        if cfg.speculative and cfg.ragged_verify_mode != "static":
            if cfg.sps_table_path:
                self.sps_table = load_sps_table(cfg.sps_table_path)
            else:
                log.warning(
                    "no SPS table (--profile): SGLang's DSpark planner then verifies every "
                    "draft; profile one with `dspark profile --backend sglang`"
                )
            if cfg.sts_path:
                cal = load_sts_calibration(cfg.sts_path)
                if cal.gamma != self.gamma:
                    raise ValueError(
                        f"{cfg.sts_path}: STS calibration is for gamma={cal.gamma}, "
                        f"the server runs gamma={self.gamma}"
                    )
        self.max_running = cfg.max_running or (
            SGLANG_SPEC_DEFAULT_RUNNING if cfg.speculative else DEFAULT_RUNNING_NO_SPEC
        )
        self.max_queued = cfg.max_queued
        self.stats = EngineStats()
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids)
        self.engine: Any = None
        self.incremental_output = False
        self._started = False
        self.admission = AdmissionCounter(self.max_running, self.max_queued)
        self._loop_prepared = False
        self._tasks: set[asyncio.Task] = set()

    # ---- lifecycle --------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._started

    def server_kwargs(self) -> dict[str, Any]:
        return build_server_kwargs(self.cfg)

    def start(self) -> None:
        env = build_env(self.cfg)
        os.environ.update(env)  # read by SGLang's scheduler processes, which inherit it
        kwargs = self.server_kwargs()
        log.info("starting SGLang %s: %s (env %s)", SGLANG_VERSION, kwargs, env)
        self.engine = self._factory(**kwargs)
        tm = getattr(self.engine, "tokenizer_manager", None)
        self.incremental_output = bool(getattr(tm, "incremental_streaming_output", False))
        self._started = True

    def shutdown(self) -> None:
        self._started = False
        engine, self.engine = self.engine, None
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:
                log.exception("SGLang engine shutdown failed")

    def _prepare_loop(self) -> None:
        """First request on the serving loop: let SGLang start its output-handling task now, but
        keep our SIGTERM handler (drain) instead of the one SGLang installs on that loop."""
        if self._loop_prepared:
            return
        self._loop_prepared = True
        tm = getattr(self.engine, "tokenizer_manager", None)
        if tm is None or not hasattr(tm, "auto_create_handle_loop") or getattr(tm, "event_loop", None):
            return
        main = threading.current_thread() is threading.main_thread()
        saved = signal.getsignal(signal.SIGTERM) if main else None
        tm.auto_create_handle_loop()
        if main and saved is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_signal_handler(signal.SIGTERM)
            signal.signal(signal.SIGTERM, saved)

    def _spawn(self, coro: Any) -> None:
        try:
            task = asyncio.get_running_loop().create_task(coro)
        except RuntimeError:
            coro.close()
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- requests ---------------------------------------------------------------------------

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        validate_prompt(prompt_ids, params, self.vocab_size, self.max_model_len)

    @property
    def capacity(self) -> int:
        return self.admission.capacity

    def can_accept(self) -> bool:
        return self.admission.can_accept()

    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> SGLangStream:
        self.validate(prompt_ids, params)
        self.admission.admit()
        return SGLangStream(self, request_id, list(prompt_ids), params)

    def _release(self) -> None:
        self.admission.release()

    def _abort(self, rid: str) -> None:
        tm = getattr(self.engine, "tokenizer_manager", None)
        if tm is None:
            return
        try:
            tm.abort_request(rid=rid)
        except Exception:
            log.exception("aborting SGLang request %s failed", rid)

    def _record_finish(self, stream: SGLangStream, reason: str) -> None:
        if stream._recorded:
            return
        stream._recorded = True
        self.stats.record_finish(stream._req, reason, stream._arrival, stream._first_token)

    # ---- live figures -----------------------------------------------------------------------

    def _sglang_loads(self) -> list[Any]:
        tm = getattr(self.engine, "tokenizer_manager", None)
        reader = getattr(tm, "load_snapshot_reader", None)
        if reader is None:
            return []
        try:
            return list(reader.read_all())
        except Exception:
            log.debug("reading SGLang's load snapshot failed", exc_info=True)
            return []

    def load(self) -> LoadSnapshot:
        admitted = self.admission.admitted
        loads = self._sglang_loads()
        if loads:
            running = sum(int(getattr(x, "num_running_reqs", 0)) for x in loads)
            waiting = sum(int(getattr(x, "num_waiting_reqs", 0)) for x in loads)
            total = sum(int(getattr(x, "max_total_num_tokens", 0)) for x in loads)
            used = sum(int(getattr(x, "num_used_tokens", 0)) for x in loads)
        else:  # no snapshot yet: what we admitted, split at the running limit
            running = min(admitted, self.max_running)
            waiting = admitted - running
            total = used = 0
        s = self.stats
        s.num_running, s.num_waiting = running, waiting
        s.kv_total_pages, s.kv_free_pages = total, max(0, total - used)
        # SGLang's KV pool is counted in token slots: one "page" per token here.
        return LoadSnapshot(
            running=running,
            waiting=waiting,
            admitted=admitted,
            max_running=self.max_running,
            max_queued=self.max_queued,
            kv_total_pages=total,
            kv_free_pages=max(0, total - used),
        )

    def spec_snapshot(self) -> SpecSnapshot | None:
        if not self.cfg.speculative:
            return None
        curve = []
        if self.sps_table is not None:  # SGLang does not refresh its table live: base == live
            curve = [
                LiveSpsPoint(b, s, s, 0, None)
                for b, s in zip(
                    self.sps_table.sample_batch_tokens, self.sps_table.sample_steps_per_sec, strict=True
                )
            ]
        return SpecSnapshot(mode=self.cfg.spec_mode, gamma=self.gamma, sps_curve=curve, drift=[])
