"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from collections.abc import Mapping

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from adaserve.api.protocol import ErrorInfo, ErrorResponse

# OpenAI's `type` for each status this server answers with.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answered to the client; `message` says what was wrong and what to do."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def info(self) -> ErrorInfo:
        return ErrorInfo(
            message=self.message,
            type=ERROR_TYPES.get(self.status, "api_error"),
            param=self.param,
            code=self.code,
        )

    def response(self) -> JSONResponse:
        return JSONResponse(
            ErrorResponse(error=self.info()).model_dump(),
            status_code=self.status,
            headers=self.headers,
        )


async def api_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def http_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """Unknown routes and wrong methods, in the same error shape as everything else."""
    assert isinstance(exc, StarletteHTTPException)
    message = {
        404: f"no route {request.url.path}; see GET /v1/models and the docs",
        405: f"method {request.method} is not allowed on {request.url.path}",
    }.get(exc.status_code, str(exc.detail))
    return APIError(exc.status_code, message, headers=exc.headers).response()


async def internal_error_handler(_: Request, exc: Exception) -> JSONResponse:
    """Last resort: a bug of ours, never the client's input (that is a 4xx before here)."""
    return APIError(
        500, f"internal server error ({type(exc).__name__}); see the server log"
    ).response()
