"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the status
OpenAI's clients expect for each case (they retry 429 and 5xx, honouring `Retry-After`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from mooncake.gateway.schemas import ErrorBody, ErrorDetail

INVALID = "invalid_request_error"
NOT_FOUND = "not_found_error"
OVERLOADED = "rate_limit_error"
SERVER = "server_error"
TIMEOUT = "timeout_error"
UNAVAILABLE = "service_unavailable_error"

# Conductor rejections that are about the request itself, not the system's load: the
# client must change the request, so retrying (what 429 invites) would not help.
CLIENT_REASONS = frozenset({"invalid_request", "prompt_too_long", "max_tokens_too_large"})


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.detail = ErrorDetail(message=message, type=type_, param=param, code=code)
        self.headers = dict(headers or {})

    @property
    def body(self) -> dict[str, Any]:
        return ErrorBody(error=self.detail).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status, headers=self.headers)


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, INVALID, param=param, code=code)


def invalid_body(exc: ValidationError) -> ApiError:
    """A schema error as one readable line naming the fields, e.g.
    `max_tokens: Input should be greater than or equal to 1`."""
    errors = exc.errors(include_url=False)
    parts = []
    for err in errors[:5]:
        loc = ".".join(str(p) for p in err["loc"]) or "body"
        parts.append(f"{loc}: {str(err['msg']).removeprefix('Value error, ')}")
    more = len(errors) - len(parts)
    message = "; ".join(parts) + (f" (+{more} more)" if more > 0 else "")
    param = str(errors[0]["loc"][0]) if errors and errors[0]["loc"] else None
    return bad_request(message, param=param, code="invalid_value")


def model_not_found(model: str, served: str) -> ApiError:
    return ApiError(
        404,
        f"The model '{model}' does not exist; this server serves '{served}'",
        INVALID,
        param="model",
        code="model_not_found",
    )


def rejected(decision: Mapping[str, Any], retry_after_s: int) -> ApiError:
    """The Conductor's `request.rejected`: 429 + Retry-After when the system is too loaded
    (or has no instance) to meet the SLO; 400 when the request itself was invalid."""
    reason = str(decision.get("reason") or "rejected")
    detail = str(decision.get("detail") or "")
    if reason in CLIENT_REASONS:
        param = "max_tokens" if reason == "max_tokens_too_large" else None
        return bad_request(f"invalid request: {detail or reason}", code=reason, param=param)
    message = f"the request was rejected ({reason}"
    message += f": {detail})" if detail else ")"
    return retry_later(429, message, OVERLOADED, reason, retry_after_s)


def retry_later(status: int, message: str, type_: str, code: str, retry_after_s: int) -> ApiError:
    """A refusal the client should retry: `Retry-After` and the message saying when (the one
    shape of every 429 and of the gateway's own 503 `gateway_overloaded`)."""
    return ApiError(
        status, f"{message}; retry after {retry_after_s} s", type_, code=code,
        headers={"Retry-After": str(retry_after_s)},
    )  # fmt: skip


def gateway_overloaded(limit: int, retry_after_s: int, body_limit: int | None = None) -> ApiError:
    """This gateway already serves `limit` completion requests (or, with `body_limit`, this
    body would take the bodies in flight past it): refused before its body was read, so
    nothing of it reached the pipeline."""
    held = (
        f"its limit of {limit} requests at once (gateway.max_inflight)"
        if body_limit is None
        else f"its limit of {body_limit} bytes of request bodies at once "
        "(gateway.max_inflight_body_bytes)"
    )
    return retry_later(
        503,
        f"the gateway is serving {held}; this request was not accepted (nothing was submitted)",
        UNAVAILABLE, "gateway_overloaded", retry_after_s,
    )  # fmt: skip


def ended_badly(finish_reason: str | None, error: str | None) -> ApiError:
    """A request that ended without an answer: failed in a worker, or cancelled."""
    if finish_reason == "cancelled":
        return ApiError(
            503, "the request was cancelled before it finished", SERVER, code="cancelled"
        )
    return ApiError(500, f"the request failed: {error or 'unknown error'}", SERVER, code="failed")


def timed_out(timeout_s: float) -> ApiError:
    return ApiError(
        504, f"no answer within {timeout_s:g} s; the request was cancelled", TIMEOUT,
        code="timeout",
    )  # fmt: skip


def unavailable(what: str) -> ApiError:
    return ApiError(503, what, UNAVAILABLE, code="unavailable")
