"""Typed gateway errors and the one middleware that turns every failure into OpenAI JSON.

Owns the mapping from what went wrong to what a client sees: every error answer of the
router, whatever raised it, is `{"error": {"message", "type", "param", "code"}}` with
the status of its `GatewayError` subclass. Handlers and the request parser raise these
exceptions; `error_middleware` (installed once, on the root app, so it also wraps the
admin sub-app) renders them, maps aiohttp's own HTTP exceptions (unknown route, wrong
method, body over `client_max_size`) to the same shape, and turns anything unexpected
into a logged 500 that never leaks internals.

Invariants: the middleware never raises for a request whose response was not started;
a response already streaming is left alone (its bytes are out, a JSON error cannot
follow).
"""

from __future__ import annotations

import logging
import msgspec
from aiohttp import web
from aiohttp.typedefs import Handler

logger = logging.getLogger(__name__)

_encode = msgspec.json.Encoder().encode


class GatewayError(Exception):
    """A failure with an HTTP status and an OpenAI error type; the message is client-safe."""

    status = 500
    error_type = "internal_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def to_body(self) -> bytes:
        return error_body(self.message, self.error_type, param=self.param, code=self.code)


class BadRequest(GatewayError):
    status = 400
    error_type = "invalid_request_error"


class Unauthorized(GatewayError):
    status = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class NotFound(GatewayError):
    status = 404
    error_type = "not_found_error"


class ModelNotFound(NotFound):
    code = "model_not_found"


class MethodNotAllowed(GatewayError):
    status = 405
    error_type = "invalid_request_error"


class Conflict(GatewayError):
    status = 409
    error_type = "conflict_error"


class PayloadTooLarge(GatewayError):
    status = 413
    error_type = "invalid_request_error"
    code = "request_too_large"


class RateLimited(GatewayError):
    status = 429
    error_type = "rate_limit_error"
    code = "rate_limit_exceeded"


class NoEligibleWorker(GatewayError):
    status = 503
    error_type = "service_unavailable_error"
    code = "no_eligible_worker"


class GatewayTimeout(GatewayError):
    status = 504
    error_type = "timeout_error"
    code = "upstream_timeout"


class InternalError(GatewayError):
    status = 500
    error_type = "internal_error"


def error_body(message: str, error_type: str, *, param: str | None = None, code: str | None = None) -> bytes:
    return _encode({"error": {"message": message, "type": error_type, "param": param, "code": code}})


def error_response(exc: GatewayError, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        status=exc.status, body=exc.to_body(), content_type="application/json", headers=headers
    )


def _from_http_exception(exc: web.HTTPException) -> GatewayError:
    """aiohttp's routing and body-size exceptions as typed gateway errors."""
    status = exc.status
    if status == 404:
        return NotFound(f"no such route: {exc.reason}" if exc.reason != "Not Found" else "no such route")
    if status == 405:
        return MethodNotAllowed(f"method not allowed: {exc.text or exc.reason}")
    if status == 413:
        return PayloadTooLarge(exc.text or "request body too large")
    error = GatewayError(exc.text or exc.reason)
    error.status = status
    error.error_type = "invalid_request_error" if 400 <= status < 500 else "internal_error"
    return error


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error the app raises, as OpenAI JSON (see the module docstring)."""
    try:
        return await handler(request)
    except GatewayError as exc:
        return error_response(exc, _extra_headers(exc))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise  # redirects and 2xx raised as exceptions are answers, not errors
        return error_response(_from_http_exception(exc))
    except Exception:
        # A bug, not bad input: log it once with the traceback, never show it.
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(InternalError("internal error"))


def _extra_headers(exc: GatewayError) -> dict[str, str] | None:
    if isinstance(exc, Unauthorized):
        return {"WWW-Authenticate": "Bearer"}
    return None
