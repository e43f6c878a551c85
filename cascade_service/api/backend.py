"""What serves a call once a front end took it: the method table, the `Backend` protocol, and the
context a servicer records its status in when a call arrives as bytes.

The asyncio front end (`api.frontend`) hands each admitted call's bytes to a `Backend`; the
coordinator deployment (`serving.app`) serves bytes forwarded by the edge through a
`RecordingContext`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import grpc

from ..proto.v1 import cascade_pb2 as pb

Reply = tuple[str, str, bytes]  # (status code name, details, serialized response)

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


class Backend(Protocol):
    """What serves a call once the front end admitted it. `owner`: the caller's owner id
    (`rpc.auth.owner_of`), checked against a session's owner by the coordinator. Both methods run on a
    worker thread and may block."""

    def call(
        self,
        method: str,
        request: bytes,
        timeout_s: float | None,
        owner: str = "",
        on_end: Callable[[Callable[[], None]], bool] | None = None,
    ) -> Reply:
        """`on_end(cancel)` registers `cancel` to run when the client's call ends; it returns False when
        the call has ended already (then cancel at once). A client that hangs up cancels the work."""
        ...

    def stream(self, method: str, request: bytes, timeout_s: float | None, owner: str = "") -> Iterator[Reply]:
        """Replies in order. The iterator's `close()` may be called from another thread while a reply
        is being made: it asks the work to stop, and the iteration then ends."""
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
