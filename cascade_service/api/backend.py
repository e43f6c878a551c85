"""What serves a call once a front end took it: the method table, the admitted `Call` (its request
parsed once, by the front end), the `Backend` protocol, and the context a servicer records its status
in when a call arrives without a gRPC context of its own.

The asyncio front end (`api.frontend`) hands each admitted call to a `Backend` on its event loop: the
coordinator in this process (`api.server.LocalBackend`, whose decodes the front end awaits on the
engine loop, with no thread between them), or one that reaches another process (`api.blocking`). The
coordinator deployment (`serving.app`) serves bytes forwarded by the edge through a `RecordingContext`.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias, TypeVar

import grpc
from google.protobuf.message import Message

from ..proto.v1 import cascade_pb2 as pb
from .admission import CallHooks

# A reply's message: a protobuf message where it was made in this process, or its bytes where it
# crossed from another one; each side converts only what it must (`payload_bytes`, `payload_message`).
Payload: TypeAlias = Message | bytes
Reply = tuple[str, str, Payload]  # (status code name, details, the response)
M = TypeVar("M", bound=Message)

# method -> (request type, response type)
UNARY = {
    "Generate": (pb.GenerateRequest, pb.GenerateResponse),
    "CreateSession": (pb.CreateSessionRequest, pb.Session),
    "GetSession": (pb.GetSessionRequest, pb.Session),
    "DeleteSession": (pb.DeleteSessionRequest, pb.DeleteSessionResponse),
}
STREAMING = {"GenerateStream": (pb.GenerateRequest, pb.GenerateChunk)}


def request_type(method: str) -> Any:
    """The request message class of an RPC (functions, unlike the dicts, pickle by reference)."""
    return {**UNARY, **STREAMING}[method][0]


@dataclass(frozen=True)
class Call:
    """One admitted call as a front end hands it to its backend.

    `request`: the request message, parsed once where the call arrived (the gRPC front end decodes its
    body; the HTTP API builds the message). `body`: the bytes it arrived as, for a backend that sends it
    on to another process as they are; None where it was made here. `owner`: the caller's owner id
    (`rpc.auth.owner_of`), checked against a session's owner by the coordinator. `hooks`: where the
    backend registers what stops its work when the call ends (the client hung up, the server drains).
    """

    method: str
    request: Any
    owner: str = ""
    timeout_s: float | None = None
    hooks: CallHooks = field(default_factory=CallHooks)
    body: bytes | None = None

    def wire(self) -> bytes:
        """The request as bytes for another process: those it arrived as, or the message serialized."""
        return self.body if self.body is not None else self.request.SerializeToString()


def payload_bytes(payload: Payload) -> bytes:
    return payload if isinstance(payload, bytes) else payload.SerializeToString()


def payload_message(kind: type[M], payload: Payload) -> M:
    """A reply's message: as made in this process, or parsed from the bytes another process sent."""
    if isinstance(payload, bytes):
        return kind.FromString(payload)
    assert isinstance(payload, kind), f"a {type(payload).__name__} where a {kind.__name__} was due"
    return payload


class Backend(Protocol):
    """What serves an admitted call, on the front end's event loop: it must not block it."""

    async def call(self, call: Call) -> Reply:
        """The reply of a unary call. A call whose hooks end (the client hung up, its deadline passed,
        the server drains) stops its work: a decode at its next round."""
        ...

    def stream(self, call: Call) -> AsyncGenerator[Reply, None]:
        """Replies in order, a failure's status as the last. Closing the iterator early stops the work
        (a decode at its next round) before it returns."""
        ...

    def close(self) -> None:
        """The front end has stopped: free what the backend holds for its calls."""
        ...


class RecordingContext:
    """A servicer context for calls that arrive as bytes: records the status the servicer sets.

    `owner`: the caller's owner id, authenticated by the front end that took the call (`rpc.auth`);
    `cancelled`: says when the caller has gone (the servicer's decode stops at its next round).
    """

    def __init__(self, owner: str = "", cancelled: Callable[[], bool] | None = None) -> None:
        self.code = grpc.StatusCode.OK
        self.details = ""
        self.cascade_owner = owner  # rpc.auth.OWNER_ATTR
        self.cancelled = cancelled

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def invocation_metadata(self) -> tuple:
        return ()

    def set_trailing_metadata(self, metadata: list) -> None:
        """Dropped: the details trailer is a function of code and message (api.status), which the
        front end rebuilds from them."""
