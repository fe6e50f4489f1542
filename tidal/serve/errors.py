"""Error envelopes. Every failure a client sees leaves through here, in OpenAI's shape
``{"error": {"message", "type", "param", "code"}}`` or, on ``/v1/messages*``, Anthropic's
``{"type": "error", "error": {"type", "message"}}``, so SDKs raise their typed exceptions."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("tidal.serve")

OPENAI_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error",
    500: "server_error", 503: "service_unavailable",
}
ANTHROPIC_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error",
    500: "api_error", 503: "overloaded_error",
}


class APIError(Exception):
    """An error with its HTTP status. ``code`` is OpenAI's string code when there is one
    (``context_length_exceeded``, ``model_not_found``, ``invalid_api_key``); otherwise the envelope
    carries the integer status, as vLLM does."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def context_length_error(max_len: int, prompt_tokens: int, max_tokens: int | None) -> APIError:
    """vLLM's wording, with the phrases overflow classifiers match ("maximum context length",
    "prompt is too long", code "context_length_exceeded")."""
    if max_tokens is None:
        asked = f"{prompt_tokens} tokens in the prompt, leaving no room for the completion"
    else:
        asked = f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} in the completion)"
    return APIError(
        400,
        f"This model's maximum context length is {max_len} tokens. However, you requested {asked}. "
        f"Please reduce the length of the prompt or of the completion (prompt is too long).",
        code="context_length_exceeded",
        param="messages",
    )


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def openai_envelope(err: APIError) -> dict[str, Any]:
    return {"error": {
        "message": err.message,
        "type": OPENAI_TYPES.get(err.status, "server_error" if err.status >= 500 else "invalid_request_error"),
        "param": err.param,
        "code": err.code if err.code is not None else err.status,
    }}


def anthropic_envelope(err: APIError) -> dict[str, Any]:
    kind = ANTHROPIC_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def envelope(err: APIError, path: str) -> dict[str, Any]:
    return anthropic_envelope(err) if is_anthropic_path(path) else openai_envelope(err)


def error_response(err: APIError, path: str) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    return JSONResponse(envelope(err, path), status_code=err.status, headers=headers)


def error_bytes(err: APIError, path: str) -> bytes:
    return json.dumps(envelope(err, path)).encode()


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable line per pydantic error; the first error's location is the ``param``."""
    parts, param = [], None
    for e in exc.errors():
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        if param is None and where:
            param = where
        parts.append(f"{where}: {e.get('msg', 'invalid')}" if where else str(e.get("msg", "invalid")))
    return "; ".join(parts) or "invalid request", param


def install_error_handlers(app: FastAPI) -> None:
    """Route every error, FastAPI's own included (422 becomes 400), into the envelopes."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(APIError(400, message, param=param), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"no route {request.method} {request.url.path}"
        return error_response(APIError(exc.status_code, message), request.url.path)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error on %s %s", request.method, request.url.path)
        return error_response(APIError(500, f"internal server error: {type(exc).__name__}: {exc}"), request.url.path)
