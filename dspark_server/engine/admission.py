"""What every backend checks before it takes a request: the prompt can be served at all, and
there is room for it (at most ``max_running + max_queued`` held at once, else ``QueueFullError``)."""

from __future__ import annotations

import threading

from dspark_server.engine.request import InvalidRequestError, SamplingParams


class QueueFullError(Exception):
    """The backend holds as many requests as it may (running + queued); retry later."""


def validate_prompt(
    prompt_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int
) -> None:
    """Raise ``InvalidRequestError`` (a message for the client) for a request no engine can serve."""
    if not prompt_ids:
        raise InvalidRequestError("the prompt is empty", "prompt")
    if any(not 0 <= t < vocab_size for t in prompt_ids):
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab_size})", "prompt")
    total = len(prompt_ids) + params.max_tokens
    if total > max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {total} tokens ({len(prompt_ids)} in the prompt, {params.max_tokens} for "
            "the completion). Please reduce the length of the prompt or max_tokens.",
            "max_tokens",
        )


class AdmissionCounter:
    """Requests held by a backend, counted synchronously on the caller's thread: ``admit`` takes a
    place or raises ``QueueFullError`` at once (never an unbounded queue); ``release`` gives it
    back when the request's final delta has left."""

    def __init__(self, max_running: int, max_queued: int) -> None:
        self.max_running = max_running
        self.max_queued = max_queued
        self._lock = threading.Lock()
        self._admitted = 0

    @property
    def capacity(self) -> int:
        return self.max_running + self.max_queued

    @property
    def admitted(self) -> int:
        with self._lock:
            return self._admitted

    def can_accept(self) -> bool:
        with self._lock:
            return self._admitted < self.capacity

    def admit(self) -> None:
        with self._lock:
            if self._admitted >= self.capacity:
                raise QueueFullError(
                    f"{self._admitted} requests are running or queued "
                    f"(max_running {self.max_running} + max_queued {self.max_queued})"
                )
            self._admitted += 1

    def release(self) -> None:
        with self._lock:
            self._admitted -= 1
