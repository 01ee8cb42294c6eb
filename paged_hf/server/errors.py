"""OpenAI-shaped errors: every error the server answers is JSON ``{"error": {"message", "type", "param", "code"}}``.

Statuses: 400 for a bad request (invalid JSON or UTF-8, a lone surrogate, a bad or unsupported value), 404 for an
unknown model (``model_not_found``) or route, 413 for a body past ``max_request_bytes``, 503 with ``Retry-After``
only for transient overload (the waiting queue is full), and 500 only for faults of the server itself (a request
whose forward failed, an engine loop that died). 500s are logged with their traceback.
"""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

logger = logging.getLogger("paged_hf")

_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
          413: "invalid_request_error", 500: "server_error", 503: "server_error"}


class ApiError(Exception):
    """An error answer: its status, message, the request field it concerns (``param``) and OpenAI's ``code``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.param, _TYPES.get(self.status, "invalid_request_error"), self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error", code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def bad_request(error: ValueError, rename: dict[str, str] | None = None) -> ApiError:
    """A 400 for a ``ValueError`` of the engine or of ``SamplingParams``; ``param`` from a ``ParameterError`` (or the
    "<field> must ..." wording), renamed to the API's field name (``rename``: engine name -> request field)."""
    param = getattr(error, "param", None)
    if param is None:
        match = re.match(r"(\w+) must", str(error))
        param = match.group(1) if match else None
    if param is not None and rename:
        param = rename.get(param, param)
    return ApiError(400, str(error), param)


def internal_error(message: str) -> ApiError:
    return ApiError(500, message, code="internal_error")


def install_handlers(app: FastAPI) -> None:
    """Routing errors (404 unknown route, 405 wrong method), validation errors and unexpected exceptions answer
    in the OpenAI shape too."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        level = logging.WARNING if error.status >= 500 else logging.DEBUG
        logger.log(level, "%s %s -> %d: %s", request.method, request.url.path, error.status, error.message)
        return error.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        message = f"{request.method} {request.url.path}: {error.detail}"
        return ApiError(error.status_code, message, headers=getattr(error, "headers", None)).response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, error: RequestValidationError):
        first = error.errors()[0]
        field = ".".join(str(p) for p in first["loc"] if p not in ("body", "query", "path"))
        return ApiError(400, f"{field}: {first['msg']}", field or None).response()

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception):
        logger.exception("%s %s failed", request.method, request.url.path)
        return internal_error(f"internal error: {type(error).__name__}: {error}").response()
