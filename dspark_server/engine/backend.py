"""The interface between the HTTP layer and an engine (native or SGLang)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from dspark_server.engine.admission import QueueFullError
from dspark_server.engine.request import RequestOutput, SamplingParams
from dspark_server.engine.stats import EngineStats
from dspark_server.models.tokenizer import Tokenizer
from dspark_server.planner import LiveSpsPoint, PositionDrift

if TYPE_CHECKING:
    from dspark_server.engine.engine import LLMEngine

__all__ = [
    "Backend",
    "LoadSnapshot",
    "QueueFullError",
    "RequestStream",
    "SpecSnapshot",
    "native_spec_snapshot",
]


@dataclass(frozen=True)
class SpecSnapshot:
    """The speculative decoder's configuration and live planner inputs, for metrics."""

    mode: str  # fixed | threshold | dspark
    gamma: int
    sps_curve: list[LiveSpsPoint] = field(default_factory=list)  # empty: no SPS table (not dspark)
    drift: list[PositionDrift] = field(default_factory=list)
    # dspark mode's draft gate, per load bucket (lowest load of the bucket): a request's tokens per
    # second in drafting steps (at the bucket's mean forecast) and in plain steps
    gate_rates: dict[int, tuple[float, float]] = field(default_factory=dict)
    # and the step times it prices them with: {(choice, part): seconds}, part "step" (the step's
    # own time) or "loop" (the engine loop's time after it)
    gate_times: dict[int, dict[tuple[str, str], float]] = field(default_factory=dict)


def native_spec_snapshot(engine: LLMEngine) -> SpecSnapshot | None:
    """The native engine's speculative decoder, live (None when speculation is off): what both
    native backends report, the threaded one at scrape time, the engine process with its step
    reports."""
    spec = engine.spec
    if spec is None:
        return None
    curve = spec.live_sps.curve() if spec.live_sps is not None else []
    rates = spec.gate.rates() if spec.gate is not None else {}
    times = spec.gate.times() if spec.gate is not None else {}
    return SpecSnapshot(
        mode=engine.cfg.spec.mode,
        gamma=spec.gamma,
        sps_curve=curve,
        drift=spec.drift.summary(),
        gate_rates={1 << (bucket - 1): r for bucket, r in rates.items()},
        gate_times={1 << (bucket - 1): t for bucket, t in times.items()},
    )


@dataclass(frozen=True)
class LoadSnapshot:
    """Live load figures, read at scrape time (not at the end of the last step)."""

    running: int
    waiting: int
    admitted: int  # requests accepted by the backend and not finished yet
    max_running: int
    max_queued: int
    kv_total_pages: int
    kv_free_pages: int


class RequestStream(Protocol):
    """Deltas of one request. ``close()`` aborts it if unfinished (idempotent)."""

    request_id: str

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    async def __anext__(self) -> RequestOutput: ...

    async def aclose(self) -> None: ...

    def close(self) -> None: ...


class Backend(Protocol):
    tokenizer: Tokenizer
    stats: EngineStats
    max_model_len: int

    @property
    def ready(self) -> bool: ...

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ``InvalidRequestError`` for requests that can never be served."""
        ...

    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> RequestStream:
        """Admit the request now (raise ``QueueFullError`` when full, ``InvalidRequestError``
        when invalid) and return its delta stream; closing the stream early aborts it."""
        ...

    def can_accept(self) -> bool:
        """False when another request would be refused with ``QueueFullError``."""
        ...

    def load(self) -> LoadSnapshot: ...

    def spec_snapshot(self) -> SpecSnapshot | None:
        """None when speculative decoding is off."""
        ...

    def start(self) -> None: ...

    def shutdown(self) -> None: ...
