"""uvicorn's HTTP/1.1 protocol (h11) with a deadline on each request's head.

uvicorn times a connection out only between requests (keep-alive); a client that sends a
request's headers a byte at a time (slowloris) holds its connection, and a file descriptor,
for as long as it likes, and a few thousand such clients take the server off the air. Here a
request's head must be whole `head_timeout` seconds after the connection opened or its first
byte came; BodyLimitMiddleware bounds the body the same way.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol


class HeadDeadlineProtocol(H11Protocol):
    """H11Protocol closing a connection whose request head is late."""

    head_timeout = 30.0
    _head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._head_deadline is None and self._between_requests():
            self._arm()  # the first byte of the next request on a kept-alive connection
        super().data_received(data)
        if not self._between_requests():
            self._disarm()  # the head is whole: the body has the middleware's deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        self._head_deadline = self.loop.call_later(self.head_timeout, self._head_overdue)

    def _disarm(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_overdue(self) -> None:
        self._head_deadline = None
        if not self.transport.is_closing():
            self.transport.close()


def head_deadline_protocol(head_timeout: float) -> type[HeadDeadlineProtocol]:
    """The protocol class for uvicorn's `http=` with this deadline."""
    return type("HeadDeadlineProtocol", (HeadDeadlineProtocol,), {"head_timeout": head_timeout})
