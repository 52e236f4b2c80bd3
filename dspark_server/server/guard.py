"""What stands in front of the routes: the server's state (backend, drain flag, in-flight count)
and the ASGI guard that checks Bearer auth and the body size limit on ``/v1/*`` and counts the
requests a drain must wait for — answering with OpenAI-style error bodies."""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable
from dataclasses import dataclass

from fastapi.responses import Response
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dspark_server.config import ServerConfig
from dspark_server.engine.backend import Backend
from dspark_server.server.metrics import Metrics
from dspark_server.server.protocol import APIError


@dataclass
class ServerState:
    cfg: ServerConfig
    model_name: str
    metrics: Metrics
    backend: Backend | None = None
    draining: bool = False
    in_flight: int = 0  # /v1/* requests being handled (drain waits for zero)

    @property
    def ready(self) -> bool:
        return self.backend is not None and self.backend.ready and not self.draining

    def attach(self, backend: Backend) -> None:
        self.backend = backend
        self.metrics.attach(backend)


# ---- the guard: auth, body limit, request counting -------------------------------------------


class Guard:
    """Pure ASGI middleware (it must not wrap ``receive`` in a way that hides disconnects).

    On ``/v1/*``: Bearer auth (401), body size limit (413, also for chunked bodies without
    Content-Length: the body is read here, up to the limit, and replayed to the app). Counts every
    response by endpoint and status, and keeps ``state.in_flight`` for draining.
    """

    def __init__(self, app: ASGIApp, state: ServerState, endpoints: Callable[[], set[str]]) -> None:
        self.app = app
        self.state = state
        self._endpoints = endpoints

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

        is_api = path.startswith("/v1/")
        if is_api:
            self.state.in_flight += 1
        try:
            if is_api:
                error = self._check_auth(scope)
                if error is None and scope["method"] in ("POST", "PUT", "PATCH"):
                    error, body_receive = await self._limit_body(scope, receive)
                    if body_receive is None:  # the client left while sending its body
                        return
                    receive = body_receive
                if error is not None:
                    await _send_error(counting_send, error)
                    return
            await self.app(scope, receive, counting_send)
        except Exception:
            status = status or 500
            raise
        finally:
            if is_api:
                self.state.in_flight -= 1
            if status:
                self.state.metrics.count_request(endpoint, status)

    def _check_auth(self, scope: Scope) -> APIError | None:
        key = self.state.cfg.api_key
        if not key:
            return None
        given = Headers(scope=scope).get("authorization", "")
        if hmac.compare_digest(given.encode("utf-8", "replace"), f"Bearer {key}".encode()):
            return None
        return APIError(
            401,
            "Invalid or missing API key (send 'Authorization: Bearer <key>').",
            "authentication_error",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )

    async def _limit_body(self, scope: Scope, receive: Receive) -> tuple[APIError | None, Receive | None]:
        """(413 error or None, a receive that replays the body; None if the client left)."""
        limit = self.state.cfg.max_body_bytes
        too_large = APIError(
            413, f"Request body exceeds the limit of {limit} bytes.", code="request_too_large"
        )
        length = Headers(scope=scope).get("content-length")
        if length is not None and length.strip().isdigit() and int(length) > limit:
            return too_large, receive
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None, None
            body = message.get("body", b"")
            size += len(body)
            if size > limit:
                return too_large, receive
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replay: list[Message] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replaying_receive() -> Message:
            if replay:
                return replay.pop(0)
            return await receive()

        return None, replaying_receive


async def _send_error(send: Send, exc: APIError) -> None:
    body = _error_bytes(exc)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in exc.headers.items()]
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _error_bytes(exc: APIError) -> bytes:
    # ensure_ascii: messages may echo client input, which can hold lone surrogates
    return json.dumps(exc.body(), ensure_ascii=True).encode()


def error_response(exc: APIError) -> Response:
    return Response(
        _error_bytes(exc), status_code=exc.status, headers=exc.headers, media_type="application/json"
    )
