"""OpenAI error objects: every failure reaches the client as {"error": {...}}, never a trace."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pkv.core.engine.async_engine import EngineDeadError, EngineStepError, QueueFullError
from pkv.core.structured_output.params import ConstraintCompilerBusyError

logger = logging.getLogger("pkv.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 408: "invalid_request_error",
          413: "invalid_request_error", 431: "invalid_request_error", 429: "rate_limit_error",
          500: "internal_server_error",
          503: "service_unavailable"}


class OpenAIError(Exception):
    """An error to send as an OpenAI error object with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}


# What a refused client is told to wait: the queue moves every engine step.
RETRY_AFTER_S = "1"


def engine_error(exc: Exception) -> OpenAIError | None:
    """The OpenAI error for a failure of the engine or of admission; None for anything else
    (a bug: a plain 500). Overload and a stopped engine are 503s, a failed step a 500."""
    if isinstance(exc, (QueueFullError, ConstraintCompilerBusyError)):
        return OpenAIError(503, str(exc), code="server_overloaded",
                           headers={"Retry-After": RETRY_AFTER_S})
    if isinstance(exc, EngineDeadError):
        return OpenAIError(503, f"the engine is not available: {exc}", code="engine_unavailable",
                           headers={"Retry-After": RETRY_AFTER_S})
    if isinstance(exc, EngineStepError):
        return OpenAIError(500, str(exc), code="generation_failed")
    return None


ENGINE_ERRORS = (QueueFullError, ConstraintCompilerBusyError, EngineDeadError, EngineStepError)


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "error"), "param": param,
                      "code": code}}


def error_response(err: OpenAIError, request: Request | None = None) -> JSONResponse:
    """The error as OpenAI's error object, or Anthropic's on its Messages route."""
    body = error_body(err.status, err.message, err.param, err.code)
    if request is not None:
        body = for_path(body, request.url.path, err.status)
    return JSONResponse(body, status_code=err.status, headers=err.headers)


ANTHROPIC_PATHS = ("/v1/messages",)


def for_path(body: dict, path: str, status: int | None = None) -> dict:
    """An OpenAI error body (sent with HTTP `status`) as the API served at `path` shapes
    errors."""
    return anthropic_error(body, status) if path.startswith(ANTHROPIC_PATHS) else body


def anthropic_error(body: dict, status: int | None = None) -> dict:
    """An OpenAI error body in Anthropic's shape ({"type": "error", "error": {...}})."""
    error = body["error"]
    kind = {"internal_server_error": "api_error",
            "service_unavailable": "overloaded_error"}.get(error["type"], error["type"])
    if status == 413:  # Anthropic's own type for a body over the limit
        kind = "request_too_large"
    return {"type": "error", "error": {"type": kind, "message": error["message"],
                                       "param": error.get("param")}}


def error_bytes(status: int, message: str, path: str, param: str | None = None) -> bytes:
    """The error, as the API served at `path` shapes errors, as JSON (for ASGI middleware,
    which answers before any route)."""
    return json.dumps(for_path(error_body(status, message, param), path, status)).encode()


def _param(loc: list[str | int]) -> str | None:
    """The field a validation error is about, as the client wrote it: the top-level field
    (not pydantic's union branch or a dict key inside it), and for messages the message and
    its field (`messages[2].role`), as for tools (`tools[0].input_schema`)."""
    if not loc:
        return None
    param = str(loc[0])
    if param in ("messages", "tools") and len(loc) > 1 and isinstance(loc[1], int):
        param += f"[{loc[1]}]" + (f".{loc[2]}" if len(loc) > 2 else "")
    return param


def _http_message(exc: StarletteHTTPException) -> str:
    """The HTTP error's message; for a body FastAPI could not parse, why (its own message
    says only that it could not)."""
    cause = exc.__cause__
    if isinstance(cause, RecursionError):
        return "the request body is not valid JSON: it nests too deeply to parse"
    if isinstance(cause, UnicodeDecodeError):
        return f"the request body is not valid JSON: it is not UTF-8 text ({cause.reason} at " \
               f"byte {cause.start})"
    return str(exc.detail)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai(request: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc, request)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":  # its loc is a character offset, no field
            where = first.get("loc", ())[-1]
            reason = first.get("ctx", {}).get("error", first.get("msg"))
            return error_response(OpenAIError(
                400, f"the request body is not valid JSON: {reason} (character {where})"),
                request)
        if first.get("type") == "unicode":  # (RequestBody's check: its param is its path)
            return error_response(OpenAIError(400, first["msg"], first["ctx"]["param"]),
                                  request)
        loc = tuple(first.get("loc", ()))
        # The location's first name says where (the body, the URL's query); a field may be
        # named `query` too (/v1/rerank's).
        param = _param(list(loc[1:] if loc[:1] in (("body",), ("query",)) else loc))
        message = f"{param}: {first.get('msg', 'invalid value')}" if param else str(
            first.get("msg", "invalid request body"))
        if not param and loc[:1] == ("body",):  # the body as a whole
            kind = request.headers.get("content-type", "none")
            message = ("the request body is empty: send a JSON object"
                       if first.get("type") == "missing" else
                       f"the request body must be a JSON object (Content-Type: "
                       f"application/json; this one: {kind})")
        return error_response(OpenAIError(400, message, param), request)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(OpenAIError(exc.status_code, _http_message(exc)), request)

    async def _engine(request: Request, exc: Exception) -> JSONResponse:
        return error_response(engine_error(exc), request)  # type: ignore[arg-type]

    # Each by its own type: a handler of Exception runs in Starlette's outermost middleware,
    # which re-raises after answering (a traceback in the log for a mere refusal).
    for kind in ENGINE_ERRORS:
        app.add_exception_handler(kind, _engine)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s (%s)", request.method, request.url.path,
                         request.scope.get("state", {}).get("request_id"))
        return error_response(OpenAIError(500, "internal server error"), request)
