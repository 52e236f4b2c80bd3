"""Delivering a request's deltas: SSE (with keep-alive comments while nothing is ready) or one
JSON body, both watching for the client going away, the queue-wait deadline and the drain cut.

* Keep-alive: a stream with nothing to send for ``sse_keepalive_s`` sends ``: keep-alive``, an
  SSE comment clients ignore, so proxies and clients see a live connection while it is queued.
* Queue-wait deadline: no first delta within ``queue_timeout_s`` aborts the request; a stream
  ends with an error event (code ``queue_timeout``) and ``[DONE]``, a JSON request gets 503.
* Drain cut: when the drain timeout passes, what is still streaming ends with an error event
  (code ``server_shutdown``) and ``[DONE]``; a JSON request gets 503 — never a torn connection.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from dspark_server.engine.backend import RequestStream
from dspark_server.engine.request import RequestOutput
from dspark_server.server.guard import RETRY_AFTER_UNAVAILABLE_S, error_response
from dspark_server.server.protocol import APIError
from dspark_server.server.responses import Formatter
from dspark_server.server.state import ServerState

KEEP_ALIVE = b": keep-alive\n\n"
DONE = "data: [DONE]\n\n"


def queue_timeout_error(seconds: float) -> APIError:
    return APIError(
        503,
        f"the request waited {seconds:g} s without being served (the server is overloaded); retry later",
        "service_unavailable",
        code="queue_timeout",
        headers={"Retry-After": str(RETRY_AFTER_UNAVAILABLE_S)},
    )


def shutdown_error() -> APIError:
    return APIError(
        503,
        "the server is shutting down: this response was cut off at the drain timeout",
        "service_unavailable",
        code="server_shutdown",
    )


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=True)}\n\n"


async def _first(stream: RequestStream, timeout_s: float) -> RequestOutput | None:
    """The first delta, or None at the queue-wait deadline (the request is aborted then)."""
    try:
        return await asyncio.wait_for(stream.__anext__(), timeout_s)
    except TimeoutError:
        stream.close()
        return None


async def sse_events(
    stream: RequestStream, fmt: Formatter, include_usage: bool, queue_timeout_s: float
) -> AsyncIterator[str]:
    try:
        out = await _first(stream, queue_timeout_s)
    except StopAsyncIteration:
        yield DONE
        return
    if out is None:
        yield _event(queue_timeout_error(queue_timeout_s).body())
        yield DONE
        return
    first = True
    while True:
        if out.error:
            yield _event(APIError(500, out.error, "internal_error").body())
            break
        events = [_event(chunk) for chunk in fmt.stream_chunks(out, first, include_usage)]
        first = False
        if events:
            yield "".join(events)
        try:
            out = await stream.__anext__()
        except StopAsyncIteration:
            break
    yield DONE


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class EngineSSEResponse(StreamingResponse):
    """SSE that watches for the client going away while the engine works (the request is aborted
    at once, not when the next chunk fails to send), sends keep-alive comments while there is
    nothing to send, and ends with an error event and [DONE] when the drain cuts it off."""

    def __init__(self, events: AsyncIterator[str], stream: RequestStream, state: ServerState) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._events = events
        self._stream = stream
        self._state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        cut = asyncio.ensure_future(self._state.streams_cut.wait())
        events = self._events.__aiter__()
        nxt: asyncio.Future[str] | None = None
        keepalive = max(0.01, self._state.cfg.sse_keepalive_s)

        async def body(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        try:
            await send(
                {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            )
            while True:
                if nxt is None:
                    nxt = asyncio.ensure_future(events.__anext__())
                waiting: set[asyncio.Future[Any]] = {nxt, watcher, cut}
                done, _ = await asyncio.wait(waiting, timeout=keepalive, return_when=asyncio.FIRST_COMPLETED)
                if nxt in done:
                    try:
                        chunk = nxt.result()
                    except StopAsyncIteration:
                        break
                    nxt = None
                    await body(chunk.encode())
                elif watcher in done:  # the client went away
                    return
                elif cut in done:
                    await body((_event(shutdown_error().body()) + DONE).encode())
                    break
                else:
                    await body(KEEP_ALIVE)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away while we were sending
            return
        finally:
            for task in (watcher, cut, nxt):
                if task is not None:
                    task.cancel()
            if nxt is not None:
                await asyncio.gather(nxt, return_exceptions=True)
            self._stream.close()
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await asyncio.gather(aclose(), return_exceptions=True)


async def collect_until_disconnect(
    request: Request, stream: RequestStream, fmt: Formatter, state: ServerState
) -> Response:
    outputs: list[RequestOutput] = []
    timeout_s = state.cfg.queue_timeout_s

    async def collect() -> bool:
        try:
            out = await _first(stream, timeout_s)
        except StopAsyncIteration:
            return True
        if out is None:
            return False
        outputs.append(out)
        async for out in stream:
            outputs.append(out)
        return True

    task = asyncio.ensure_future(collect())
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    cut = asyncio.ensure_future(state.streams_cut.wait())
    try:
        done, _ = await asyncio.wait({task, watcher, cut}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done:  # the client went away, or the drain cut it: nobody gets the answer
            stream.close()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return error_response(shutdown_error()) if cut in done else Response(status_code=499)
        if not task.result():
            return error_response(queue_timeout_error(timeout_s))
    finally:
        watcher.cancel()
        cut.cancel()
        stream.close()
    if not outputs or outputs[-1].error:
        raise APIError(500, (outputs[-1].error if outputs else None) or "no output", "internal_error")
    return JSONResponse(fmt.full_response(outputs))
