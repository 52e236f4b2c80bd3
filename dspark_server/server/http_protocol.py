"""uvicorn's h11 protocol with the limits an exposed server needs below the ASGI layer.

* A header deadline: from a connection's first byte (or the next request's first byte on a
  kept-alive connection) to its last header, ``header_timeout_s``; then 408 and close. (Between
  requests uvicorn's ``timeout_keep_alive`` applies; the body deadline is the guard's.)
* A connection cap: a connection beyond ``max_connections`` gets 503 at once and is closed, before
  it can hold a socket with a slow request.
* JSON error bodies for what uvicorn answers itself (a malformed request line, a bad
  Content-Length, oversized headers): the OpenAI error shape instead of plain text.
"""

from __future__ import annotations

import asyncio
import http

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from dspark_server.config import ServerConfig
from dspark_server.server.protocol import APIError


def raw_response(exc: APIError) -> bytes:
    """A complete HTTP/1.1 response that closes the connection, written past h11 (which has no
    request to answer yet when a header deadline or the connection cap hits)."""
    body = exc.to_bytes()
    reason = http.HTTPStatus(exc.status).phrase
    lines = [
        f"HTTP/1.1 {exc.status} {reason}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
        *(f"{k.lower()}: {v}" for k, v in exc.headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class GuardedH11Protocol(H11Protocol):
    header_timeout_s: float = ServerConfig.header_timeout_s
    max_connections: int = ServerConfig.max_connections

    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self._refuse(
                APIError(
                    503,
                    f"the server holds its maximum of {self.max_connections} connections; retry later",
                    "service_unavailable",
                    code="too_many_connections",
                    headers={"Retry-After": "1"},
                )
            )
            return
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and self.conn.their_state is h11.IDLE:
            self._arm_header_timer()  # the first byte of the next request on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._cancel_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        self._refuse(
            APIError(400, f"{msg.rstrip('.')}: not a valid HTTP/1.1 request.", code="bad_http_request")
        )

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._on_header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE:
            self._refuse(
                APIError(
                    408,
                    f"The request headers did not arrive within {self.header_timeout_s:g} s.",
                    code="request_timeout",
                )
            )

    def _refuse(self, exc: APIError) -> None:
        self._cancel_header_timer()
        self._unset_keepalive_if_required()
        if not self.transport.is_closing():
            self.transport.write(raw_response(exc))
            self.transport.close()


def protocol_class(cfg: ServerConfig) -> type[GuardedH11Protocol]:
    """The protocol class uvicorn instantiates per connection, with this server's limits."""
    return type(
        "DSparkH11Protocol",
        (GuardedH11Protocol,),
        {"header_timeout_s": cfg.header_timeout_s, "max_connections": cfg.max_connections},
    )
