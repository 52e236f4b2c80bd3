"""One request's state inside the engine: tokens, sampling settings, finish state, statistics."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import torch

from dspark_server.engine.kv_cache import PageTable
from dspark_server.engine.noise import NoiseKey


class InvalidRequestError(ValueError):
    """A request the engine cannot serve as asked; the message is meant for the client."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# Temperatures below this sample greedily: dividing logits by a denormal would overflow to inf.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = disabled
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or not 0.0 <= self.temperature <= 2.0:
            raise InvalidRequestError(f"temperature must be in [0, 2], got {self.temperature}", "temperature")
        if not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1, 0 or positive, got {self.top_k}", "top_k")
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty", "stop")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SpecStats:
    rounds: int = 0
    draft_tokens: int = 0
    verified_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0  # tokens emitted by speculative rounds (accepted + bonus/corrected)

    def record_round(self, drafted: int, verified: int, accepted: int, emitted: int) -> None:
        self.rounds += 1
        self.draft_tokens += drafted
        self.verified_tokens += verified
        self.accepted_tokens += accepted
        self.emitted_tokens += emitted

    @property
    def mean_acceptance_length(self) -> float:
        return self.emitted_tokens / self.rounds if self.rounds else 1.0

    def as_dict(self) -> dict[str, float | int]:
        return {
            "rounds": self.rounds,
            "draft_tokens": self.draft_tokens,
            "verified_tokens": self.verified_tokens,
            "accepted_tokens": self.accepted_tokens,
            "mean_acceptance_length": self.mean_acceptance_length,
        }


@dataclass(frozen=True)
class RequestOutput:
    """What one engine step produced for one request (a delta, for streaming)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    spec: SpecStats
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass(eq=False)  # identity: ``req in running`` must not compare every field
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sink: Callable[[RequestOutput], None]
    arrival_time: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    table: PageTable = field(default_factory=PageTable)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    output_text: str = ""
    spec: SpecStats = field(default_factory=SpecStats)
    generator: torch.Generator = field(default_factory=torch.Generator)
    first_scheduled_time: float | None = None
    cached_tokens: int | None = None  # prompt tokens found in the prefix cache at first admission
    # its cached prefix lacks the drafter's K/V (taken while the draft gate took plain steps): the
    # drafter cannot read its context, so it decodes without drafting
    context_gap: bool = False
    # positions 0 .. drafter_context - 1 hold the drafter's context K/V; the rest of the computed
    # positions wait in the put-off writes (``engine/spec/context_writes.py`` keeps it)
    drafter_context: int = 0
    first_token_time: float | None = None
    # Text already delivered to the client: stop strings can hold back a tail of output_text.
    sent_text_len: int = 0
    sent_token_len: int = 0

    def __post_init__(self) -> None:
        seed = self.params.seed if self.params.seed is not None else int(torch.randint(0, 2**62, ()))
        self.generator.manual_seed(seed)

    @property
    def noise_key(self) -> NoiseKey | None:
        """Seeded requests: the key of the next token's noise (see ``engine/noise.py``)."""
        if self.params.seed is None:
            return None
        return NoiseKey(self.params.seed, len(self.output_ids))

    @property
    def last_token_id(self) -> int:
        """``all_ids[-1]`` without building the list (once per request per step)."""
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_computed(self) -> int:
        """Tokens whose K/V are in the cache."""
        return self.table.length

    @property
    def is_decoding(self) -> bool:
        """All tokens but the newest are cached: the next step feeds exactly that one token."""
        return self.status is Status.RUNNING and self.num_computed == self.num_tokens - 1

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
