"""Errors in OpenAI's JSON shape, ``{"error": {"message", "type", "param", "code"}}``, with the
HTTP status an OpenAI client expects for each of the service's gRPC status codes."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import grpc
from starlette.responses import JSONResponse

from loraplex.server.api import ServiceError


class HttpStatus(NamedTuple):
    status: int
    type: str


# What each status becomes; the openai client raises BadRequestError for 400,
# AuthenticationError 401, PermissionDeniedError 403, NotFoundError 404, RateLimitError 429,
# InternalServerError for 5xx.
_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: HttpStatus(400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: HttpStatus(400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: HttpStatus(400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: HttpStatus(401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: HttpStatus(403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: HttpStatus(404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: HttpStatus(409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: HttpStatus(429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: HttpStatus(499, "cancelled"),
    grpc.StatusCode.UNIMPLEMENTED: HttpStatus(501, "not_implemented_error"),
    grpc.StatusCode.UNAVAILABLE: HttpStatus(503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: HttpStatus(504, "timeout_error"),
}
_INTERNAL = HttpStatus(500, "server_error")


def error_body(message: str, type_: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None
                   ) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status,
                        headers=headers)


def bad_request(message: str, param: str | None = None) -> JSONResponse:
    return error_response(400, message, "invalid_request_error", param)


def _param_of(exc: ServiceError) -> str | None:
    """The field a service message names first (``"max_tokens: over the limit"``)."""
    head = exc.message.split(":", 1)[0]
    return head if head.replace("_", "").replace(".", "").isalnum() and ":" in exc.message \
        else None


def service_error_status(exc: ServiceError) -> HttpStatus:
    return _STATUS.get(exc.code, _INTERNAL)


def service_error_body(exc: ServiceError) -> dict[str, Any]:
    """The JSON body of a ``ServiceError`` (also sent as the last event of a broken stream)."""
    http = service_error_status(exc)
    param = _param_of(exc) if http.status == 400 else None
    if exc.code == grpc.StatusCode.NOT_FOUND:
        param = "model"
    return error_body(exc.message, http.type, param, exc.code.name.lower())


def service_error_response(exc: ServiceError) -> JSONResponse:
    """A ``ServiceError`` as a response; 429s carry ``Retry-After`` (whole seconds, rounded
    up) when the service knows when a retry may pass."""
    http = service_error_status(exc)
    headers = {}
    if exc.retry_after_seconds is not None:
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_seconds)))
    return JSONResponse(service_error_body(exc), status_code=http.status, headers=headers)
