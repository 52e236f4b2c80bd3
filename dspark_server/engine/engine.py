"""The engine core: requests in, one batched step at a time, token deltas out.

``LLMEngine`` is synchronous and single-threaded: ``step()`` is called by the engine thread
(``engine/loop.py``) or directly by offline callers. Other threads only touch it through
``add_request`` and ``abort``, which go through an inbox processed at the start of each step.
"""

from __future__ import annotations

import functools
import json
import logging
import queue
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dspark_server.config import EngineConfig
from dspark_server.engine.admission import validate_prompt
from dspark_server.engine.batch import SeqChunk
from dspark_server.engine.model_runner import ModelRunner, inference_mode
from dspark_server.engine.outputs import OutputProcessor
from dspark_server.engine.request import (
    Request,
    RequestOutput,
    SamplingParams,
    Status,
)
from dspark_server.engine.sampling import SamplingCache, sample_from_logits
from dspark_server.engine.scheduler import Scheduler, SchedulerOutput
from dspark_server.engine.spec import SpecStepResult, SpeculativeDecoder, build_speculative
from dspark_server.engine.stats import EngineStats
from dspark_server.models.row_ops import take_rows
from dspark_server.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        cfg: EngineConfig,
        runner: ModelRunner | None = None,
        tokenizer: Tokenizer | None = None,
        spec: SpeculativeDecoder | None = None,
    ) -> None:
        """``spec``: the speculative decoder to use; None builds the one ``cfg`` asks for
        (none when there is no drafter or the mode is off)."""
        self.cfg = cfg
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.runner = runner if runner is not None else ModelRunner(cfg)
        self.tokenizer = tokenizer if tokenizer is not None else Tokenizer(cfg.model_dir)
        self.eos_token_ids = eos_token_ids(
            cfg.model_dir, self.runner.target.config.eos_token_ids, self.tokenizer
        )
        self.max_model_len = min(cfg.max_model_len, self.runner.target.config.max_position_embeddings)
        if spec is None and cfg.draft_dir and cfg.spec.mode != "off":
            spec = build_speculative(cfg, self.runner)
        self.spec = spec
        lookahead = self.spec.gamma if self.spec is not None else 0
        self.scheduler = Scheduler(
            cfg, self.runner.allocator, decode_lookahead=lookahead, prefix_needs_context=spec is not None
        )
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids)
        self._sampling = SamplingCache()
        self.stats = EngineStats(kv_total_pages=self.runner.allocator.capacity_pages)
        self.requests: dict[str, Request] = {}
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self.on_step: Callable[[], None] | None = None  # wakes the engine thread
        # the latest step with decoding requests, while the loop stays busy: (its decoding
        # requests, whether all of them drafted, when its measured part ended), so that the
        # next step tells the speculative decoder how long the loop took in between
        self._decode_step_end: tuple[int, bool, float] | None = None
        # whether this step's plain forward keeps the drafter's features (``keeps_features`` at
        # the load a request admitted now joins): where it does not, its requests never draft
        self._keep_features = True

    # ---- thread-safe entry points ------------------------------------------------------------

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        validate_prompt(prompt_ids, params, self.runner.target.config.vocab_size, self.max_model_len)

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        sink: Callable[[RequestOutput], None],
        arrival_time: float | None = None,
    ) -> None:
        """``arrival_time``: when the request reached the server (``time.monotonic()``, a clock
        all processes share); None: now."""
        self.validate(prompt_ids, params)
        req = Request(request_id, list(prompt_ids), params, sink)
        if arrival_time is not None:
            req.arrival_time = arrival_time
        self._inbox.put(("add", req))
        if self.on_step:
            self.on_step()

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        if self.on_step:
            self.on_step()

    # ---- engine thread -----------------------------------------------------------------------

    def has_work(self) -> bool:
        return self.scheduler.num_unfinished > 0 or not self._inbox.empty()

    def process_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                assert isinstance(item, Request)
                if item.request_id in self.requests:
                    item.sink(self.outputs.delta(item, True, error="duplicate request id"))
                    continue
                self.requests[item.request_id] = item
                self.scheduler.add(item)
            else:
                req = self.requests.get(str(item))
                if req is not None:
                    req.finish_reason = "abort"
                    self._finish(req)

    @inference_mode
    def step(self) -> None:
        self.process_inbox()
        if self.spec is not None and self.scheduler.waiting:
            # the load a request admitted now joins: every request running or waiting (a wave
            # of new prompts joins each other); asked only while prompts wait (asked at every
            # step, in-process at 16 requests on the demo pair, the two rules took ~2% of the
            # engine's time under cProfile); a long prompt's later chunks follow the last answer.
            load = min(self.cfg.max_running, self.scheduler.num_unfinished)
            self.scheduler.prefix_needs_context = functools.partial(self.spec.prefix_needs_context, load)
            self._keep_features = self.spec.keeps_features(load)
        sched = self.scheduler.schedule()
        self.stats.record_preemptions(len(sched.preempted))
        if sched.empty:
            self._decode_step_end = None
            self._update_gauges()
            return
        t0 = time.perf_counter()
        try:
            self._run(sched)
        except Exception as exc:  # a bug must not kill the loop or leak KV: fail the batch
            log.exception("engine step failed")
            for req in sched.decodes + [c.request for c in sched.prefills]:
                if not req.finished:
                    req.finish_reason = "error"
                    self._finish(req, error=f"internal engine error: {exc}")
        self.stats.record_step(time.perf_counter() - t0)
        self._update_gauges()
        if not self.has_work():  # the loop goes idle: the time until the next step is not its cost
            self._decode_step_end = None
            if self.spec is not None:
                self.spec.file_lessons(self.runner.allocator)

    def _run(self, sched: SchedulerOutput) -> None:
        now = time.monotonic()
        for req in sched.decodes + [c.request for c in sched.prefills]:
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
        self.stats.prompt_tokens += sum(c.num_tokens for c in sched.prefills)
        spec = self.spec
        if spec is not None and self._decode_step_end is not None:
            n, drafted, ended = self._decode_step_end
            spec.record_outside(n, drafted, time.perf_counter() - ended)
        self._decode_step_end = None
        room = self._draft_room(sched)
        drafting = spec.drafting(sched.decodes, room)[:room] if spec is not None else []
        if spec is not None and drafting:
            self._run_speculative(spec, sched, drafting, room)
            return
        # a plain step; in a speculative mode it also captures the drafter's features
        t0 = time.perf_counter()
        positions = [r.num_computed for r in sched.decodes]
        seq_chunks = [
            SeqChunk(r.table, p, [r.last_token_id]) for r, p in zip(sched.decodes, positions, strict=True)
        ]
        seq_chunks += [SeqChunk(c.request.table, c.start, c.token_ids) for c in sched.prefills]
        tail = [1] * len(sched.decodes) + [1 if c.completes else 0 for c in sched.prefills]
        capture: tuple[int, ...] = ()
        if spec is not None:
            if not self._keep_features:  # a load where the gate does not expect drafting: the
                # prompts prefilled now keep no features, their requests never draft
                for chunk in sched.prefills:
                    chunk.request.context_gap = True
            # (a decoding request keeps what it was admitted with: served on the K=8 twin at 16
            # requests, the load dipped to 15 between a request leaving and the next arriving,
            # and marking every running request there left one in 16 able to draft)
            requests = sched.decodes + [c.request for c in sched.prefills]
            if not all(r.context_gap for r in requests):
                capture = spec.drafter.capture_layers
        result = self.runner.forward(seq_chunks, tail, capture_layers=capture)
        self.stats.record_batch(result.batch.num_tokens, result.seconds)
        completing = [c.request for c in sched.prefills if c.completes]
        self._sample_next(sched.decodes + completing, result.output.logits)
        if spec is not None:
            ended = time.perf_counter()
            seconds = ended - t0
            spec.after_plain(self.runner.allocator, sched.decodes, positions, sched.prefills, result, seconds)
            if sched.decodes:
                self._decode_step_end = (len(sched.decodes), False, ended)
                self.stats.record_spec_step(len(sched.decodes), "plain", None, seconds)

    def _draft_room(self, sched: SchedulerOutput) -> int:
        """The draft tokens this step's budget can still verify, after every decode's anchor and
        the prefill chunks (which the scheduler gave what plain decoding would). A request that
        drafts needs at least one of them: beyond that many drafting requests, a draft pass
        would buy nothing (at 64 requests on the K=8 twin, the steps that shared the forward with
        a full prefill chunk drafted for up to 20 requests and verified none, for ~70 ms each)."""
        prefill_tokens = sum(c.num_tokens for c in sched.prefills)
        return max(0, self.cfg.max_batch_tokens - len(sched.decodes) - prefill_tokens)

    def _run_speculative(
        self, spec: SpeculativeDecoder, sched: SchedulerOutput, drafting: list[Request], room: int
    ) -> None:
        """The speculative step (``room``: the draft tokens the budget leaves) returns what each
        drafting request emits; the engine commits it, samples the completed prefills and the
        decodes that did not draft like the plain path does, and reports back what was kept."""
        t0 = time.perf_counter()
        chosen = {id(r) for r in drafting}
        plain = [r for r in sched.decodes if id(r) not in chosen]
        result: SpecStepResult = spec.step(self.runner, drafting, sched.prefills, room, plain)
        self.stats.record_batch(result.forward.batch.num_tokens, result.forward.seconds)
        kept = [self.commit(d.request, d.tokens, d.spec_round) for d in result.decodes]
        completing = [c.request for c in sched.prefills if c.completes]
        if result.plain or completing:
            rows = torch.tensor(result.plain_rows + result.prefill_rows, dtype=torch.long)
            self._sample_next(result.plain + completing, take_rows(result.forward.output.logits, rows))
        ended = time.perf_counter()
        seconds = ended - t0
        self._decode_step_end = (len(sched.decodes), not plain, ended)
        spec.record(result, kept, seconds)
        choice = "drafts" if sum(d.spec_round[1] for d in result.decodes) else "none"  # verified any?
        self.stats.record_spec_step(len(sched.decodes), choice, result.predicted_seconds, seconds)

    def _sample_next(self, reqs: list[Request], logits: torch.Tensor) -> None:
        """The one place a forward's last-token logits become each request's next token."""
        if not reqs:
            return
        tokens = sample_from_logits(
            logits,
            self._sampling.get([r.params for r in reqs]),
            [r.generator for r in reqs],
            [r.noise_key for r in reqs],
        )
        for req, tok in zip(reqs, tokens.tolist(), strict=True):
            self.commit(req, [tok])

    def commit(self, req: Request, tokens: list[int], spec_round: tuple[int, int, int] | None = None) -> int:
        """Append tokens (stopping where a stop condition hits), stream the delta, finish if done.

        ``spec_round`` = (drafted, verified, accepted) of the speculative round that produced the
        tokens; its statistics are recorded before the delta leaves, so the final one is complete.
        """
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
            self.stats.record_first_token(req)
        kept = self.outputs.append(req, tokens)
        self.stats.generation_tokens += kept
        if spec_round is not None:
            drafted, verified, accepted = spec_round
            req.spec.record_round(drafted, verified, accepted, kept)
            self.stats.record_spec_round(drafted, verified, accepted, kept)
        if req.finish_reason is not None:
            self._finish(req)
        else:
            req.sink(self.outputs.delta(req, False))
        return kept

    def _finish(self, req: Request, error: str | None = None) -> None:
        self.scheduler.remove(req)
        req.status = Status.FINISHED
        self.requests.pop(req.request_id, None)
        self.stats.record_finish(req)
        req.sink(self.outputs.delta(req, True, error=error))

    def _update_gauges(self) -> None:
        self.stats.num_running = len(self.scheduler.running)
        self.stats.num_waiting = len(self.scheduler.waiting)
        alloc = self.runner.allocator
        self.stats.kv_free_pages = alloc.free_pages
        if alloc.cache is not None:
            self.stats.prefix_cache_queries = alloc.cache.queries
            self.stats.prefix_cache_hits = alloc.cache.hits


def eos_token_ids(model_dir: str, from_config: tuple[int, ...], tokenizer: Tokenizer) -> tuple[int, ...]:
    """The ids that end a generation unless ``ignore_eos``: config.json's, generation_config.json's
    and the tokenizer's eos_token."""
    ids = set(from_config)
    gen_cfg = Path(model_dir) / "generation_config.json"
    if gen_cfg.is_file():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token and (tid := tokenizer.token_id(tokenizer.eos_token)) is not None:
        ids.add(tid)
    return tuple(sorted(int(i) for i in ids))
