"""The ASGI guard in front of the routes: Bearer auth and the body size limit and read deadline on
``/v1/*``, per-endpoint response counting, and the in-flight count a drain waits for — answering
with OpenAI-style error bodies."""

from __future__ import annotations

import asyncio
import hmac
import time
import weakref
from collections.abc import Callable
from typing import Any

from fastapi.responses import Response
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dspark_server.server.protocol import APIError
from dspark_server.server.state import ServerState

RETRY_AFTER_UNAVAILABLE_S = 5
# Bodies at least this large are handed to the app one at a time, LARGE_BODY_SPACING_S apart:
# parsing a few MB of JSON takes ~15 ms of loop time, and several in a row would hold up every other
# request (/health included) for their sum.
LARGE_BODY_BYTES = 256 * 1024
LARGE_BODY_SPACING_S = 0.02
_CLOSE = {"Connection": "close"}  # the body was not read to its end: the connection cannot be reused


class Guard:
    """Pure ASGI middleware (it must not wrap ``receive`` in a way that hides disconnects).

    On ``/v1/*``: Bearer auth (401; the scheme is case-insensitive), the body size limit (413, also
    for chunked bodies without Content-Length: the body is read here, up to the limit, and
    replayed to the app) and the body deadline (408 when it has not all arrived within
    ``body_timeout_s``; 503 when a drain starts meanwhile). A request counts as in flight for
    draining only once its body has arrived. Counts every response by endpoint and status.
    """

    def __init__(self, app: ASGIApp, state: ServerState, endpoints: Callable[[], set[str]]) -> None:
        self.app = app
        self.state = state
        self._endpoints = endpoints
        self._gates: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        endpoint = path if path in self._endpoints() else "other"
        status = 0

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        counted = False
        release: Callable[[], None] | None = None
        try:
            if path.startswith("/v1/"):
                error = self._check_auth(scope)
                if error is None and scope["method"] in ("POST", "PUT", "PATCH"):
                    error, body = await self._read_body(scope, receive)
                    if error is None and body is None:  # the client left while sending its body
                        return
                    if body is not None:
                        receive, release = await self._replay(body, receive)
                if error is not None:
                    await send_error(counting_send, error)
                    return
                self.state.in_flight += 1
                counted = True
            await self.app(scope, receive, counting_send)
        except Exception:
            status = status or 500
            raise
        finally:
            if release is not None:
                release()
            if counted:
                self.state.in_flight -= 1
            if status:
                self.state.metrics.count_request(endpoint, status)

    def _check_auth(self, scope: Scope) -> APIError | None:
        key = self.state.cfg.api_key
        if not key:
            return None
        scheme, _, given = Headers(scope=scope).get("authorization", "").strip().partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode("utf-8", "replace"), key.encode()
        ):
            return None
        return APIError(
            401,
            "Invalid or missing API key (send 'Authorization: Bearer <key>').",
            "authentication_error",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )

    async def _replay(self, body: bytes, receive: Receive) -> tuple[Receive, Callable[[], None] | None]:
        """A receive that hands the app the whole body, then the connection's own messages. A large
        body first waits for its turn, which ends a short while after the app took it."""
        replay: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]
        release: Callable[[], None] | None = None
        if len(body) >= LARGE_BODY_BYTES:
            loop = asyncio.get_running_loop()
            gate = self._gates.get(loop)
            if gate is None:
                gate = self._gates[loop] = asyncio.Semaphore(1)
            await gate.acquire()
            held = [True]

            def release() -> None:
                if held:
                    held.clear()
                    gate.release()

        async def replaying_receive() -> Message:
            if replay:
                if release is not None:
                    asyncio.get_running_loop().call_later(LARGE_BODY_SPACING_S, release)
                return replay.pop(0)
            return await receive()

        return replaying_receive, release

    async def _read_body(self, scope: Scope, receive: Receive) -> tuple[APIError | None, bytes | None]:
        """(an error or None, the whole body; both None if the client left)."""
        cfg = self.state.cfg
        limit = cfg.max_body_bytes
        too_large = APIError(
            413, f"Request body exceeds the limit of {limit} bytes.", code="request_too_large", headers=_CLOSE
        )
        length = Headers(scope=scope).get("content-length")
        if length is not None and length.strip().isdigit() and int(length) > limit:
            return too_large, None
        deadline = time.monotonic() + cfg.body_timeout_s
        chunks: list[bytes] = []
        size = 0
        drain: asyncio.Future[None] | None = None
        try:
            while True:
                message, drain = await self._receive_before(receive, deadline, drain)
                if message is None:
                    if self.state.draining:
                        return _draining_error(), None
                    return APIError(
                        408,
                        f"The request body did not arrive within {cfg.body_timeout_s:g} s.",
                        code="request_timeout",
                        headers=_CLOSE,
                    ), None
                if message["type"] == "http.disconnect":
                    return None, None
                body = message.get("body", b"")
                size += len(body)
                if size > limit:
                    return too_large, None
                chunks.append(body)
                if not message.get("more_body", False):
                    break
        finally:
            if drain is not None:
                drain.cancel()
        body = b"".join(chunks)
        chunks.clear()
        return None, body

    async def _receive_before(
        self, receive: Receive, deadline: float, drain: asyncio.Future[None] | None
    ) -> tuple[Message | None, asyncio.Future[None] | None]:
        """The next message, or None at the deadline or when a drain starts."""
        if self.state.draining:
            return None, drain
        if drain is None:
            drain = asyncio.ensure_future(self.state.drain_started.wait())
        nxt = asyncio.ensure_future(receive())
        waiting: set[asyncio.Future[Any]] = {nxt, drain}
        done, _ = await asyncio.wait(
            waiting, timeout=max(0.0, deadline - time.monotonic()), return_when=asyncio.FIRST_COMPLETED
        )
        if nxt in done:
            return nxt.result(), drain
        nxt.cancel()
        await asyncio.gather(nxt, return_exceptions=True)
        return None, drain


def _draining_error() -> APIError:
    return APIError(
        503,
        "the server is shutting down; retry later",
        "service_unavailable",
        code="server_draining",
        headers={"Retry-After": str(RETRY_AFTER_UNAVAILABLE_S), **_CLOSE},
    )


async def send_error(send: Send, exc: APIError) -> None:
    body = exc.to_bytes()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in exc.headers.items()]
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def error_response(exc: APIError) -> Response:
    return Response(
        exc.to_bytes(), status_code=exc.status, headers=exc.headers, media_type="application/json"
    )
