"""The interface between the HTTP layer and an engine (native or SGLang)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from dspark_server.engine.request import RequestOutput, SamplingParams
from dspark_server.engine.stats import EngineStats
from dspark_server.models.tokenizer import Tokenizer


class Backend(Protocol):
    tokenizer: Tokenizer
    stats: EngineStats
    max_model_len: int

    @property
    def ready(self) -> bool: ...

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ``InvalidRequestError`` for requests that can never be served."""
        ...

    def generate(self, request_id: str, prompt_ids: list[int],
                 params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Stream deltas; leaving the iterator early aborts the request."""
        ...

    def can_accept(self) -> bool:
        """False when the waiting queue is full (the server answers 429)."""
        ...

    def start(self) -> None: ...

    def shutdown(self) -> None: ...
