"""The SDK's exceptions: one class per gRPC status code the service uses, so callers never catch raw grpc errors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2

DETAILS_KEY = "grpc-status-details-bin"


@dataclass(frozen=True)
class FieldViolation:
    """A request field the server refused, and why (google.rpc.BadRequest.FieldViolation)."""

    field: str  # e.g. "max_new_tokens", "verification.alpha"
    description: str


class CascadeError(Exception):
    """A failed call to cascade-service: `.code` is the grpc.StatusCode, `.details` the server's message.

    From the rich error details the server sends: `.field_violations` (INVALID_ARGUMENT: the fields at
    fault) and `.retry_delay_s` (RESOURCE_EXHAUSTED, UNAVAILABLE: how long to wait before retrying).
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        details: str = "",
        field_violations: tuple[FieldViolation, ...] = (),
        retry_delay_s: float | None = None,
    ):
        # Every attribute is in args, so the exception pickles and re-raises across processes.
        super().__init__(code, details, tuple(field_violations), retry_delay_s)
        self.code = code
        self.details = details
        self.field_violations = tuple(field_violations)
        self.retry_delay_s = retry_delay_s

    def __str__(self) -> str:
        return f"{self.code.name}: {self.details}" if self.details else self.code.name


class InvalidArgument(CascadeError):
    """The request was malformed (bad sampling values, prompt and prompt_token_ids both given, ...)."""


class NotFound(CascadeError):
    """The named session does not exist."""


class AlreadyExists(CascadeError):
    """A session with the requested id exists already."""


class FailedPrecondition(CascadeError):
    """The server cannot serve the request in its current state."""


class Unavailable(CascadeError):
    """The server could not be reached or is shutting down; safe to retry idempotent calls."""


class DeadlineExceeded(CascadeError):
    """The call ran past its deadline (`timeout_s`)."""


class ResourceExhausted(CascadeError):
    """The server is over capacity or the request exceeds a limit."""


class Unauthenticated(CascadeError):
    """The api key is missing or wrong."""


class PermissionDenied(CascadeError):
    """The api key is valid but may not make this call."""


class Cancelled(CascadeError):
    """The call was cancelled, by the client or the server."""


class Internal(CascadeError):
    """The server failed while handling the request."""


_BY_CODE: dict[grpc.StatusCode, type[CascadeError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.INTERNAL: Internal,
}


def from_rpc_error(e: grpc.RpcError) -> CascadeError:
    """The CascadeError subclass for `e`'s status code; codes without a subclass give a plain CascadeError."""
    # Every RpcError raised by a call is also a grpc.Call (sync) or AioRpcError (async), both with
    # code()/details(); a bare RpcError has neither, so it reads as UNKNOWN.
    code = e.code() if callable(getattr(e, "code", None)) else grpc.StatusCode.UNKNOWN
    details = e.details() if callable(getattr(e, "details", None)) else str(e)
    code = code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN
    violations, delay = rich_details(e)
    return _BY_CODE.get(code, CascadeError)(code, details or "", violations, delay)


def rich_details(e: Any) -> tuple[tuple[FieldViolation, ...], float | None]:
    """(field violations, retry delay in seconds) from a failed call's `grpc-status-details-bin`
    trailer; ((), None) when there is none or it cannot be read (never raises)."""
    try:
        trailing = e.trailing_metadata() if callable(getattr(e, "trailing_metadata", None)) else None
        raw = next((value for key, value in (trailing or ()) if key == DETAILS_KEY), None)
        if raw is None:
            return (), None
        status = status_pb2.Status.FromString(raw)
        violations: list[FieldViolation] = []
        delay = None
        for detail in status.details:
            bad, retry = error_details_pb2.BadRequest(), error_details_pb2.RetryInfo()
            if detail.Unpack(bad):
                violations += [FieldViolation(v.field, v.description) for v in bad.field_violations]
            elif detail.Unpack(retry):
                delay = retry.retry_delay.ToNanoseconds() / 1e9
        return tuple(violations), delay
    except Exception:
        return (), None
