"""Connection limits for the server and the router: slow or idle clients are dropped, so sockets cannot be held.

uvicorn closes a keep-alive connection idle between requests after ``timeout_keep_alive`` seconds, but it sets no
deadline on a request's headers: a client that connects and sends nothing, or trickles a header a byte at a time
("slowloris"), or stops halfway through its body, holds its socket forever.  ``HeaderDeadline`` (a subclass of
uvicorn's HTTP protocol) closes a connection whose next request's headers have not all arrived within
``timeout_headers`` seconds of its first byte (or of the connection being made), one whose body pauses that long
between chunks, and one whose headers run past ``max_header_bytes`` (431).  Once the headers and body are in, the
request runs as long as it needs (a long stream is not a slow client).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from minillm.entrypoints.openai.limits import (
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_TIMEOUT_HEADERS_S,
    DEFAULT_TIMEOUT_KEEP_ALIVE_S,
)

HEADERS_TOO_LARGE = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\n"
                     b"connection: close\r\n\r\n")


@dataclass(frozen=True)
class ConnectionLimits:
    """How long and how large a client may be before it is dropped."""

    timeout_keep_alive_s: float = DEFAULT_TIMEOUT_KEEP_ALIVE_S
    """Seconds an idle keep-alive connection stays open between requests."""
    timeout_headers_s: float = DEFAULT_TIMEOUT_HEADERS_S
    """Seconds a client has to send a request's headers, from its first byte (or the connection's start)."""
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    """The most bytes of request line and headers per request (431 past it)."""

    def __post_init__(self):
        for name in ("timeout_keep_alive_s", "timeout_headers_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)!r}")
        if not self.max_header_bytes >= 1024:
            raise ValueError(f"max_header_bytes must be >= 1024, got {self.max_header_bytes!r}")

    def uvicorn_options(self) -> dict:
        """Keyword arguments for ``uvicorn.Config``: the protocol class and uvicorn's own limits."""
        return {"http": header_deadline_protocol(self), "timeout_keep_alive": self.timeout_keep_alive_s,
                "h11_max_incomplete_event_size": self.max_header_bytes}


def default_protocol() -> type[asyncio.Protocol]:
    """The HTTP/1.1 protocol uvicorn's ``http="auto"`` picks: httptools when installed, else h11."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        return HttpToolsProtocol
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol


def header_deadline_protocol(limits: ConnectionLimits, base: type | None = None) -> type[asyncio.Protocol]:
    """``base`` (default: ``default_protocol()``) with a deadline and a byte cap on each request's headers."""
    base = base or default_protocol()

    class HeaderDeadline(base):
        """Between requests (no request being answered) a deadline runs from the first byte; a request whose
        headers complete starts a cycle, which disarms it."""

        def connection_made(self, transport):
            self._deadline, self._header_bytes = None, 0
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc):
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            waiting, before = self._between_requests(), self.cycle
            super().data_received(data)
            if self.cycle is not before:  # a request's headers are complete
                self._disarm()
                self._header_bytes = 0
            elif waiting:  # still reading a request line and headers (or the rest of a refused body)
                self._arm()
                self._header_bytes += len(data)
                if self._header_bytes > limits.max_header_bytes:
                    refused_body = self.cycle is not None and self.cycle.more_body  # answered already: just close
                    self._drop(b"" if refused_body else HEADERS_TOO_LARGE)
                    return
            if self._body_arriving():  # the same deadline between a body's chunks, from the latest one
                self._disarm()
                self._arm()
            elif not self._between_requests():  # headers and body in: the request runs as long as it needs
                self._disarm()

        def _between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _body_arriving(self) -> bool:
            return not self._between_requests() and self.cycle.more_body

        def _arm(self) -> None:
            if self._deadline is None:
                self._deadline = self.loop.call_later(limits.timeout_headers_s, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if self._between_requests() or self._body_arriving():
                self._drop(b"")

        def _drop(self, reply: bytes) -> None:
            self._disarm()
            if not self.transport.is_closing():
                if reply:
                    self.transport.write(reply)
                self.transport.close()

    return HeaderDeadline


def yielding(send):
    """An ASGI ``send`` that lets the event loop run once after each body chunk.  A stream with a backlog of
    tokens otherwise writes them all in one loop iteration; if the client has just reset the connection, each write
    after the first lands on a closed transport (asyncio warns "socket.send() raised exception." from the fifth on)
    before the loop can run ``connection_lost``, which makes uvicorn drop further writes.  One extra iteration per
    chunk; it also interleaves concurrent streams' writes."""

    async def send_then_yield(message):
        await send(message)
        if message["type"] == "http.response.body" and message.get("more_body", False):
            await asyncio.sleep(0)

    return send_then_yield
