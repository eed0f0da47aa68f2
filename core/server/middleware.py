"""Pure ASGI middleware (no BaseHTTPMiddleware: it hides client disconnects): Bearer
authentication, a request body size limit, per-endpoint counters and request ids."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from pkv.core.server.errors import error_bytes

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Everything needs the key except these: a route added later is protected by default.
OPEN_PATHS = frozenset({"/health", "/ping"})  # probes carry no key
# What shows or changes every tenant's state needs the first key (the operator's) where
# there are several: /admin/* (other tenants' requests) and the runtime adapter endpoints.
OPERATOR_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})


def operator_only(path: str) -> bool:
    return path.startswith("/admin/") or path in OPERATOR_PATHS


async def send_error(send: Send, scope: Scope, status: int, message: str,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """Answer `status` with the error object of the API at the request's path."""
    body = error_bytes(status, message, scope["path"])
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


def split_keys(value: str | None) -> list[str]:
    """`--api-key k1,k2`: one key per tenant."""
    return [k.strip() for k in (value or "").split(",") if k.strip()]


def tenant_id(api_key: str) -> str:
    """A stable name for a key's tenant that does not reveal the key."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:16]


def request_tenant(scope: Scope) -> str | None:
    """The tenant AuthMiddleware found for this request (None without keys)."""
    return scope.get("state", {}).get("pkv_tenant")


class AuthMiddleware:
    """Require `Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`) on every
    path but /health, for any of the keys; the request is then its key's tenant (prefix-cache
    blocks are never shared across tenants). The operator's paths take the first key only."""

    def __init__(self, app: ASGIApp, api_keys: list[str]) -> None:
        self.app = app
        self.expected = [(f"Bearer {key}".encode(), tenant_id(key)) for key in api_keys]
        self.operator = self.expected[0][1]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            headers = dict(scope["headers"])
            given = headers.get(b"authorization", b"")
            if given[:7].lower() == b"bearer ":  # an auth scheme's name has no case (RFC 9110)
                given = b"Bearer " + given[7:]
            if not given and b"x-api-key" in headers:  # Anthropic's clients send this
                given = b"Bearer " + headers[b"x-api-key"]
            tenant = None
            for expected, tid in self.expected:  # every key compared: the time says nothing
                if hmac.compare_digest(given, expected):
                    tenant = tid
            if tenant is None:
                await send_error(send, scope, 401,
                                 "invalid or missing API key (Authorization: Bearer, or x-api-key)",
                                 headers=[(b"www-authenticate", b"Bearer")])
                return
            if tenant != self.operator and operator_only(scope["path"]):
                await send_error(send, scope, 403, f"{scope['path']} shows or changes every "
                                 "tenant's state: it takes the server's first API key")
                return
            scope.setdefault("state", {})["pkv_tenant"] = tenant
        await self.app(scope, receive, send)


# uvicorn bounds headers only when they arrive in pieces; one large read gets through.
MAX_HEADER_BYTES = 32 * 1024


class BodyLimitMiddleware:
    """Answer 431 to headers over MAX_HEADER_BYTES, 413 to bodies over `max_bytes` (by
    Content-Length or by counting chunks), and 408 to a body not complete `body_timeout`
    seconds after the request started (a client dribbling bytes holds no connection for
    long; nothing reaches the engine before the body is whole)."""

    def __init__(self, app: ASGIApp, max_bytes: int, body_timeout: float = 30.0) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.body_timeout = body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if sum(len(k) + len(v) for k, v in scope["headers"]) > MAX_HEADER_BYTES:
            await send_error(send, scope, 431,
                             f"request headers are over {MAX_HEADER_BYTES} bytes")
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await send_error(send, scope, 413, f"request body is over {self.max_bytes} bytes")
            return
        received = 0
        started = body_done = answered = False
        deadline = time.monotonic() + self.body_timeout

        async def refuse(status: int, message: str) -> Message:
            # Answer here: FastAPI turns an exception raised while it reads the body into its
            # own 400. The app then sees the client leave and its reply is dropped.
            nonlocal answered
            if not started:
                await send_error(send, scope, status, message)
                answered = True
            return {"type": "http.disconnect"}

        async def limited_receive() -> Message:
            nonlocal received, body_done
            if body_done:  # later receives wait for the client to leave: no deadline
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return await refuse(408, f"request body did not arrive within "
                                         f"{self.body_timeout:g} s")
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:  # (chunked: no Content-Length said so before)
                    return await refuse(413, f"request body is over {self.max_bytes} bytes")
                body_done = not message.get("more_body", False)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if not answered:
                started = started or message["type"] == "http.response.start"
                await send(message)

        await self.app(scope, limited_receive, tracking_send)


class EndpointCounterMiddleware:
    """Count every request by endpoint (one of `endpoints`, else "other": a bounded label)
    and the status it was answered with, rejections by outer layers included."""

    def __init__(self, app: ASGIApp, count: Callable[[str, int], None],
                 endpoints: frozenset[str]) -> None:
        self.app = app
        self.count = count
        self.endpoints = endpoints

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = scope["path"] if scope["path"] in self.endpoints else "other"
        status = 500  # if the app fails before it answers

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            self.count(endpoint, status)


def _client_request_id(value: bytes | None) -> bytes | None:
    """A request id the client sent, if it is one to repeat: 1-128 visible ASCII characters."""
    if value and len(value) <= 128 and all(33 <= c <= 126 for c in value):
        return value
    return None


access_logger = logging.getLogger("pkv.access")


class RequestIdMiddleware:
    """Answer every request with its id in `x-request-id` (OpenAI's header) and `request-id`
    (Anthropic's): the one the client or a proxy sent in `x-request-id`, else a fresh one. The
    `openai` and `anthropic` clients show it as a response's `_request_id`, so a user's report
    and the server's log name the same request: one access line per request (logger
    `pkv.access`, INFO: method, path, status, seconds, the id and the engine requests it made,
    whose ids the engine's own log lines name). Never a prompt, a query string or a key."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = _client_request_id(dict(scope["headers"]).get(b"x-request-id"))
        request_id = given or f"req_{uuid.uuid4().hex}".encode()
        state = scope.setdefault("state", {})  # (a handler's `request.state`)
        state["request_id"] = request_id.decode()
        started, status = time.monotonic(), 0

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []),
                                      (b"x-request-id", request_id), (b"request-id", request_id)]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            access_logger.info("%s %s %d %.3fs %s%s", scope["method"], scope["path"], status,
                               time.monotonic() - started, state["request_id"],
                               "".join(f" {i}" for i in state.get("engine_request_ids", ())))
