"""Every error the server answers with, in OpenAI's shape {"error": {"message", "type", "param", "code"}},
so that OpenAI SDKs raise their usual exceptions, whatever raised it (validation, our checks, routing)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvpilot.engine.serving.protocol import ErrorInfo, ErrorResponse

log = logging.getLogger(__name__)

# OpenAI's error `type` for each status the server answers with.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}

# Seconds, in the Retry-After header of 429 and 503 answers.
RETRY_AFTER_S = 1


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.retry_after = status, message, param, code, retry_after

    def body(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorInfo(
                message=self.message,
                type=_ERROR_TYPES.get(self.status, "server_error"),
                param=self.param,
                code=self.code,
            )
        )

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected_error)


async def _on_api_error(_request: Request, err: APIError) -> JSONResponse:
    return err.response()


async def _on_validation_error(_request: Request, err: RequestValidationError) -> JSONResponse:
    return _validation_error(err).response()


async def _on_http_error(_request: Request, err: StarletteHTTPException) -> JSONResponse:
    return APIError(
        err.status_code, str(err.detail), code="request_too_large" if err.status_code == 413 else None
    ).response()


async def _on_unexpected_error(_request: Request, err: Exception) -> JSONResponse:
    log.error("event=internal_error error=%r", err)
    return APIError(500, "internal server error").response()


def _validation_error(err: RequestValidationError) -> APIError:
    errors = err.errors()
    if errors[0].get("type") == "json_invalid":
        return APIError(
            400,
            f"the request body is not valid JSON: {errors[0].get('ctx', {}).get('error', errors[0].get('msg'))}",
            code="invalid_json",
        )
    # A union field (prompt, stop) fails once per branch; the deepest failure is the most telling.
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    path = [str(p) for p in first.get("loc", ()) if p != "body" and not _is_union_branch(p)]
    param = path[0] if path else None
    where = f"`{'.'.join(path)}`: " if path else ""
    message = first.get("msg")
    if first.get("type") == "string_unicode":
        message = "the text has an invalid character (a lone UTF-16 surrogate)"
    return APIError(400, f"{where}{message}", param=param, code=first.get("type"))


def _is_union_branch(part: object) -> bool:
    """pydantic names the branch of a union in an error's location: `str`, `list[int]`, `constrained-str`."""
    return isinstance(part, str) and (
        part in {"str", "int", "float", "bool", "list", "dict"} or "[" in part or "-" in part
    )
