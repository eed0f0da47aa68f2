"""OpenAI's Batch API file format, answered in process by the same app `pkv serve` runs.

Each input line, `{"custom_id", "method": "POST", "url", "body"}`, is one request to that
endpoint (`/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`, `/v1/responses`, ...),
sent through the ASGI app without a socket: the same validation, errors and engine as over
HTTP. Each output line is OpenAI's: `{"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}`, the endpoint's answer (an error object for a 4xx) in
`response`, and `error` for a line that could not be sent at all.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass
class BatchLine:
    """One input line: what to send, or why it cannot be sent."""

    number: int  # 1-based, for messages
    custom_id: str | None
    url: str = ""
    body: dict[str, Any] | None = None
    problem: str | None = None


def parse_batch(lines: Iterable[bytes | str]) -> list[BatchLine]:
    """Every non-blank line, each checked on its own: a bad line (not UTF-8, not JSON, not a
    request) is answered with an error line, the others still run."""
    out: list[BatchLine] = []
    seen: set[str] = set()
    for number, raw in enumerate(lines, start=1):
        try:
            text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        except UnicodeDecodeError as exc:
            out.append(BatchLine(number, None, problem=f"line {number} is not UTF-8: {exc}"))
            continue
        if text.strip():
            out.append(_parse_line(number, text, seen))
    return out


def _parse_line(number: int, text: str, seen: set[str]) -> BatchLine:
    try:
        item = json.loads(text)
    except (ValueError, RecursionError) as exc:
        return BatchLine(number, None, problem=f"line {number} is not JSON: "
                                               f"{exc or type(exc).__name__}")
    if not isinstance(item, dict):
        return BatchLine(number, None, problem=f"line {number} must be a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return BatchLine(number, None, problem=f"line {number}: custom_id must be a string")
    if custom_id in seen:
        return BatchLine(number, custom_id,
                         problem=f"line {number}: custom_id {custom_id!r} is used twice")
    seen.add(custom_id)
    url, body = item.get("url"), item.get("body")
    if item.get("method", "POST") != "POST":
        return BatchLine(number, custom_id, problem=f"line {number}: method must be POST")
    if not isinstance(url, str) or not url.startswith("/"):
        return BatchLine(number, custom_id,
                         problem=f"line {number}: url must be an endpoint's path, e.g. "
                                 "/v1/chat/completions")
    if not isinstance(body, dict):
        return BatchLine(number, custom_id, problem=f"line {number}: body must be an object")
    if body.get("stream") or body.get("background"):
        what = "stream" if body.get("stream") else "run in the background"
        return BatchLine(number, custom_id,
                         problem=f"line {number}: a batch request cannot {what}")
    return BatchLine(number, custom_id, url, body)


async def answer_batch(app: Any, lines: list[BatchLine], concurrency: int,
                       done: Callable[[dict[str, Any]], None] | None = None,
                       headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """The output line of every input line, in input order; at most `concurrency` requests
    in flight (the engine batches them). `done` is called as each one ends. `headers`: sent
    with every request (the API key, where the app requires one)."""
    limit = asyncio.Semaphore(concurrency)
    # A route's unhandled error answers its line with a 500, as over HTTP, not the batch
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://pkv-batch",
                                 headers=headers or {}, timeout=None) as client:

        async def one(line: BatchLine) -> dict[str, Any]:
            async with limit:
                result = await _send(client, line)
            if done is not None:
                done(result)
            return result

        return list(await asyncio.gather(*(one(line) for line in lines)))


async def _send(client: httpx.AsyncClient, line: BatchLine) -> dict[str, Any]:
    out: dict[str, Any] = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id,
                           "response": None, "error": None}
    if line.problem is not None:
        out["error"] = {"code": "invalid_request", "message": line.problem}
        return out
    while True:
        # As JSON's escapes and Python's reader write them: a NaN or a lone surrogate gets
        # the 400 the server gives it over HTTP (httpx's own encoder refuses both)
        response = await client.post(line.url, content=json.dumps(line.body),
                                     headers={"content-type": "application/json"})
        try:
            body = response.json()
        except ValueError:  # (an answer that is no JSON: a failure's, or a probe's text)
            body = (response.text if response.status_code < 400 else
                    {"error": {"message": response.text, "type": "server_error"}})
        if not _overloaded(response.status_code, body):
            break
        await asyncio.sleep(float(response.headers.get("retry-after", 1)))  # the queue is full
    # (the id the access log names, as OpenAI's request_id is the x-request-id header's)
    out["response"] = {"status_code": response.status_code,
                       "request_id": response.headers.get("x-request-id"), "body": body}
    return out


def _overloaded(status: int, body: Any) -> bool:
    """Whether the engine's queue turned the request away (a batch waits and resends it)."""
    return status == 503 and isinstance(body, dict) and \
        (body.get("error") or {}).get("code") == "server_overloaded"
