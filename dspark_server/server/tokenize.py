"""Prompt text -> token ids without stalling the event loop or the engine thread.

Cheap checks come first: the prompt's characters, counted on the parsed strings before any
template or tokenizer runs, against the configured limit (413) and against the model's own bound
(``max_model_len`` x ``Tokenizer.max_token_chars``: a longer text cannot fit the context; 400).
Short texts are then tokenized inline (microseconds); long ones on a small thread pool through the
tokenizer's GIL-releasing batch path, with at most ``max_tokenize_queue`` such jobs admitted at
once (the next one gets 429), so a burst of large bodies neither freezes other requests nor holds
many large encodings in memory at the same time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from dspark_server.config import ServerConfig
from dspark_server.engine.backend import Backend
from dspark_server.server.protocol import APIError

INLINE_CHARS = 4096  # shorter texts are tokenized on the event loop: a thread hop costs more
RETRY_AFTER_BUSY_S = 1


class PromptTokenizer:
    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self._pool: ThreadPoolExecutor | None = None
        self._admitted = 0  # long jobs queued or running (touched on the event loop only)

    def check_chars(self, backend: Backend, chars: int, param: str) -> None:
        """Refuse a prompt by its character count alone (no tokenizing)."""
        limit = self.cfg.max_prompt_chars
        if limit is not None and chars > limit:
            raise APIError(
                413,
                f"The prompt has {chars} characters; this server accepts at most {limit}.",
                param=param,
                code="prompt_too_large",
            )
        bound = backend.max_model_len * backend.tokenizer.max_token_chars
        if chars > bound:
            raise APIError(
                400,
                f"This model's maximum context length is {backend.max_model_len} tokens, and the "
                f"prompt has {chars} characters: more than {bound}, the most that "
                f"{backend.max_model_len} tokens can hold.",
                param=param,
                code="context_length_exceeded",
            )

    async def run(self, fn: Callable[[], list[int]], chars: int, what: str, param: str) -> list[int]:
        """``fn()`` (a tokenizer call on ``chars`` characters); its failures are the client's 400."""
        try:
            if chars <= INLINE_CHARS:
                return fn()
            return await self._off_loop(fn)
        except APIError:
            raise
        except Exception as exc:  # template errors, text the tokenizer rejects: the client's input
            raise APIError(400, f"{what}: {exc}", param=param) from exc

    async def _off_loop(self, fn: Callable[[], list[int]]) -> list[int]:
        if self._admitted >= self.cfg.max_tokenize_queue:
            raise APIError(
                429,
                f"{self._admitted} long prompts are being tokenized; retry later",
                "rate_limit_error",
                code="tokenizer_busy",
                headers={"Retry-After": str(RETRY_AFTER_BUSY_S)},
            )
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max(1, self.cfg.tokenizer_workers), thread_name_prefix="dspark-tokenize"
            )
        self._admitted += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn)
        finally:
            self._admitted -= 1

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
