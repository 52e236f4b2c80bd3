"""One request's token deltas as an async iterator, fed from another thread (the native backends)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from dspark_server.engine.request import RequestOutput


class TokenStream:
    """Deltas of one request for the event loop that created it. A producer on another thread
    hands them over with ``push_threadsafe`` (or, batched, with one ``call_soon_threadsafe`` that
    calls ``push`` for several streams); ``close()`` (or ``aclose()``) before the final delta
    aborts the request through ``abort``."""

    def __init__(self, request_id: str, abort: Callable[[str], None]) -> None:
        self.request_id = request_id
        self.loop = asyncio.get_running_loop()
        self._abort = abort
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._done = False  # the final delta was handed to the reader
        self._closed = False

    def push(self, out: RequestOutput) -> None:  # the stream's event loop
        self._queue.put_nowait(out)

    def push_threadsafe(self, out: RequestOutput) -> None:
        try:
            self.loop.call_soon_threadsafe(self._queue.put_nowait, out)
        except RuntimeError:  # the caller's event loop is gone; the request was abandoned
            if not out.finished:
                self._abort(self.request_id)

    def __aiter__(self) -> TokenStream:
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
            self._abort(self.request_id)

    async def aclose(self) -> None:
        self.close()
