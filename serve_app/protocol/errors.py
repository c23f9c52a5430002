"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Handlers raise ``APIError``; the exception handlers registered by ``install_handlers`` turn it,
FastAPI's validation errors (never a 422 body) and anything unexpected into that shape. Request
bodies are ``StrictModel``s, whose errors ``from_validation_error`` names by field.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("ray.serve")


class StrictModel(BaseModel):
    """A request body's part: no type coercion (``"5"`` is not a number), no NaN or
    infinities, unknown fields ignored (as OpenAI-compatible servers do)."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error answered with ``status`` and an OpenAI-shaped body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class FieldError(ValueError):
    """A check across fields, raised in a pydantic validator, that names the field at fault
    (the 400's ``param``): pydantic itself gives such errors no location."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def from_validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """The first pydantic error as a 400, naming the field."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request")
    err = errors[0]
    if err.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {err.get('msg')}", code="invalid_json")
    loc = [str(p) for p in err.get("loc", ()) if p not in ("body",)]
    cause = err.get("ctx", {}).get("error")
    if isinstance(cause, FieldError):  # a nested model's check may name its path already
        prefix = ".".join(loc)
        nested = cause.field == prefix or cause.field.startswith(prefix + ".")
        loc = [cause.field] if prefix and nested else [*loc, cause.field]
    param = ".".join(loc) or None
    msg = err.get("msg", "invalid value")
    if err.get("type") == "value_error":
        msg = msg.removeprefix("Value error, ")
    message = f"{param}: {msg}" if param else msg
    if param and "input" in err and err.get("type") != "missing":
        message += f" (got {_short(err['input'])})"
    return APIError(400, message, param=param, code=err.get("type"))


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def install_handlers(app: FastAPI) -> None:
    """Register the handlers that give every error response OpenAI's shape."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error in the Router")
        return APIError(500, f"internal error: {type(exc).__name__}").response()
