"""What runs before a request's body is read, in the server and in the ``--replicas`` router alike: the API key,
then the body's size, counted as it arrives (``Content-Length`` or chunked) so an oversized body is refused after at
most ``max_body_bytes`` of it were held in memory, never parsed whole.

    check = await guard(scope, receive, api_key=..., max_body_bytes=...)
    if check.rejection is not None: answer it, else call the app with check.receive (the body, replayed)
"""

from __future__ import annotations

import hmac
import re
from dataclasses import dataclass

from fastapi.responses import JSONResponse, Response

from minillm.entrypoints.openai import protocol as p

BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def error_response(status: int, info: p.ErrorInfo, headers: dict | None = None) -> JSONResponse:
    """OpenAI's error body, ``{"error": info}``."""
    return JSONResponse(p.ErrorResponse(error=info).model_dump(), status_code=status, headers=headers)


def _refusal(status: int, message: str, code: str) -> JSONResponse:
    return error_response(status, p.ErrorInfo(message=message, type="invalid_request_error", code=code))


def needs_key(scope) -> bool:
    """The key guards ``/v1`` and every route that takes a body; ``/health`` and ``/metrics`` stay open."""
    return scope["path"].startswith("/v1") or scope["method"] in BODY_METHODS


def authorized(headers: dict[str, str], api_key: str) -> bool:
    """``Authorization: Bearer <api_key>``, compared in constant time."""
    return hmac.compare_digest(headers.get("authorization", "").encode(), f"Bearer {api_key}".encode())


@dataclass
class Checked:
    """``rejection``: the response to send instead of calling the app (None: go on); ``receive``: what the app
    reads from — the body already read, replayed as one message, then the connection's own messages (a disconnect)."""

    rejection: Response | None
    receive: object


def host_name(value: str) -> str:
    """The name of a ``Host`` header, without its port ("[::1]:8000" -> "[::1]", "a.b:80" -> "a.b"), lowercased."""
    m = re.fullmatch(r"(\[[^\]]*\]|[^:]*)(:\d*)?", value.strip())
    return (m.group(1) if m else value).lower()


def host_set(hosts) -> frozenset[str] | None:
    """``--allowed-hosts`` as the set ``guard`` compares with (None stays None: any host)."""
    return None if hosts is None else frozenset(host_name(h) for h in hosts)


async def guard(scope, receive, *, api_key: str | None, max_body_bytes: int,
                allowed_hosts: frozenset[str] | None = None) -> Checked:
    """The ``Host`` (400 unless in ``allowed_hosts``; None: any), the key (401), the declared length (413), then
    the body read to at most ``max_body_bytes`` (413 past it).  Memory: at most ``max_body_bytes`` plus one chunk
    of the body per request."""
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
    if allowed_hosts is not None and host_name(headers.get("host", "")) not in allowed_hosts:
        return Checked(_refusal(400, "the Host header names a host this server does not answer for (see its "
                                     "--allowed-hosts)", "invalid_host"), receive)
    if api_key is not None and needs_key(scope) and not authorized(headers, api_key):
        return Checked(_refusal(401, "Incorrect API key provided: pass it as 'Authorization: Bearer <key>'",
                                      "invalid_api_key"), receive)
    too_large = _refusal(413, f"the request body is over the limit of {max_body_bytes} bytes: send less",
                               "request_too_large")
    length = headers.get("content-length", "0")
    if length.isdigit() and int(length) > max_body_bytes:
        return Checked(too_large, receive)
    if scope["method"] not in BODY_METHODS:
        return Checked(None, receive)
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":  # gone while sending: nobody to answer
            return Checked(Response(status_code=499), receive)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_body_bytes:
            return Checked(too_large, receive)
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return Checked(None, replay(b"".join(chunks), receive))


class Guard:
    """Pure ASGI middleware that runs ``guard`` before ``app`` (the router's front door; the server's ``Gate``
    also counts responses)."""

    def __init__(self, app, *, api_key: str | None, max_body_bytes: int, allowed_hosts: frozenset[str] | None = None):
        self.app, self.api_key, self.max_body_bytes, self.allowed_hosts = app, api_key, max_body_bytes, allowed_hosts

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        checked = await guard(scope, receive, api_key=self.api_key, max_body_bytes=self.max_body_bytes,
                              allowed_hosts=self.allowed_hosts)
        await (checked.rejection or self.app)(scope, checked.receive, send)


def replay(body: bytes, receive):
    """An ASGI ``receive`` that returns ``body`` once, then defers to ``receive`` (the disconnect, later)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive_replayed():
        return pending.pop() if pending else await receive()

    return receive_replayed
