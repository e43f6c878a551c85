"""The SDK's exceptions: one class per gRPC status code the service uses, so callers never catch raw grpc errors."""

from __future__ import annotations

import grpc


class CascadeError(Exception):
    """A failed call to cascade-service: `.code` is the grpc.StatusCode, `.details` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str = ""):
        # args stay (code, details) so the exception pickles and re-raises across processes.
        super().__init__(code, details)
        self.code = code
        self.details = details

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
    return _BY_CODE.get(code, CascadeError)(code, details or "")
