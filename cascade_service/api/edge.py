"""The gRPC edge in front of a remote coordinator: bound to the address we choose, forwarding bytes.

`cascade-service serve` runs this in its own process on loopback and forwards each call, as serialized
protobuf bytes, to the coordinator deployment through a `Backend` (a Ray Serve handle; see
`serving.app.HandleBackend`). Ray Serve's own gRPC proxy listens on every interface with no way to
choose, so it is used on clusters (deploy/serve_config.yaml) and not for the local default. The edge
also serves standard health checking and reflection, and turns a client's cancel into a cancel of the
remote call.
"""

from __future__ import annotations

from concurrent import futures
from typing import Any, Callable, Iterator, Protocol

import grpc
from grpc_health.v1 import health_pb2

from .auth import ApiKeys, TlsFiles, bind, interceptors, owner_of
from .server import MAX_QUEUED_RPCS, add_health_and_reflection
from .status import abort
from .servicer import SERVICE_NAME
from .v1 import cascade_pb2 as pb
from .v1 import cascade_pb2_grpc

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
    """`owner`: the caller's owner id (`api.auth.owner_of`), checked against a session's owner remotely."""

    def call(self, method: str, request: bytes, timeout_s: float | None, owner: str = "",
             on_end: Callable[[Callable[[], None]], bool] | None = None) -> Reply:
        """`on_end(cancel)` registers `cancel` to run when the client's call ends (a gRPC context's
        `add_callback`): a client that hangs up cancels the remote call."""
        ...

    def stream(self, method: str, request: bytes, timeout_s: float | None, owner: str = "") -> Iterator[Reply]:
        """Replies in order; closing the iterator cancels the remote call."""
        ...


class RecordingContext:
    """A servicer context for calls that arrive as bytes: records the status the servicer sets.

    `owner`: the caller's owner id, authenticated by the edge that forwarded the call (`api.auth`).
    """

    def __init__(self, owner: str = "") -> None:
        self.code = grpc.StatusCode.OK
        self.details = ""
        self.trailing: tuple = ()
        self.cascade_owner = owner  # api.auth.OWNER_ATTR

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def invocation_metadata(self) -> tuple:
        return ()

    def set_trailing_metadata(self, metadata: Any) -> None:
        # The details trailer is a function of code and message (api.status): the edge rebuilds it.
        self.trailing = tuple(metadata)


def _time_left(context: grpc.ServicerContext) -> float | None:
    """Seconds to the client's deadline; None without one (gRPC then reports about 1e308 seconds,
    which overflows any timer it is handed to)."""
    left = context.time_remaining()
    return None if left is None or left > 10**7 else max(left, 0.0)


def _finish(context: grpc.ServicerContext, code_name: str, details: str) -> bool:
    if code_name == "OK":
        return False
    abort(context, grpc.StatusCode[code_name], details)  # with the same rich details as the coordinator's
    return True


class ForwardingServicer(cascade_pb2_grpc.CascadeServiceServicer):
    def __init__(self, backend: Backend):
        self.backend = backend

    def _unary(self, method: str, request: Any, context: grpc.ServicerContext) -> Any:
        code, details, body = self.backend.call(method, request.SerializeToString(), _time_left(context),
                                                owner_of(context), context.add_callback)
        _finish(context, code, details)
        return UNARY[method][1].FromString(body)

    def Generate(self, request, context):  # noqa: N802
        return self._unary("Generate", request, context)

    def CreateSession(self, request, context):  # noqa: N802
        return self._unary("CreateSession", request, context)

    def GetSession(self, request, context):  # noqa: N802
        return self._unary("GetSession", request, context)

    def DeleteSession(self, request, context):  # noqa: N802
        return self._unary("DeleteSession", request, context)

    def GenerateStream(self, request, context):  # noqa: N802
        replies = self.backend.stream("GenerateStream", request.SerializeToString(), _time_left(context),
                                      owner_of(context))
        context.add_callback(lambda: getattr(replies, "close", lambda: None)())  # client gone: cancel remotely
        try:
            for code, details, body in replies:
                if _finish(context, code, details):
                    return
                yield pb.GenerateChunk.FromString(body)
        finally:
            getattr(replies, "close", lambda: None)()


def start_edge(backend: Backend, host: str = "127.0.0.1", port: int = 0, workers: int = 32,
               api_keys: ApiKeys | None = None, tls: TlsFiles | None = None,
               max_queued: int = MAX_QUEUED_RPCS) -> tuple[grpc.Server, int, Any]:
    """Serve CascadeService + health + reflection on host:port; returns (server, port, health servicer).

    api_keys: when given, every CascadeService call needs one of them (`api.auth`); tls: serve TLS.
    workers calls run at once and max_queued more wait; past that a call gets RESOURCE_EXHAUSTED.
    """
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), interceptors=interceptors(api_keys),
                         maximum_concurrent_rpcs=workers + max_queued)
    cascade_pb2_grpc.add_CascadeServiceServicer_to_server(ForwardingServicer(backend), server)
    checker = add_health_and_reflection(server, serving=False)  # SERVING once the app answers
    bound = bind(server, host, port, tls)
    server.start()
    return server, bound, checker


def set_serving(checker: Any, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", SERVICE_NAME):
        checker.set(name, status)


def health_request() -> Any:
    return health_pb2.HealthCheckRequest()


def is_serving(reply: Any) -> bool:
    return reply.status == health_pb2.HealthCheckResponse.SERVING
