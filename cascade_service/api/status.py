"""Errors a program can read: gRPC's rich error model on every failed call.

Beside its code and message, a failed call carries the trailer `grpc-status-details-bin`: a
serialized `google.rpc.Status` with the same code and message and, by code,
- INVALID_ARGUMENT: a `google.rpc.BadRequest` with one FieldViolation naming the request field (when
  the message names one, as every message of ours about a field does: "max_new_tokens must be ...",
  "verification.beta: give beta or tune_beta, not both");
- RESOURCE_EXHAUSTED, UNAVAILABLE: a `google.rpc.RetryInfo` saying how long to wait before retrying
  (not for a request too large to serve: retrying it cannot help).

The details are a pure function of (code, message), so each front end builds the same bytes from what
it has: the standalone server and the coordinator from the exception, the edge from the code and
message it forwards, Ray Serve's proxy from the status it ends a call with (`serving.proxy`).
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from ..proto.v1 import cascade_pb2

DETAILS_KEY = "grpc-status-details-bin"
# How long a client should wait before retrying: a full queue drains within a few decode rounds; a
# tier or store that is restarting, or a server that is shutting down, needs a little longer.
# What a call refused or cut short by a stop says, on every front end (the standalone server, the
# edge, the Ray coordinator), so a client matches one text.
STOPPING = "the service is stopping; retry the request"
RETRY_DELAY_S = {grpc.StatusCode.RESOURCE_EXHAUSTED: 1.0, grpc.StatusCode.UNAVAILABLE: 2.0}
# What a request past the front end's message limit is told where our code, not gRPC's, refuses it
# (behind Ray's proxy; gRPC itself says "Received message larger than max (N vs. LIMIT)"): its status is
# RESOURCE_EXHAUSTED with no RetryInfo, since the same request can never succeed.
TOO_LARGE = "request too large"
_REQUESTS = ("GenerateRequest", "CreateSessionRequest", "GetSessionRequest", "DeleteSessionRequest")
_LEADING_PATH = re.compile(r"[a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*")


@lru_cache(maxsize=1)
def field_paths() -> frozenset[str]:
    """Every field path of the service's request messages ("max_new_tokens", "verification.alpha")."""
    paths: set[str] = set()

    def walk(message: Descriptor, prefix: str) -> None:
        for field in message.fields:
            path = prefix + field.name
            paths.add(path)
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                walk(field.message_type, path + ".")

    for name in _REQUESTS:
        walk(cascade_pb2.DESCRIPTOR.message_types_by_name[name], "")
    return frozenset(paths)


def field_of(message: str) -> str | None:
    """The request field an error message is about: its leading field path, when it is one."""
    match = _LEADING_PATH.match(message)
    if match is None or match.group() not in field_paths():
        return None
    rest = message[match.end() :]
    return match.group() if rest[:1] in ("", ":", " ") else None


def rich_status(code: grpc.StatusCode, message: str) -> status_pb2.Status:
    details = []
    if code == grpc.StatusCode.INVALID_ARGUMENT and (field := field_of(message)) is not None:
        violation = error_details_pb2.BadRequest.FieldViolation(field=field, description=message)
        details.append(error_details_pb2.BadRequest(field_violations=[violation]))
    if code in RETRY_DELAY_S and not message.startswith(TOO_LARGE):
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(RETRY_DELAY_S[code] * 1e9))
        details.append(error_details_pb2.RetryInfo(retry_delay=delay))
    packed = []
    for detail in details:
        any_detail = any_pb2.Any()
        any_detail.Pack(detail)
        packed.append(any_detail)
    return status_pb2.Status(code=code.value[0], message=message, details=packed)


def too_large(size: int | None, limit: int) -> str:
    """What a request message (or an HTTP body) past the limit is told; size None: not read to its end."""
    read = f"{size} bytes, more" if size is not None else "more"
    return f"{TOO_LARGE}: {read} than the limit of {limit} bytes (serving.admission.max_message_bytes)"


def set_status(context: Any, code: grpc.StatusCode, message: str) -> None:
    """Set code, message and the details trailer on a servicer context (grpc's, Ray Serve's, or a
    RecordingContext); the call then ends with them once the handler returns."""
    context.set_code(code)
    context.set_details(message)
    # A list, not a tuple: Ray Serve's context prepends its request_id entry with `list + ours`, which a
    # tuple makes a TypeError (grpc's own contexts take either).
    context.set_trailing_metadata([(DETAILS_KEY, rich_status(code, message).SerializeToString())])


def abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> None:
    """End the call now with code, message and the details trailer (raises, as context.abort does).
    For grpc's synchronous contexts: on an asyncio one, abort_with_status is a coroutine to await."""
    context.abort_with_status(rpc_status.to_status(rich_status(code, message)))


def code_of(value: Any) -> grpc.StatusCode | None:
    """A context's code() as a StatusCode: grpc's asyncio contexts may hold the number."""
    if value is None or isinstance(value, grpc.StatusCode):
        return value
    return next((c for c in grpc.StatusCode if c.value[0] == value), None)
