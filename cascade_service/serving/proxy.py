"""cascade.v1.CascadeService on Ray Serve's gRPC proxy, with the rich error details on every call.

Ray's proxy forwards a unary call's trailing metadata from the replica, but a streaming call that
fails reaches it as a raised error, from which it takes only the code and the message. This
`grpc_servicer_functions` entry registers the service and wraps the proxy's handlers for it so that
a call ending in an error without the details trailer gets it, built from that code and message
(`api.status.rich_status`, the same bytes every other front end sends).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from ..api.status import DETAILS_KEY, code_of, rich_status
from ..proto.v1 import cascade_pb2_grpc


def add_cascade_service(servicer: Any, server: Any) -> None:
    """Register CascadeService on `server`; on Ray's proxy server (it builds each handler with its
    `service_handler_factory`), with the details trailer added where a call ends without one."""
    factory = getattr(server, "service_handler_factory", None)
    if factory is None:  # any other server: the plain registration
        cascade_pb2_grpc.add_CascadeServiceServicer_to_server(servicer, server)
        return
    _lost_replicas_are_unavailable()
    server.service_handler_factory = _with_details(factory)
    try:
        cascade_pb2_grpc.add_CascadeServiceServicer_to_server(servicer, server)
    finally:
        server.service_handler_factory = factory  # other services' handlers stay Ray's own


REPLICA_LOST = "the replica serving this call was lost ({}); retry the request"


def _lost_replicas_are_unavailable() -> None:
    """Ray's proxy reports a call whose replica died under it (its node lost, its process killed) as
    INTERNAL, with Ray's message. The call did not complete and a retry reaches a live replica (a session
    is in Redis, so nothing is lost): that is UNAVAILABLE, with a retry hint. The proxy maps exceptions
    to statuses in one function, imported by name into ray.serve._private.proxy; this wraps it there,
    in the proxy's process (where Serve calls this registration), for the actor-death errors only: an
    error raised by the replica's code (RayTaskError) keeps Serve's mapping."""
    from ray.exceptions import RayActorError, RayTaskError
    from ray.serve._private import proxy
    from ray.serve._private.proxy_request_response import ResponseStatus

    original = proxy.get_grpc_response_status
    if getattr(original, "_cascade", False):
        return

    def status(exc: BaseException, request_timeout_s: float | None, request_id: str) -> Any:
        if isinstance(exc, RayActorError) and not isinstance(exc, RayTaskError):
            why = type(exc).__name__
            return ResponseStatus(code=grpc.StatusCode.UNAVAILABLE, is_error=True, message=REPLICA_LOST.format(why))
        return original(exc, request_timeout_s, request_id)

    status._cascade = True  # type: ignore[attr-defined]
    proxy.get_grpc_response_status = status


def _with_details(factory: Callable[..., Any]) -> Callable[..., Any]:
    def make(service_method: str, streaming_type: Any) -> Any:
        handler = factory(service_method=service_method, streaming_type=streaming_type)
        if inspect.isasyncgenfunction(handler):

            async def streaming(request: Any, context: Any) -> AsyncIterator[Any]:
                async for message in handler(request, context):
                    yield message
                add_details(context)

            return streaming

        async def unary(request: Any, context: Any) -> Any:
            response = await handler(request, context)
            add_details(context)
            return response

        return unary

    return make


def add_details(context: Any) -> None:
    """The details trailer for a call that ends in an error and lacks one (grpc's asyncio context)."""
    code = code_of(context.code())
    if code is None or code == grpc.StatusCode.OK:
        return
    trailing = tuple(context.trailing_metadata() or ())
    if any(key == DETAILS_KEY for key, _ in trailing):
        return
    details = rich_status(code, context.details() or "").SerializeToString()
    context.set_trailing_metadata((*trailing, (DETAILS_KEY, details)))
