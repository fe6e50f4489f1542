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
    carries the error type as the code: always a string, as OpenAI's is."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after = retry_after  # seconds, sent as Retry-After


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def context_length_error(max_len: int, prompt_tokens: int, max_tokens: int | None, *,
                         prompt_param: str = "messages", max_tokens_param: str = "max_tokens") -> APIError:
    """vLLM's wording ("maximum context length", code "context_length_exceeded"), with the numbers.
    The field at fault is the prompt when it alone does not fit ("prompt is too long", the phrase
    overflow classifiers match), else the output limit."""
    if max_tokens is None or prompt_tokens >= max_len:
        return APIError(
            400,
            f"This model's maximum context length is {max_len} tokens. However, your prompt has "
            f"{prompt_tokens} tokens, leaving no room for the completion (prompt is too long).",
            code="context_length_exceeded", param=prompt_param,
        )
    return APIError(
        400,
        f"This model's maximum context length is {max_len} tokens. However, you requested "
        f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} in the completion): "
        f"{max_tokens_param} can be at most {max_len - prompt_tokens} for this prompt.",
        code="context_length_exceeded", param=max_tokens_param,
    )


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def _openai_type(status: int) -> str:
    return OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def openai_envelope(err: APIError) -> dict[str, Any]:
    return {"error": {
        "message": err.message,
        "type": _openai_type(err.status),
        "param": err.param,
        "code": err.code if err.code is not None else _openai_type(err.status),
    }}


def anthropic_envelope(err: APIError) -> dict[str, Any]:
    kind = ANTHROPIC_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def envelope(err: APIError, path: str) -> dict[str, Any]:
    return anthropic_envelope(err) if is_anthropic_path(path) else openai_envelope(err)


def error_response(err: APIError, path: str) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else {}
    if err.retry_after is not None:
        headers["Retry-After"] = str(err.retry_after)
    return JSONResponse(envelope(err, path), status_code=err.status, headers=headers)


def error_bytes(err: APIError, path: str) -> bytes:
    return json.dumps(envelope(err, path)).encode()


def _json_error(e: dict[str, Any], body: bytes | None) -> str:
    """A JSON syntax error as "line L, column C" (FastAPI gives the character offset)."""
    loc = [x for x in e.get("loc", ()) if x != "body"]
    pos = loc[0] if loc and isinstance(loc[0], int) else None
    reason = (e.get("ctx") or {}).get("error") or "invalid JSON"
    if pos is None:
        return f"the request body is not valid JSON: {reason}"
    text = (body or b"").decode("utf-8", "replace")[:pos]
    line, column = text.count("\n") + 1, pos - (text.rfind("\n") + 1) + 1
    return f"the request body is not valid JSON: {reason} at line {line}, column {column} (char {pos})"


def _validation_message(exc: RequestValidationError, body: bytes | None = None) -> tuple[str, str | None]:
    """One readable line per pydantic error; the first error's location is the ``param`` (none
    for a JSON syntax error: no field is at fault)."""
    parts, param = [], None
    for e in exc.errors():
        if e.get("type") == "json_invalid":
            parts.append(_json_error(e, body))
            continue
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        if param is None and where:
            param = where
        # pydantic's error type after the text, as vLLM's messages carry it (clients match on it)
        text = f"{e.get('msg', 'invalid')} ({e['type']})" if e.get("type") else str(e.get("msg", "invalid"))
        parts.append(f"{where}: {text}" if where else text)
    return "; ".join(parts) or "invalid request", param


def install_error_handlers(app: FastAPI) -> None:
    """Route every error, FastAPI's own included (422 becomes 400), into the envelopes."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        try:
            body = await request.body()
        except Exception:  # noqa: BLE001 - the body is only for the line/column
            body = None
        message, param = _validation_message(exc, body)
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
